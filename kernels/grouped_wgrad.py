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

import torch
from torch import Tensor

# Tile of the gradient, rows of tokens a step, warps, pipeline stages, tile rows per group.
TUNING = dict(bm=128, bn=128, bk=64, warps=8, stages=3, group_m=8)


def shape_error(dy: Tensor, x: Tensor, ends: Tensor, grad: Tensor) -> str | None:
    """What is wrong with the operands (None when nothing is)."""
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0] or grad.dim() != 3:
        return f"dy [T, M], x [T, N] and grad [E, M, N], got {tuple(dy.shape)}, {tuple(x.shape)}, {tuple(grad.shape)}"
    if grad.shape[1:] != (dy.shape[1], x.shape[1]) or ends.shape != grad.shape[:1]:
        return f"grad [E, M, N] = [{len(ends)}, {dy.shape[1]}, {x.shape[1]}] and ends [E], got {tuple(grad.shape)}"
    if grad.dtype != torch.float32 or not grad.is_contiguous() or dy.stride(1) != 1 or x.stride(1) != 1:
        return "a contiguous fp32 grad and dy, x with contiguous rows"
    if dy.dtype != x.dtype or ends.dtype not in (torch.int32, torch.int64):
        return f"dy and x of one dtype and integer ends, got {dy.dtype}, {x.dtype}, {ends.dtype}"
    return None


def grouped_wgrad_(grad: Tensor, dy: Tensor, x: Tensor, ends: Tensor, accumulate: bool) -> Tensor:
    """grad[e] = dy[s_e:ends[e]]^T @ x[s_e:ends[e]] (s_e = ends[e-1], s_0 = 0), or += with ``accumulate``;
    fp32 accumulation. Returns ``grad``."""
    from moe_lc_kernels import grouped_wgrad_triton as kt

    problem = shape_error(dy, x, ends, grad)
    if problem is not None:
        raise ValueError(f"grouped_wgrad_: {problem}")
    experts, m, n = grad.shape
    bm, bn = TUNING["bm"], TUNING["bn"]
    tiles_m, tiles_n = -(-m // bm), -(-n // bn)
    if experts:
        kt.grouped_wgrad_kernel[(experts * tiles_m * tiles_n,)](
            dy, x, ends, grad, m, n, dy.stride(0), x.stride(0), tiles_m, tiles_n, BM=bm, BN=bn, BK=TUNING["bk"],
            ACCUMULATE=accumulate, GROUP_M=TUNING["group_m"], num_warps=TUNING["warps"], num_stages=TUNING["stages"])
    return grad
