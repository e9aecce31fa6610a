"""Triton kernels of the routed experts' token permutation (launched from token_permutation.py).

Each token t owns K rows of the expert-sorted matrix, ``rows[t, s]`` for its slots s (the inverse of
the sort's permutation), so every sum over a token's slots is a gather of K rows, summed in fp32 in
slot order: deterministic, no atomics, no zero-filled buffer. Program (t, b) handles BLOCK columns
of token t. Offsets are int64 (tokens x top-k x width exceeds 2^31 elements at 256K tokens).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_rows_kernel(src, rows, weights, out, width, src_row_stride, K: tl.constexpr, WEIGHTED: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t] = sum_s w[t, s] src[rows[t, s]] (w = 1 unless WEIGHTED), fp32 sums in out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(K):
        r = tl.load(rows + t * K + s).to(tl.int64)
        x = tl.load(src + r * src_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            x = x * tl.load(weights + t * K + s).to(tl.float32)
        acc += x
    tl.store(out + t * width + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def combine_bwd_kernel(du, src, rows, weights, dsrc, dw_parts, width, src_row_stride, blocks, K: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The combine's backward for token t: dsrc[rows[t, s]] = w[t, s] du[t] (each row written once)
    and this block's share of dw[t, s] = src[rows[t, s]] . du[t], into dw_parts[t, s, b]."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    g = tl.load(du + t * width + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(K):
        r = tl.load(rows + t * K + s).to(tl.int64)
        x = tl.load(src + r * src_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dw_parts + (t * K + s) * blocks + b, tl.sum(x * g, axis=0))
        w = tl.load(weights + t * K + s).to(tl.float32)
        tl.store(dsrc + r * width + offs, (w * g).to(dsrc.dtype.element_ty), mask=mask)


@triton.jit
def _block_one_hot(topk_idx, pid, n, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """The block's flat slots f, which exist, their expert ids, and the [BLOCK, E_POW2] one-hot of them."""
    f = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = f < n
    ids = tl.load(topk_idx + f, mask=valid, other=E_POW2).to(tl.int32)
    cols = tl.arange(0, E_POW2)
    return f, valid, ids, cols, (ids[:, None] == cols[None, :]).to(tl.int32)


@triton.jit
def expert_block_counts_kernel(topk_idx, part, n, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """part[b, e] = how many of block b's flat slots go to expert e (int64)."""
    pid = tl.program_id(0)
    _, _, _, cols, one_hot = _block_one_hot(topk_idx, pid, n, E_POW2, BLOCK)
    tl.store(part + pid.to(tl.int64) * E_POW2 + cols, tl.sum(one_hot, axis=0).to(tl.int64))


@triton.jit
def place_by_expert_kernel(topk_idx, part_cum, order, rows, token_of_row, n, K: tl.constexpr,
                           E_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """The stable counting sort's placement: flat slot f with expert e lands at sorted row
    start[e] + (e's slots in earlier blocks) + (e's slots before f in this block); part_cum is the
    blocks' counts summed over the blocks (inclusive), so its last row is every expert's count.
    One program per block: the last block's row is the grid's (a block count passed as an argument
    would be a compile-time 1 for a one-block sort, where tensor methods fail)."""
    pid = tl.program_id(0)
    f, valid, ids, cols, one_hot = _block_one_hot(topk_idx, pid, n, E_POW2, BLOCK)
    totals = tl.load(part_cum + (tl.num_programs(0) - 1).to(tl.int64) * E_POW2 + cols).to(tl.int32)
    starts = tl.cumsum(totals, axis=0) - totals
    previous = tl.load(part_cum + tl.maximum(pid - 1, 0).to(tl.int64) * E_POW2 + cols).to(tl.int32)
    earlier = tl.where(pid > 0, previous, 0)  # e's slots in the blocks before this one
    within = tl.cumsum(one_hot, axis=0) - one_hot  # same-expert slots before each one in the block
    # int32 ranks (the launcher checks that the slots fit), the tile in registers
    rank = tl.sum(tl.where(one_hot != 0, within + (starts + earlier)[None, :], 0), axis=1).to(tl.int64)
    tl.store(order + rank, f, mask=valid)
    tl.store(rows + f, rank, mask=valid)
    tl.store(token_of_row + rank, f // K, mask=valid)
