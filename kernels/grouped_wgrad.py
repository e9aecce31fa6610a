"""The routed experts' weight gradients with their fp32 sum over a step's micro-batches done by the GEMM.

    grad[e] (+)= dy[rows of e]^T @ x[rows of e]        grad fp32 [E, M, N], dy [T, M], x [T, N] bf16

Why: ``torch._grouped_mm`` writes each micro-batch's weight gradients in bf16, and a second pass
(``accumulate_rows``) reads them back with the fp32 sum and writes it: 2 + 10 bytes a parameter, at
k3-small's 3.4B expert parameters ~0.6 ms a MoE layer and micro-batch on an H100. Here the GEMM's
epilogue reads and writes the fp32 sum itself (8 bytes a parameter, no bf16 product, no second
launch). Worth having only where its GEMM runs near cuBLAS's/CUTLASS's rate:
``benchmarks/bench_grouped_wgrad.py`` measures both. Triton is imported on first use.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

# Tile of the gradient, rows of tokens a step, warps, pipeline stages, tile rows per group. One H100,
# k3-small's shapes (benchmarks/bench_grouped_wgrad.py): 128 x 256 ran the stacked gate/input gradient
# in 1.024 ms (128 x 128: 1.360; 256 x 128: 1.041) and the output one in 0.582 (0.718; 0.563), against
# 1.093 and 0.598 for _grouped_mm + accumulate_ (whose GEMM alone ran 0.700 and 0.400).
TUNING = dict(bm=128, bn=256, bk=64, warps=8, stages=3, group_m=8)


def shape_error(dy: Tensor, x: Tensor, ends: Tensor, grads: Sequence[Tensor]) -> str | None:
    """What is wrong with the operands (None when nothing is)."""
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or not 1 <= len(grads) <= 2:
        return f"dy [T, M], x [T, N] and one or two grads, got {tuple(dy.shape)}, {tuple(x.shape)}, {len(grads)} grads"
    shapes = [tuple(g.shape) for g in grads]
    if (any(len(s) != 3 or s[0] != len(ends) or s[2] != x.shape[1] for s in shapes)
            or sum(s[1] for s in shapes) != dy.shape[1] or ends.dim() != 1):
        return f"grads [E, M_i, N] with sum M_i = {dy.shape[1]}, N = {x.shape[1]} and ends [E], got {shapes}"
    if any(g.dtype != torch.float32 or not g.is_contiguous() for g in grads) or dy.stride(1) != 1 or x.stride(1) != 1:
        return "contiguous fp32 grads and dy, x with contiguous rows"
    if dy.dtype != x.dtype or ends.dtype not in (torch.int32, torch.int64):
        return f"dy and x of one dtype and integer ends, got {dy.dtype}, {x.dtype}, {ends.dtype}"
    return None


def grouped_wgrad_(grads: Sequence[Tensor], dy: Tensor, x: Tensor, ends: Tensor, accumulate: bool) -> None:
    """G[e] = dy[s_e:ends[e]]^T @ x[s_e:ends[e]] (s_e = ends[e-1], s_0 = 0) into ``grads``, or added to them
    with ``accumulate``; fp32 accumulation. G's rows are ``grads`` stacked: one [E, M, N] tensor, or two
    [E, M_0, N] and [E, M - M_0, N] (a stacked GEMM's two weights)."""
    from moe_lc_kernels import grouped_wgrad_triton as kt

    problem = shape_error(dy, x, ends, grads)
    if problem is not None:
        raise ValueError(f"grouped_wgrad_: {problem}")
    experts, split, n = grads[0].shape
    m = dy.shape[1]
    bm, bn = TUNING["bm"], TUNING["bn"]
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    if experts:
        kt.grouped_wgrad_kernel[(experts * tiles_m * tiles_n,)](
            dy, x, ends, grads[0], grads[-1], m, n, split, dy.stride(0), x.stride(0), tiles_m, tiles_n, BM=bm, BN=bn,
            BK=TUNING["bk"], ACCUMULATE=accumulate, GROUP_M=TUNING["group_m"], num_warps=TUNING["warps"],
            num_stages=TUNING["stages"])
