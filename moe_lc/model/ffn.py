"""SiTU-GLU (SPEC 2.5) and the gated feed-forward block used by experts, shared experts and dense layers.

SiTU(a, c) = [b1 tanh(a/b1) * sigmoid(a)] * [b2 tanh(c/b2)]: SwiGLU to first order near 0
(b tanh(x/b) = x + O(x^3)), but bounded by b1*b2 so a single outlier token cannot blow up
the expert's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def situ_glu(a: torch.Tensor, c: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Bounded gated activation; a = W_gate x, c = W_in x."""
    return (beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)) * (beta2 * torch.tanh(c / beta2))


def swiglu(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * c


def glu_activation(a: torch.Tensor, c: torch.Tensor, kind: str, beta1: float, beta2: float) -> torch.Tensor:
    if kind == "situ":
        return situ_glu(a, c, beta1, beta2)
    if kind == "swiglu":
        return swiglu(a, c)
    raise ValueError(f"unknown GLU activation {kind!r}; use 'situ' or 'swiglu'")


class GatedFFN(nn.Module):
    """y = W_out act(W_gate x, W_in x). Used for the dense FFN and the shared experts."""

    def __init__(self, dim: int, hidden: int, activation: str = "situ", beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)
        self.activation, self.beta1, self.beta2 = activation, beta1, beta2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = glu_activation(self.w_gate(x), self.w_in(x), self.activation, self.beta1, self.beta2)
        return self.w_out(h)
