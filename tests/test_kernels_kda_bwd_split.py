"""The split backward (``_bwd_vside_kernel`` + ``_bwd_kside_kernel``, TUNING bwd_split=1) against the
single ``_bwd_intra_kernel`` (bwd_split=0) and float64: same gradients, both within 1e-4.

Runs in Triton's interpreter on a machine without a GPU (small shapes, fp32 inputs).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moe_lc.ops.kda import chunk_kda, kda_gate  # noqa: E402
from moe_lc_kernels import kda, triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

TOL = 1e-4


def _inputs(batch: int, seq_len: int, heads: int, dim: int, num_states: int | None, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE).requires_grad_()

    x = dict(q=rnd(batch, seq_len, heads, dim), k=rnd(batch, seq_len, heads, dim), v=rnd(batch, seq_len, heads, dim),
             z=rnd(batch, seq_len, heads, dim, scale=2.0), beta=rnd(batch, seq_len, heads),
             A_log=rnd(heads, scale=0.5), dt_bias=rnd(heads * dim))
    h0 = None if num_states is None else rnd(num_states, heads, dim, dim)
    return x, h0


def _grads(x: dict, h0: torch.Tensor | None, cu: torch.Tensor | None, segment_chunks: int | None,
           split: int | None) -> list[torch.Tensor]:
    """Outputs and the gradient of every input: the Triton op with bwd_split=split, or float64 (None)."""
    params = list(x.values()) + ([h0] if h0 is not None else [])
    if split is None:
        d = {n: t.double() for n, t in x.items()}

        def norm(t: torch.Tensor) -> torch.Tensor:
            return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)

        g = kda_gate(d["z"], d["A_log"], d["dt_bias"], lower_bound=-5.0)
        out, final = chunk_kda(norm(d["q"]), norm(d["k"]), d["v"], g, torch.sigmoid(d["beta"]),
                               initial_state=None if h0 is None else h0.double(), output_final_state=True,
                               cu_seqlens=cu, backend="torch")
    else:
        saved = kda.TUNING["bwd_split"]
        kda.TUNING["bwd_split"] = split
        try:
            out, final = kda.chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                             initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                             segment_chunks=segment_chunks)
            gen = torch.Generator().manual_seed(7)
            do, ds = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
            grads = torch.autograd.grad((out * do.to(DEVICE)).sum() + (final * ds.to(DEVICE)).sum(), params)
        finally:
            kda.TUNING["bwd_split"] = saved
        return [t.detach().double().cpu() for t in grads]
    gen = torch.Generator().manual_seed(7)
    do, ds = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
    grads = torch.autograd.grad((out * do.double().to(DEVICE)).sum() + (final * ds.double().to(DEVICE)).sum(), params)
    return [t.detach().cpu() for t in grads]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite gradient"
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("case", ["packed_docs_state_seg1", "plain_batch"])
def test_split_backward_matches_single_kernel_and_float64(case: str) -> None:
    if case == "packed_docs_state_seg1":
        cu = torch.tensor([0, 3, 70, 200], dtype=torch.int32, device=DEVICE)
        x, h0 = _inputs(1, 200, 2, 32, num_states=3, seed=5)
        segment_chunks = 1
    else:
        cu, segment_chunks = None, 0
        x, h0 = _inputs(2, 130, 1, 32, num_states=None, seed=6)
    ref = _grads(x, h0, cu, None, None)
    split = _grads(x, h0, cu, segment_chunks, 1)
    single = _grads(x, h0, cu, segment_chunks, 0)
    names = list(x) + (["h0"] if h0 is not None else [])
    errors = {n: (_rel(a, r), _rel(b, r), _rel(a, b.double())) for n, a, b, r in zip(names, split, single, ref)}
    bad = {n: e for n, e in errors.items() if not max(e) < TOL}
    assert not bad, f"(split vs f64, single vs f64, split vs single) above {TOL}: {bad}"
