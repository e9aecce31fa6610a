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


def check_head_split(shape: torch.Size, head_dim: int, head_axis: int) -> None:
    """A clear error when a [..., m, n] matrix cannot be cut into blocks of head_dim along head_axis."""
    if len(shape) < 2:
        raise ValueError(f"a Muon parameter must be a matrix or a stack of matrices, got shape {tuple(shape)}")
    if head_dim == 0:
        return
    if head_axis not in (0, 1):
        raise ValueError(f"head_axis={head_axis} must be 0 (rows) or 1 (columns)")
    size = shape[-2 + head_axis]
    if head_dim < 0 or size % head_dim:
        raise ValueError(
            f"cannot cut a {shape[-2]}x{shape[-1]} matrix into head blocks of {head_dim} along axis {head_axis}: "
            f"{size} is not a multiple of {head_dim}; fix the 'head_dim' of its param group"
        )


def split_blocks(w: torch.Tensor, head_dim: int, head_axis: int) -> torch.Tensor:
    """[..., m, n] -> [B, m', n'] matrices to orthogonalise separately.

    Leading dims (experts) are batch. head_dim > 0 cuts each matrix into blocks of head_dim
    rows (head_axis 0: projections whose outputs are [H * head_dim]) or columns (head_axis 1:
    output projections that read [H * head_dim]); 0 keeps the whole matrix. A block size
    rather than a head count, so that a tensor-parallel shard holding H/tp heads splits
    the same way as the full matrix.
    """
    check_head_split(w.shape, head_dim, head_axis)
    m, n = w.shape[-2:]
    x = w.reshape(-1, m, n)
    if head_dim == 0:
        return x
    if head_axis == 0:
        return x.reshape(-1, head_dim, n)
    heads = n // head_dim
    return x.reshape(-1, m, heads, head_dim).transpose(1, 2).reshape(-1, m, head_dim)


def merge_blocks(blocks: torch.Tensor, shape: torch.Size, head_dim: int, head_axis: int) -> torch.Tensor:
    """Inverse of `split_blocks`."""
    m, n = shape[-2:]
    if head_dim and head_axis == 1:
        blocks = blocks.reshape(-1, n // head_dim, m, head_dim).transpose(1, 2)
    return blocks.reshape(shape)


def orthogonalized_update(
    update: torch.Tensor, head_dim: int = 0, head_axis: int = 0, steps: int = 5, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The scaled Muon direction for one (local, full) parameter: NS per block, times the RMS-matching scale."""
    blocks = split_blocks(update, head_dim, head_axis)
    ortho = newton_schulz(blocks, steps, dtype=dtype)
    ortho = ortho * rms_matching_scale(*blocks.shape[-2:])
    return merge_blocks(ortho, update.shape, head_dim, head_axis)
