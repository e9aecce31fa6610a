"""Causal depthwise convolution that never looks across a document boundary.

Packed rows hold several documents; the KDA short convolution must restart at each
one (SPEC 2.2), exactly as if every document were run alone.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def position_in_document(seq_len: int, cu_seqlens: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[T] offset of each token from the start of its document (FlashAttention cu_seqlens convention)."""
    t = torch.arange(seq_len, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.long), t, right=True)
    return t - starts[doc]


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y[t, c] = sum_j weight[c, W-1-j] * x[t-j, c] over taps j that stay inside t's document.

    x: [B, T, C]; weight: [C, W] (last tap multiplies the current token).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    pos = position_in_document(T, cu_seqlens, x.device)
    y = x * weight[:, W - 1]
    for j in range(1, W):
        if j >= T:
            break
        shifted = torch.nn.functional.pad(x[:, : T - j], (0, 0, j, 0))
        valid = (pos >= j).to(x.dtype).view(1, T, 1)
        y = y + shifted * valid * weight[:, W - 1 - j]
    return y


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

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        return causal_depthwise_conv(x, self.weight, cu_seqlens)
