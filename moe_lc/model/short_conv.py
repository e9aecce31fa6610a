"""The KDA layer's short convolution module: a per-channel causal filter of a few taps.

The math (``causal_depthwise_conv``, the reference, and ``position_in_document``) lives in
moe_lc.ops.short_conv with the op's dispatch; both stay importable from here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.short_conv import causal_depthwise_conv, position_in_document, short_conv

__all__ = ["ShortConv", "causal_depthwise_conv", "position_in_document"]


class ShortConv(nn.Module):
    """Depthwise causal conv of width `kernel_size` over channels [B, T, C]."""

    def __init__(self, channels: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same scale as a freshly initialised depthwise nn.Conv1d (fan_in = kernel_size).
        bound = 1.0 / self.weight.shape[-1] ** 0.5
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        docs: Optional[DocumentBounds] = None,
        activation: Optional[str] = None,
        backend: str = "torch",
    ) -> torch.Tensor:
        """The convolution (restarting at every document of ``docs``), then ``activation`` ("silu"
        or None), through ``short_conv``: passing the activation here lets the Triton backend fuse it."""
        return short_conv(x, self.weight, docs, activation=activation, backend=backend)
