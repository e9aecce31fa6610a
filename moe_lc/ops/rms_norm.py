"""RMSNorm's math as functions: the one definition that the model's norm modules and the depth
mixture's fused pre-norm (its reference) both compute."""

from __future__ import annotations

import torch
from torch import Tensor

from moe_lc.model.precision import upcast

__all__ = ["rms_normalised", "rms_norm"]


def rms_normalised(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 stays fp64), before any cast
    back to x's dtype (a gated norm multiplies its gate in first)."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * upcast(weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_normalised`` in x's dtype: what an RMSNorm module returns."""
    return rms_normalised(x, weight, eps).to(x.dtype)
