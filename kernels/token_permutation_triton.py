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
