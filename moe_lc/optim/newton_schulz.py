"""Approximate orthogonalisation of Muon updates by a quintic Newton-Schulz iteration.

For G = U S V^T, Muon wants U V^T: every singular value of the update set to one, so
no direction dominates the step. Each iteration applies, to every singular value at once,

    X <- a X + b (X X^T) X + c (X X^T)^2 X      i.e.  s <- a s + b s^3 + c s^5,

after X = G / ||G||_F has put all singular values in (0, 1]. The coefficients
(a, b, c) = (3.4445, -4.7750, 2.0315) trade exact convergence for speed: the slope at 0
is a = 3.4445, so a small singular value grows ~3.4x per step, and after five steps every
s >= ~2e-3 ||G||_F lands in [0.68, 1.21] instead of converging to exactly 1 (which
Muon does not need). Smaller singular values are amplified but stay below that band.
Singular vectors are untouched, so the result keeps the direction of U V^T.

Blocks: a [..., m, n] batch is orthogonalised matrix by matrix (3-D expert weights,
attention heads); `split_blocks` / `merge_blocks` map a weight to its per-head blocks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """bf16 on GPUs (tensor cores; the iteration tolerates it); fp32 on CPU, float64 kept for references."""
    if x.is_cuda:
        return torch.bfloat16
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def newton_schulz(
    g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Quintic Newton-Schulz of each [m, n] matrix in g ([..., m, n]); returned in g's dtype."""
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs matrices [..., m, n], got shape {tuple(g.shape)}")
    a, b, c = QUINTIC
    x = g.to(dtype or compute_dtype_for(g))
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:  # iterate on the smaller Gram matrix X X^T
        x = x.mT
    x = x.contiguous()  # same memory layout, same rounding, whatever view the caller passed
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if not wide:
        x = x.mT
    return x.to(g.dtype)


def rms_matching_scale(rows: int, cols: int) -> float:
    """0.2 sqrt(max(m, n)): an orthogonal m x n block has RMS 1/sqrt(max(m, n)); this brings
    the update to RMS ~0.2, about that of an AdamW update, so Muon can share AdamW's learning
    rate and weight decay (as in Moonlight)."""
    return 0.2 * math.sqrt(max(rows, cols))


def split_blocks(w: torch.Tensor, heads: int, head_axis: int) -> torch.Tensor:
    """[..., m, n] -> [B, m', n'] matrices to orthogonalise separately.

    Leading dims (experts) are batch. heads > 1 splits each matrix into `heads` blocks along
    head_axis (0: rows, for projections whose outputs are [H * head_dim]; 1: columns, for
    output projections that read [H * head_dim]).
    """
    if w.ndim < 2:
        raise ValueError(f"a Muon parameter must be a matrix or a stack of matrices, got shape {tuple(w.shape)}")
    m, n = w.shape[-2:]
    x = w.reshape(-1, m, n)
    if heads == 1:
        return x
    if head_axis not in (0, 1):
        raise ValueError(f"head_axis={head_axis} must be 0 (rows) or 1 (columns)")
    size = (m, n)[head_axis]
    if size % heads:
        raise ValueError(
            f"cannot split a {m}x{n} matrix into {heads} head blocks along axis {head_axis}: "
            f"{size} is not a multiple of {heads}; fix the 'heads' of its param group"
        )
    if head_axis == 0:
        return x.reshape(-1, m // heads, n)
    return x.reshape(-1, m, heads, n // heads).transpose(1, 2).reshape(-1, m, n // heads)


def merge_blocks(blocks: torch.Tensor, shape: torch.Size, heads: int, head_axis: int) -> torch.Tensor:
    """Inverse of `split_blocks`."""
    m, n = shape[-2:]
    if heads > 1 and head_axis == 1:
        blocks = blocks.reshape(-1, heads, m, n // heads).transpose(1, 2)
    return blocks.reshape(shape)


def orthogonalized_update(
    update: torch.Tensor, heads: int = 1, head_axis: int = 0, steps: int = 5, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The scaled Muon direction for one (local, full) parameter: NS per block, times the RMS-matching scale."""
    blocks = split_blocks(update, heads, head_axis)
    ortho = newton_schulz(blocks, steps, dtype=dtype)
    ortho = ortho * rms_matching_scale(*blocks.shape[-2:])
    return merge_blocks(ortho, update.shape, heads, head_axis)
