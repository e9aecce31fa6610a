"""RMSNorm, computed in fp32 for stability whatever the activation dtype; and the gated form that
KDA's output uses."""

from __future__ import annotations

import torch
from torch import nn
from moe_lc.ops.backend_choice import triton_device_reason
from moe_lc.ops.output_gate import gated_output
from moe_lc.ops.rms_norm import rms_normalised


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalised(x).to(x.dtype)

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        """g * x / rms(x) in fp32 (fp64 stays fp64), before the cast back to x's dtype."""
        return rms_normalised(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedRMSNorm(RMSNorm):
    """sigmoid(gate) * RMSNorm(x), in the gate's dtype, as one module (``moe_lc.ops.output_gate``):
    one fused kernel each way on CUDA, where eagerly the norm, the sigmoid, the product and their
    backward are a dozen passes over the layer's output. ``backend``: that op's."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "auto") -> None:
        super().__init__(dim, eps)
        self.backend = backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gated_output(x, gate, self.weight, self.eps, self.backend)

    def fused_on(self, device: torch.device) -> bool:
        """Whether the fused kernels run for this module's inputs on ``device`` (compiling it would then
        add host time and no fusion)."""
        return device.type == "cuda" and self.backend != "torch" and triton_device_reason(device) is None
