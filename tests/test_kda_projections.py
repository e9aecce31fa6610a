"""chunk_kda_from_projections: the composition it defines (against the formulas written out in
float64, tests/reference_math.py), and which implementation its dispatch picks."""

from __future__ import annotations

import pytest
import torch

import reference_math as ref
from moe_lc.ops import kda, kda_projections
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import register_kda_backend
from moe_lc.ops.kda_projections import chunk_kda_from_projections

F64 = torch.float64
HEADS, DIM = 2, 8


def raw(batch, seq_len, heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, z = (torch.randn(batch, seq_len, heads, dim, dtype=F64, generator=gen) for _ in range(4))
    beta_logits = torch.randn(batch, seq_len, heads, dtype=F64, generator=gen)
    a_log = 0.5 * torch.randn(heads, dtype=F64, generator=gen)
    dt_bias = torch.randn(heads * dim, dtype=F64, generator=gen)
    return q, k, v, z, beta_logits, a_log, dt_bias


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def written_out(q, k, v, z, beta_logits, a_log, dt_bias, lower_bound, bounds):
    """KDA(q/sqrt(|q|^2+1e-6), k/..., v, gate(z + b), sigmoid(beta_logits)) token by token, row 0."""
    x = z[0] + dt_bias.view(HEADS, DIM)
    g = ref.bounded_gate(x, a_log, lower_bound) if lower_bound is not None else ref.softplus_gate(x, a_log)
    o = ref.delta_rule(ref.l2_norm(q[0]), ref.l2_norm(k[0]), v[0], g, ref.sigmoid(beta_logits[0]), DIM**-0.5, bounds)
    return o[None]


@pytest.mark.parametrize("lower_bound", [-5.0, -2.0, None])
def test_matches_the_token_recurrence_on_the_written_out_formulas(lower_bound):
    """Two packed documents; the norm, gate, sigmoid, scale and recurrence all written out in float64."""
    args = raw(1, 45, HEADS, DIM, seed=1)
    bounds = [0, 17, 45]
    out, final = chunk_kda_from_projections(*args, lower_bound=lower_bound, output_final_state=True,
                                            docs=DocumentBounds.from_host(bounds, "cpu"))
    assert final.shape == (2, HEADS, DIM, DIM)
    assert rel(out, written_out(*args, lower_bound, bounds)) < 1e-10


# ----------------------------------------------------------------------------- dispatch
@pytest.fixture
def spies(monkeypatch):
    """Replace the three implementations with recorders (keeping each one's real 'supports' check)."""
    calls = []

    def spy(name):
        def run(q, k, v, *rest):
            calls.append(name)
            return torch.zeros_like(v), None
        return run

    table = {name: (spy(name), supports) for name, (_, supports) in kda_projections._BACKENDS.items()}
    monkeypatch.setattr(kda_projections, "_BACKENDS", table)
    return calls


def test_auto_on_cpu_takes_the_torch_composition(spies):
    q, k, v, z, bl, a_log, dt_bias = raw(1, 20, HEADS, DIM, seed=2)
    assert not kda_projections._triton_available(q) and not kda_projections._fla_available(q)
    chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias)
    assert spies == ["torch"]


def test_auto_prefers_triton_then_fla(spies, monkeypatch):
    q, k, v, z, bl, a_log, dt_bias = raw(1, 20, HEADS, DIM, seed=3)
    table = dict(kda_projections._BACKENDS)
    everywhere = lambda q: True  # noqa: E731
    monkeypatch.setitem(kda_projections._BACKENDS, "triton", (table["triton"][0], everywhere))
    monkeypatch.setitem(kda_projections._BACKENDS, "fla", (table["fla"][0], everywhere))
    chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias)
    monkeypatch.setitem(kda_projections._BACKENDS, "triton", table["triton"])
    chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias)
    assert spies == ["triton", "fla"]


@pytest.mark.parametrize("lower_bound, dim, fla_installed, expected", [
    (-5.0, 16, False, "kernel"),   # what the kernels take
    (None, 16, True, "torch"),     # softplus gate: neither kernel has it in-kernel
    (-6.0, 16, True, "fla"),       # a floor beyond the kernels' span: fla's safe gate takes it
    (-5.0, 24, True, "fla"),       # a head dim the kernels were not built for
    (-5.0, 24, False, "torch"),
])
def test_triton_hands_what_it_cannot_take_to_fla_or_torch(monkeypatch, lower_bound, dim, fla_installed, expected):
    # imported here, not at the top: the kernel tests set TRITON_INTERPRET before Triton is first imported
    import moe_lc_kernels.kda as kernels

    calls = []
    monkeypatch.setattr(kernels, "chunk_kda_fused", lambda q, k, v, *a, **kw: calls.append("kernel") or (v, None))
    monkeypatch.setattr(kda_projections, "_fla", lambda q, k, v, *a: calls.append("fla") or (v, None))
    monkeypatch.setattr(kda_projections, "_torch", lambda q, k, v, *a: calls.append("torch") or (v, None))
    monkeypatch.setattr(kda_projections, "_fla_available", lambda q: fla_installed)
    q, k, v, z, bl, a_log, dt_bias = raw(1, 4, 1, dim, seed=4)
    kda_projections._triton(q, k, v, z, bl, a_log, dt_bias, lower_bound, dim**-0.5, None, False, None)
    assert calls == [expected]


def test_registered_kernel_receives_the_normalised_inputs(monkeypatch):
    """A kernel registered for chunk_kda gets l2-normalised q and k, the gate and sigmoid(beta)."""
    q, k, v, z, bl, a_log, dt_bias = raw(1, 20, HEADS, DIM, seed=5)
    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    seen = {}

    def mine(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
        seen.update(q=q, k=k, g=g, beta=beta, scale=scale)
        return kda.chunk_kda(q, k, v, g, beta, scale=scale, backend="torch")

    register_kda_backend("mine", mine)
    out, _ = chunk_kda_from_projections(q, k, v, z, bl, a_log, dt_bias, backend="mine")
    x = z + dt_bias.view(HEADS, DIM)
    assert rel(seen["q"], ref.l2_norm(q)) < 1e-14 and rel(seen["k"], ref.l2_norm(k)) < 1e-14
    assert rel(seen["g"], ref.bounded_gate(x, a_log, -5.0)) < 1e-14 and rel(seen["beta"], ref.sigmoid(bl)) < 1e-14
    assert seen["scale"] == DIM**-0.5
    assert rel(out, written_out(q, k, v, z, bl, a_log, dt_bias, -5.0, None)) < 1e-10


def test_unknown_and_unavailable_backends_are_clear_errors():
    args = raw(1, 4, HEADS, DIM, seed=6)
    with pytest.raises(ValueError, match='unknown backend "nope"'):
        chunk_kda_from_projections(*args, backend="nope")
    with pytest.raises(NotImplementedError, match="needs CUDA"):
        chunk_kda_from_projections(*args, backend="triton")
