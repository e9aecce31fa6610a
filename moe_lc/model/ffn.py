"""The gated feed-forward block used by the dense FFN and the shared experts (SiTU-GLU by default).

The activations (SiTU-GLU, its reference, SwiGLU and ``glu_activation``) live in moe_lc.ops.situ_glu
with their dispatch; they stay importable from here.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.ops.situ_glu import glu_activation, glu_activation_stacked, situ_glu, situ_glu_reference, swiglu
from moe_lc.ops.stacked_linear import stackable, stacked_linear

__all__ = ["GatedFFN", "glu_activation", "situ_glu", "situ_glu_reference", "swiglu"]


class GatedFFN(nn.Module):
    """y = W_out act(W_gate x, W_in x). Used for the dense FFN and the shared experts.

    ``activation_backend`` is handed to ``glu_activation`` ("auto": the fused SiTU kernel on GPUs).
    Where both weights are plain (``stackable``), W_gate x and W_in x are one GEMM over the stacked
    weights (x cast once under autocast, dx one GEMM instead of two and their sum) whose output the
    activation reads in place; tensor parallelism's shards and float8 linears keep two calls.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "situ",
        beta1: float = 4.0,
        beta2: float = 25.0,
        activation_backend: str = "auto",
    ):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)
        self.activation, self.beta1, self.beta2 = activation, beta1, beta2
        self.activation_backend = activation_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stackable():
            return self.from_gate_in(stacked_linear(x, self.stacked_weights()))
        a, c = self.w_gate(x), self.w_in(x)
        return self.w_out(glu_activation(a, c, self.activation, self.beta1, self.beta2, self.activation_backend))

    def stackable(self) -> bool:
        """Whether W_gate and W_in are plain weights that one GEMM can take stacked."""
        return stackable(self.w_gate) and stackable(self.w_in)

    def stacked_weights(self) -> list[torch.Tensor]:
        """[W_gate, W_in]: the rows of the stacked projection whose output ``from_gate_in`` takes."""
        return [self.w_gate.weight, self.w_in.weight]

    def from_gate_in(self, y: torch.Tensor) -> torch.Tensor:
        """W_out act(a, c) from y = [a, c] [..., 2 hidden], the stacked projection's output. y's rows may
        be columns of a wider GEMM's output (``LatentMoE`` stacks more projections of x with these)."""
        h = glu_activation_stacked(y, self.activation, self.beta1, self.beta2, self.activation_backend)
        return self.w_out(h)
