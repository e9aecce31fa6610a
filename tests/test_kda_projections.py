"""chunk_kda_from_projections: the composition it defines, and its dispatch."""

from __future__ import annotations

import pytest
import torch

from moe_lc.ops import kda
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import recurrent_kda, register_kda_backend
from moe_lc.ops.kda_projections import chunk_kda_from_projections

F64 = torch.float64


def raw(batch, seq_len, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, z = (torch.randn(batch, seq_len, heads, dim, dtype=F64, generator=gen) for _ in range(4))
    beta_logits = torch.randn(batch, seq_len, heads, dtype=F64, generator=gen)
    a_log = 0.5 * torch.randn(heads, dtype=F64, generator=gen)
    dt_bias = torch.randn(heads * dim, dtype=F64, generator=gen)
    return q, k, v, z, beta_logits, a_log, dt_bias


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, None])
def test_matches_the_token_recurrence_on_the_written_out_formulas(lower_bound):
    """o = KDA(q/sqrt(|q|^2+1e-6), k/..., v, g(z), sigmoid(beta_logits)) with the gate written out here,
    token by token, for two packed documents."""
    q, k, v, z, bl, a_log, dt_bias = raw(1, 45, 2, 8, seed=1)
    docs = DocumentBounds.from_host([0, 17, 45], "cpu")
    x = z + dt_bias.view(2, 8)
    rate = a_log.exp()[:, None]
    g = (lower_bound * torch.sigmoid(rate * x) if lower_bound is not None
         else -rate * torch.log1p(torch.exp(x)))
    norm = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    ref, ref_final = recurrent_kda(norm(q), norm(k), v, g, torch.sigmoid(bl), output_final_state=True,
                                   docs=docs)
    out, final = chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, lower_bound=lower_bound,
                                            output_final_state=True, docs=docs)
    assert rel(out, ref) < 1e-10 and rel(final, ref_final) < 1e-10


def test_dispatch(monkeypatch):
    q, k, v, z, bl, a_log, dt_bias = raw(1, 20, 2, 8, seed=2)
    ref, _ = chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, backend="torch")
    auto, _ = chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias)  # CPU: no kernel takes it
    assert torch.equal(auto, ref)

    # a kernel registered for chunk_kda receives the normalised q, the gate and beta
    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    seen = {}

    def mine(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
        seen.update(q=q, g=g, beta=beta)
        return kda.chunk_kda(q, k, v, g, beta, scale=scale, backend="torch")

    register_kda_backend("mine", mine)
    out, _ = chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, backend="mine")
    assert torch.allclose(seen["q"].norm(dim=-1), torch.ones(1, 20, 2, dtype=F64), atol=1e-4)
    assert bool((seen["g"] > -5).all() and (seen["beta"] > 0).all()) and rel(out, ref) < 1e-12

    with pytest.raises(ValueError, match='unknown backend "nope"'):
        chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, backend="nope")
    with pytest.raises(NotImplementedError, match="needs CUDA"):
        chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, backend="triton")
