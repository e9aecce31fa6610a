"""Triton kernels of the MoE router (launched from routing.py).

    s = sigmoid(logits)   T = argtop_k(s + b)   alpha = the (k+1)-th largest s + b   p_j = scale s_j / sum_T s

Every program owns BLOCK_T tokens and all E experts of each ([BLOCK_T, E_POW2] tiles, experts past E
masked), so the selection is K + 1 rounds of a max over a tile row in registers: no sort, no
[tokens, experts] intermediate in memory. Ties go to the lower expert index; the slots come out in
descending order of s + b (torch.topk's sorted order). Math in fp32 from logits of any float dtype
whose rows may lie ``row_stride`` elements apart (columns of a wider GEMM output).

``route_statistics_kernel`` adds one micro-batch to Quantile Balancing's step statistics: the
expert loads and, with HISTOGRAM, the histogram of required biases r_ij = alpha_i - s_ij over
[min b - 1, max b + 1] in BINS bins (fp64 bin arithmetic, as ``QuantileHistogram.add_required``);
integer atomic adds, so the counts do not depend on the programs' order. The loads are summed per
program first (one atomic add per expert and program, not per token).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lc_kernels.fast_math_triton import sigmoid_pair


@triton.jit
def _scores(logits, rows, row_in, cols, col_in, row_stride):
    """fp32 sigmoid scores [BLOCK_T, E_POW2] of the tile (0 outside it)."""
    offs = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    mask = row_in[:, None] & col_in[None, :]
    x = tl.load(logits + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, sigmoid_pair(x)[0], 0.0)


@triton.jit
def _slot(tile, slots, j):
    """Column j of a [BLOCK_T, K_POW2] tile, as a [BLOCK_T] vector."""
    return tl.sum(tl.where(slots[None, :] == j, tile, 0), axis=1)


@triton.jit
def route_fwd_kernel(logits, bias, topk_idx, weights, cutoff, T, row_stride, scale, E: tl.constexpr,
                     E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """topk_idx [T, K] int64, weights [T, K] fp32 (p, in slot order) and cutoff [T] fp32 (alpha)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    cols = tl.arange(0, E_POW2)
    col_in = cols < E
    s = _scores(logits, rows, row_in, cols, col_in, row_stride)
    b = tl.load(bias + cols, mask=col_in, other=0.0).to(tl.float32)
    remaining = tl.where(col_in[None, :], s + b[None, :], float("-inf"))
    slots = tl.arange(0, K_POW2)
    idx_tile = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    s_tile = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        pick = tl.min(tl.where(remaining == best[:, None], cols[None, :], E_POW2), axis=1)  # lowest index
        chosen = cols[None, :] == pick[:, None]
        s_j = tl.sum(tl.where(chosen, s, 0.0), axis=1)
        idx_tile = tl.where(slots[None, :] == j, pick[:, None], idx_tile)
        s_tile = tl.where(slots[None, :] == j, s_j[:, None], s_tile)
        remaining = tl.where(chosen, float("-inf"), remaining)
    alpha = tl.max(remaining, axis=1)  # the (k+1)-th biased score
    total = tl.where(row_in, tl.sum(s_tile, axis=1), 1.0)  # rows past T: no 0 / 0
    p = s_tile / total[:, None] * scale
    out = rows.to(tl.int64)[:, None] * K + slots[None, :]
    slot_mask = row_in[:, None] & (slots[None, :] < K)
    tl.store(topk_idx + out, idx_tile.to(tl.int64), mask=slot_mask)
    tl.store(weights + out, p, mask=slot_mask)
    tl.store(cutoff + rows, alpha, mask=row_in)


@triton.jit
def route_bwd_kernel(logits, topk_idx, dweights, dlogits, T, row_stride, scale, E: tl.constexpr,
                     E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """dlogits [T, E] (contiguous, zero off the selected experts) from dweights [T, K]:
    ds_m = scale (dp_m - sum_j dp_j s_j / S) / S over the slots, S = sum_j s_j, then ds s (1 - s)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    slots = tl.arange(0, K_POW2)
    slot_mask = row_in[:, None] & (slots[None, :] < K)
    at = rows.to(tl.int64)[:, None] * K + slots[None, :]
    idx = tl.load(topk_idx + at, mask=slot_mask, other=0)
    x = tl.load(logits + rows.to(tl.int64)[:, None] * row_stride + idx, mask=slot_mask, other=0.0).to(tl.float32)
    s = tl.where(slot_mask, sigmoid_pair(x)[0], 0.0)
    dp = tl.load(dweights + at, mask=slot_mask, other=0.0).to(tl.float32)
    total = tl.where(row_in, tl.sum(s, axis=1), 1.0)
    dot = tl.sum(dp * s, axis=1)
    ds = scale * (dp - (dot / total)[:, None]) / total[:, None]
    dx = ds * s * (1.0 - s)
    cols = tl.arange(0, E_POW2)
    dense = tl.zeros([BLOCK_T, E_POW2], dtype=tl.float32)
    for j in tl.static_range(K):
        idx_j = _slot(idx, slots, j)
        dx_j = _slot(dx, slots, j)
        dense = tl.where(cols[None, :] == idx_j[:, None], dx_j[:, None], dense)
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(dlogits + offs, dense.to(dlogits.dtype.element_ty), mask=row_in[:, None] & (cols[None, :] < E))


@triton.jit
def route_statistics_kernel(logits, bias, topk_idx, cutoff, loads, hist, value_range, T, row_stride,
                            E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                            BINS: tl.constexpr, BLOCK_T: tl.constexpr, HISTOGRAM: tl.constexpr):
    """loads[e] += tokens routed to e; with HISTOGRAM, hist[e, bin(r_ie)] += 1 for every token i and
    value_range = [min b - 1, max b + 1] (the range the bins cover)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_in = rows < T
    cols = tl.arange(0, E_POW2)
    col_in = cols < E
    slots = tl.arange(0, K_POW2)
    slot_mask = row_in[:, None] & (slots[None, :] < K)
    idx = tl.load(topk_idx + rows.to(tl.int64)[:, None] * K + slots[None, :], mask=slot_mask, other=E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        idx_j = _slot(idx, slots, j)
        hit = (cols[None, :] == idx_j[:, None]) & row_in[:, None]
        counts += tl.sum(hit.to(tl.int32), axis=0)
    tl.atomic_add(loads + cols, counts.to(tl.int64), mask=col_in & (counts > 0))
    if HISTOGRAM:
        b = tl.load(bias + cols, mask=col_in, other=0.0).to(tl.float64)
        lo = tl.min(tl.where(col_in, b, float("inf")), axis=0) - 1.0
        hi = tl.max(tl.where(col_in, b, float("-inf")), axis=0) + 1.0
        width = (hi - lo) / BINS
        s = _scores(logits, rows, row_in, cols, col_in, row_stride)
        alpha = tl.load(cutoff + rows, mask=row_in, other=0.0)
        required = (alpha[:, None] - s).to(tl.float64)
        bins = tl.floor((required - lo) / width).to(tl.int64)
        bins = tl.minimum(tl.maximum(bins, 0), BINS - 1)
        slot = cols.to(tl.int64)[None, :] * BINS + bins
        ones = tl.full([BLOCK_T, E_POW2], 1, dtype=tl.int64)
        tl.atomic_add(hist + slot, ones, mask=row_in[:, None] & col_in[None, :])
        if pid == 0:
            tl.store(value_range, lo)
            tl.store(value_range + 1, hi)
