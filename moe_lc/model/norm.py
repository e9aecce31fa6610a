"""RMSNorm, computed in fp32 for stability whatever the activation dtype; and the gated form that
KDA's output uses."""

from __future__ import annotations

import torch
from torch import nn
from moe_lc.model.precision import upcast
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
    """sigmoid(gate) * RMSNorm(x), in the gate's dtype, as one module: compiling the norms
    (``compile.targets`` "norms") then fuses the gate into the norm's kernel, where eagerly the
    sigmoid, the product and their backward are five more passes over the layer's output."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (self.normalised(x) * torch.sigmoid(upcast(gate))).to(gate.dtype)
