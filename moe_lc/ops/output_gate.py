"""The sigmoid output gate of the token mixers, one dispatch point.

    y = sigmoid(g) * RMSNorm(x) w    (KDA: the norm per head, over the last dim)
    y = sigmoid(g) * x               (MLA)

in fp32, returned in g's dtype. ``gated_output_reference`` is the definition (plain PyTorch, any
dtype and device); ``gated_output`` picks it or the fused Triton kernels
(moe_lc_kernels.output_gate: one pass forward, one backward).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc.model.precision import upcast
from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc.ops.rms_norm import rms_normalised
from moe_lc_kernels.output_gate import DTYPES, gated_output_triton

__all__ = ["gated_output_reference", "gated_output", "resolve_backend", "triton_unsupported_reason"]


def gated_output_reference(x: Tensor, g: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """sigmoid(g) * (RMSNorm(x) weight, or x): the definition."""
    f = rms_normalised(x, weight, eps) if weight is not None else upcast(x)
    return (f * torch.sigmoid(upcast(g))).to(g.dtype)


def triton_unsupported_reason(x: Tensor, g: Tensor, weight: Optional[Tensor] = None) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs here, or None when they can."""
    reason = triton_device_reason(x.device)
    if reason is not None:
        return reason
    if x.shape != g.shape or x.device != g.device:
        return f"the kernels take x and g of one shape and device, got {tuple(x.shape)} and {tuple(g.shape)}"
    if x.dtype not in DTYPES or g.dtype not in DTYPES:
        return f"the kernels take fp32/bf16/fp16 x and g, got {x.dtype} and {g.dtype}"
    if weight is not None:
        group = x.shape[-1] if x.dim() else 0
        if x.dim() < 2 or tuple(weight.shape) != (group,) or group & (group - 1) or weight.device != x.device:
            return (f"the kernels' norm takes x of two dims or more and a weight of its last dim, a power of two, on "
                    f"x's device; got x {tuple(x.shape)} and weight {tuple(weight.shape)} on {weight.device}")
    return None


def resolve_backend(x: Tensor, g: Tensor, weight: Optional[Tensor] = None, backend: str = "auto") -> str:
    """The backend ``gated_output`` runs: "auto" takes Triton only on CUDA (never the slow CPU interpreter)."""
    return choose_backend("gated_output", backend, "triton", triton_unsupported_reason(x, g, weight),
                          auto_takes_fast=x.is_cuda)


def gated_output(x: Tensor, g: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6,
                 backend: str = "auto") -> Tensor:
    """sigmoid(g) * (RMSNorm(x) over the last dim, times ``weight``; or x without one), in g's dtype.

    Differentiable in x, g and weight. Backends: "torch" (the reference), "triton" (fused kernels,
    fp32 math; g may be a column slice of a wider tensor, read in place), "auto" (triton on CUDA
    where it takes the inputs, torch otherwise).
    """
    if resolve_backend(x, g, weight, backend) == "torch":
        return gated_output_reference(x, g, weight, eps)
    return gated_output_triton(x, g, weight, eps)
