"""RMSNorm, computed in fp32 for stability whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn
from moe_lc.model.precision import upcast


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * upcast(self.weight)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
