"""The routed experts' token permutation (moe_lc.ops.token_permutation) and its Triton kernels
(moe_lc_kernels.token_permutation) against the formulas written out in float64:

    x_sorted[i] = z[token_of_row[i]]        dz_t = sum_j dx_sorted[rows[t, j]]
    u_t = sum_j p_tj out[rows[t, j]]        d out[rows[t, j]] = p_tj du_t,   dp_tj = out[rows[t, j]] . du_t

Without a GPU the kernels run in Triton's interpreter, so sizes stay small; a small block makes a
row span several programs and end in a partial one. Tolerances come from the precision: a sum of
n fp32 terms is within n eps32 of the sum of their magnitudes, and an output in a narrower dtype
adds r ulps of it (r = 1/2 on GPUs, which round to nearest; 1 in the interpreter, which truncates).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc_kernels.token_permutation as kernel_module  # noqa: E402
from moe_lc.ops.token_permutation import (combine, expert_order, gather_by_expert, resolve_backend,  # noqa: E402
                                          slot_rows, sort_by_expert)
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
OUTPUT_ROUNDING = 1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.5
TOKENS, K, EXPERTS, WIDTH = 37, 3, 5, 70


@pytest.fixture
def small_blocks(monkeypatch):
    """32 columns a program: a row of 70 spans three programs, the last one partial."""
    monkeypatch.setattr(kernel_module, "TUNING", dict(block=32, warps=4))


def routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token and fp32 weights, as the router gives them."""
    gen = torch.Generator().manual_seed(seed)
    topk = torch.rand(TOKENS, EXPERTS, generator=gen).argsort(-1)[:, :K]
    weights = torch.rand(TOKENS, K, generator=gen) + 0.1
    return topk.to(DEVICE), weights.to(DEVICE)


def within(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, terms: int, dtype: torch.dtype, what: str):
    """|got - want| <= terms eps32 magnitude + r eps_out |want| (+ a tiny absolute floor for zeros)."""
    eps_out = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    bound = terms * EPS32 * magnitude + OUTPUT_ROUNDING * eps_out * want.abs() + 1e-30
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{what}: worst error {err.max():.3e} where the bound allows {bound.flatten()[err.argmax()]:.3e}"


def test_slot_rows_invert_the_sort():
    topk, _ = routing()
    order, token_of_row, counts = sort_by_expert(topk, EXPERTS)
    rows = slot_rows(order, K)
    assert rows.shape == (TOKENS, K)
    assert torch.equal(order[rows.reshape(-1)], torch.arange(TOKENS * K, device=DEVICE))
    assert torch.equal(token_of_row[rows], torch.arange(TOKENS, device=DEVICE)[:, None].expand(TOKENS, K))
    assert int(counts.sum()) == TOKENS * K


@pytest.mark.parametrize("experts", [5, 256, 257, 40_000])
def test_the_sort_is_the_stable_order_of_the_expert_ids_at_any_expert_count(experts):
    """The ids are sorted in a narrower type than the router's int64 (one radix pass a byte): the
    order is still the stable argsort of the int64 ids and the counts those of a bincount, at the
    edges of each type (256 experts: ids up to 255; 257: one more than a byte)."""
    gen = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (401, 4), generator=gen)
    ids[0, 0], ids[1, 1] = experts - 1, 0  # both ends of the range
    order, token_of_row, counts = sort_by_expert(ids.to(DEVICE), experts)
    want = torch.sort(ids.reshape(-1), stable=True)[1]
    assert order.dtype == torch.int64 and torch.equal(order.cpu(), want)
    assert torch.equal(token_of_row.cpu(), want // 4)
    assert torch.equal(counts.cpu(), torch.bincount(ids.reshape(-1), minlength=experts))


@pytest.mark.parametrize("experts,tokens", [(5, 401), (64, 37), (257, 300), (1024, 5), (6, 0)])
def test_the_counting_sort_is_the_stable_sort_exactly(experts, tokens, monkeypatch):
    """expert_order's Triton counting sort against the reference (torch's stable sort, the search for
    the counts, the inverse's scatter): the same order, tokens, counts and rows, bit for bit, with
    the slots spread over many blocks (16 a block) and over none."""
    monkeypatch.setattr(kernel_module, "SORT_TILE_SLOTS", 16 * 64)
    gen = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (tokens, 4), generator=gen)
    if tokens:
        ids[0, 0], ids[-1, -1] = experts - 1, 0  # both ends of the range
    got = expert_order(ids.to(DEVICE), experts, "triton")
    want = expert_order(ids.to(DEVICE), experts, "torch")
    assert [t.shape for t in got] == [t.shape for t in want] == [(tokens * 4,), (tokens * 4,), (experts,), (tokens, 4)]
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_combine_and_its_gradients_match_float64(dtype, backend, small_blocks):
    topk, weights = routing(1)
    order, _, _ = sort_by_expert(topk, EXPERTS)
    rows = slot_rows(order, K)
    gen = torch.Generator().manual_seed(2)
    out = torch.randn(TOKENS * K, WIDTH, generator=gen).to(DEVICE, dtype).requires_grad_(True)
    du = torch.randn(TOKENS, WIDTH, generator=gen).to(DEVICE, dtype)
    p = weights.clone().requires_grad_(True)
    u = combine(out, order, rows, p, dtype, backend)
    d_out, dp = torch.autograd.grad(u, (out, p), du)
    assert u.dtype == d_out.dtype == dtype and dp.dtype == torch.float32
    o64, p64, du64 = out.detach().double(), weights.double(), du.double()
    terms = o64[rows] * p64[..., None]  # [T, k, width]
    within(u, terms.sum(1), terms.abs().sum(1), K, dtype, "u")
    want_d_out = torch.empty_like(o64)
    want_d_out[rows.reshape(-1)] = (p64[..., None] * du64[:, None, :]).reshape(-1, WIDTH)
    within(d_out, want_d_out, want_d_out.abs(), 1, dtype, "d out")
    dots = o64[rows] * du64[:, None, :]
    within(dp, dots.sum(-1), dots.abs().sum(-1), WIDTH, torch.float32, "dp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gather_and_its_gradient_match_float64(dtype, backend, small_blocks):
    topk, _ = routing(3)
    order, token_of_row, _ = sort_by_expert(topk, EXPERTS)
    rows = slot_rows(order, K)
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(TOKENS, WIDTH, generator=gen).to(DEVICE, dtype).requires_grad_(True)
    dx = torch.randn(TOKENS * K, WIDTH, generator=gen).to(DEVICE, dtype)
    x = gather_by_expert(z, token_of_row, rows, backend)
    assert torch.equal(x, z.detach()[token_of_row])
    dz, = torch.autograd.grad(x, z, dx)
    terms = dx.double()[rows]  # [T, k, width]
    # the reference accumulates in the input's dtype (index_put): k roundings of it, not of fp32
    rounding = K if backend == "torch" and dtype != torch.float32 else 1
    eps_sum = K * (EPS32 if dtype == torch.float32 or backend == "triton" else torch.finfo(dtype).eps)
    err, bound = (dz.double() - terms.sum(1)).abs(), eps_sum * terms.abs().sum(1)
    bound = bound + rounding * OUTPUT_ROUNDING * (torch.finfo(dtype).eps if dtype != torch.float32 else 0) * terms.sum(1).abs()
    assert (err <= bound + 1e-30).all(), f"dz: worst error {err.max():.3e}"


def test_the_kernels_are_deterministic_and_write_every_row(small_blocks):
    """Each sorted row is written once by the combine's backward (no zero-fill): two runs bitwise equal,
    and poisoned output memory does not show through."""
    topk, weights = routing(5)
    order, _, _ = sort_by_expert(topk, EXPERTS)
    rows = slot_rows(order, K)
    out = torch.randn(TOKENS * K, WIDTH).to(DEVICE, torch.bfloat16)
    du = torch.randn(TOKENS, WIDTH).to(DEVICE, torch.bfloat16)
    first = kernel_module.combine_backward_triton(du, out, rows, weights)
    real_empty = torch.Tensor.new_empty

    def poisoned(self, *shape, **kwargs):
        t = real_empty(self, *shape, **kwargs)
        return t.fill_(torch.nan) if t.is_floating_point() else t

    try:
        torch.Tensor.new_empty = poisoned
        second = kernel_module.combine_backward_triton(du, out, rows, weights)
    finally:
        torch.Tensor.new_empty = real_empty
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not first[0].isnan().any()


def test_the_custom_ops_trace_without_graph_breaks(small_blocks):
    """The Triton paths are torch.library custom ops: their fake (meta) functions and autograd pass
    torch's own checks, and a compiled function calling them has no graph break and the same values."""
    topk, weights = routing(6)
    order, token_of_row, _ = sort_by_expert(topk, EXPERTS)
    rows = slot_rows(order, K)
    z = torch.randn(TOKENS, WIDTH, device=DEVICE, requires_grad=True)
    out = torch.randn(TOKENS * K, WIDTH, device=DEVICE, requires_grad=True)
    p = weights.clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.moe_lc.gather_token_rows.default, (z, token_of_row, rows))
    torch.library.opcheck(torch.ops.moe_lc.combine_token_rows.default, (out, rows, p, torch.float32))
    torch.library.opcheck(torch.ops.moe_lc.expert_order.default, (topk, EXPERTS),
                          test_utils=("test_schema", "test_faketensor"))  # integer outputs: no autograd
    sort = torch.compile(lambda ids: expert_order(ids, EXPERTS, "triton"), backend="aot_eager", fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(sort(topk), expert_order(topk, EXPERTS, "torch")))

    def step(z, out, p):
        return gather_by_expert(z, token_of_row, rows, "triton").sum() + combine(out, order, rows, p, torch.float32,
                                                                                  "triton").square().sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = step(z, out, p)
    grads = torch.autograd.grad(eager, (z, out, p))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(z, out, p)
    assert torch.equal(compiled, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(compiled, (z, out, p)), grads))


def test_dispatch_choices_and_errors():
    x = torch.zeros(6, 4, device=DEVICE)
    rows = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    assert resolve_backend(x, rows, "auto") == ("triton" if x.is_cuda else "torch")  # never the CPU interpreter
    assert resolve_backend(x, rows, "torch") == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend(x, rows, "cuda")
    with pytest.raises(RuntimeError, match="want rows"):
        resolve_backend(x, rows[:2], "triton")
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        resolve_backend(x.double(), rows, "triton")


def test_a_moe_layer_is_the_same_through_either_backend():
    """LatentMoE with ``dispatch_backend`` triton against torch (fp32): the same output and gradients up
    to fp32 rounding of the sums (the routing, computed before the permutation, is the same). The
    sums of k terms round apart by ~k eps32 and pass through the latent norm and the GEMMs after
    them, so each tensor is compared as a whole: within 1e-5 relative in norm (~80 eps32)."""
    import dataclasses

    from moe_lc.config import MoEConfig
    from moe_lc.model.moe import LatentMoE
    from reference_checks import output_and_gradients, randomize

    cfg = MoEConfig(num_routed=6, top_k=2, num_shared=1, latent_dim=16, expert_hidden=24)
    layers = {b: randomize(LatentMoE(32, dataclasses.replace(cfg, dispatch_backend=b)), seed=7).to(DEVICE)
              for b in ("torch", "triton")}
    x = torch.randn(2, 9, 32, device=DEVICE)
    results = {backend: output_and_gradients(layer, x) for backend, layer in layers.items()}
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert ((b - a).norm() / a.norm()).item() < 1e-5
