"""The experts' weight gradients summed in fp32 by a grouped GEMM (moe_lc_kernels.grouped_wgrad), in
Triton's interpreter against the formula in float64: grad[e] = dy_e^T x_e over each expert's rows."""

from __future__ import annotations

import pytest
import torch

from moe_lc_kernels import grouped_wgrad as gw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU (tests/conftest.py)


def case(counts: list[int], m: int = 40, n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    dy = torch.randn(rows, m, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    return dy.to(DEVICE), x.to(DEVICE), ends.to(DEVICE)


def formula(dy: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts, start = [], 0
    for c in counts:
        parts.append(dy[start:start + c].cpu().double().t() @ x[start:start + c].cpu().double())
        start += c
    return torch.stack(parts)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch, request):
    """Tiles of 16 so that 40 x 24 gradients take partial tiles and experts take several row blocks;
    bf16 dots made exact in Triton's interpreter (tests/conftest.py)."""
    if DEVICE == "cpu":
        request.getfixturevalue("exact_bf16_dots")
    monkeypatch.setattr(gw, "TUNING", dict(gw.TUNING, bm=16, bn=16, bk=16, group_m=2, warps=1, stages=1))


def test_each_expert_gets_the_product_of_its_own_rows():
    """Experts of 5, 0, 70 and 33 rows (an empty one, blocks that straddle experts): bf16 products are
    exact in fp32 and ~100 of them are summed, so 1e-6 of the gradient's scale; a row block read past an
    expert's end, or an expert's first block skipped, moves an entry by O(1)."""
    counts = [5, 0, 70, 33]
    dy, x, ends = case(counts)
    grad = torch.full((4, 40, 24), float("nan"), device=DEVICE)
    gw.grouped_wgrad_([grad], dy, x, ends, accumulate=False)
    want = formula(dy, x, counts)
    assert (grad.cpu().double() - want).abs().max() < 1e-6 * want.abs().max()
    assert torch.equal(grad[1].cpu(), torch.zeros(40, 24))  # no rows: zeros, not what was there


def test_accumulate_adds_into_the_fp32_sum():
    """A second micro-batch (other rows, other counts) adds into the first one's sum."""
    first, second = [5, 0, 70, 33], [17, 40, 0, 9]
    dy1, x1, ends1 = case(first, seed=1)
    dy2, x2, ends2 = case(second, seed=2)
    grad = torch.empty(4, 40, 24, device=DEVICE)
    gw.grouped_wgrad_([grad], dy1, x1, ends1, accumulate=False)
    gw.grouped_wgrad_([grad], dy2, x2, ends2, accumulate=True)
    want = formula(dy1, x1, first) + formula(dy2, x2, second)
    assert (grad.cpu().double() - want).abs().max() < 1e-6 * want.abs().max()


def test_two_stacked_gradients_take_their_own_rows():
    """The stacked GEMM's gradient split at row 22 (inside a 16-row tile) into two tensors: each gets its
    rows of the product, the first 22 and the other 18."""
    counts = [5, 0, 70, 33]
    dy, x, ends = case(counts)
    low, high = torch.empty(4, 22, 24, device=DEVICE), torch.empty(4, 18, 24, device=DEVICE)
    gw.grouped_wgrad_([low, high], dy, x, ends, accumulate=False)
    want = formula(dy, x, counts)
    got = torch.cat([low, high], dim=1).cpu().double()
    assert (got - want).abs().max() < 1e-6 * want.abs().max()


def test_bad_operands_are_named():
    dy, x, ends = case([3, 4])
    with pytest.raises(ValueError, match="fp32 grads"):
        gw.grouped_wgrad_([torch.zeros(2, 40, 24, dtype=torch.bfloat16, device=DEVICE)], dy, x, ends, accumulate=False)
    with pytest.raises(ValueError, match=r"grads \[E, M_i, N\]"):
        gw.grouped_wgrad_([torch.zeros(2, 24, 40, device=DEVICE)], dy, x, ends, accumulate=False)
