"""Triton kernel of the experts' weight gradients summed in fp32 by the GEMM (launched from grouped_wgrad.py).

One program per (expert, [BM, BN] tile of its [M, N] gradient), the expert's token rows walked in BK
blocks: acc += dy[rows, m-tile]^T @ x[rows, n-tile] on the tensor cores (bf16 operands, fp32
accumulator), then grad[e, tile] = acc, or += acc with ACCUMULATE (a step's later micro-batches: the
fp32 gradient read and written once, where a bf16 product would be written, read back and added).
The gradient's M rows may be two tensors stacked (W_gate's and W_in's for their stacked GEMM): rows
below SPLIT go to grad [E, SPLIT, N], the rest to grad_hi [E, M - SPLIT, N].
Row blocks cross expert boundaries at any row: loads are masked to the expert's rows. An expert
with no rows writes zeros (or leaves its sum as it is).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_wgrad_kernel(dy, x, ends, grad, grad_hi, M, N, SPLIT, DY_ROW, X_ROW, TILES_M, TILES_N,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr,
                         GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles = TILES_M * TILES_N
    expert = pid // tiles
    tile = pid % tiles
    # neighbouring programs share row blocks of dy: walk the tiles in groups of GROUP_M rows of tiles
    width = GROUP_M * TILES_N
    first_m = (tile // width) * GROUP_M
    rows_in_group = tl.minimum(TILES_M - first_m, GROUP_M)
    tm = first_m + (tile % width) % rows_in_group
    tn = (tile % width) // rows_in_group
    start = tl.load(ends + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(ends + expert).to(tl.int64)
    om = tm * BM + tl.arange(0, BM)
    on = tn * BN + tl.arange(0, BN)
    ok = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(start, end, BK):
        rows = k + ok
        in_rows = rows < end
        a = tl.load(dy + rows[:, None] * DY_ROW + om[None, :], mask=in_rows[:, None] & (om < M)[None, :], other=0.0)
        b = tl.load(x + rows[:, None] * X_ROW + on[None, :], mask=in_rows[:, None] & (on < N)[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    e64 = expert.to(tl.int64)
    lo = om < SPLIT
    row_lo = grad + e64 * SPLIT * N + om * N
    row_hi = grad_hi + e64 * (M - SPLIT) * N + (om - SPLIT) * N
    out = tl.where(lo, row_lo, row_hi)[:, None] + on[None, :]
    mask = (om < M)[:, None] & (on < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)
