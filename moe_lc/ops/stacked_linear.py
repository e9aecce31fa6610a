"""Several linear maps of one input as one GEMM: y = x [W_1; ...; W_n]^T, split by the caller.

One GEMM instead of n launches each way, and x's gradient is one GEMM instead of a sum of n.
Stacking must not add stored bytes. Under autocast over wider weights, the n separate linears
would each keep their bf16 cast of the weight for backward; here the fp32 weights are concatenated
and cast once, and that one bf16 matrix is what is kept (the same bytes, two launches). Without a
cast (fp32 weights in fp32, bf16 weights in bf16) a concatenation would be a copy the separate
linears never make, so the forward keeps x and the weights themselves and backward concatenates
them again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops.grouped_experts import autocast_operands


class _StackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, *weights = ctx.saved_tensors
        dx = dy @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return dx, *(None for _ in weights)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, *dw.split([w.shape[0] for w in weights])


def plain_tensor(t: Tensor) -> bool:
    """A tensor (or parameter) over a plain tensor, not tensor parallelism's DTensor, whose local piece
    only the module's own call sees: what a kernel that takes the module's weights directly can read."""
    return type(t.data) is torch.Tensor


def stackable(module: torch.nn.Module, types: tuple[type, ...] = (torch.nn.Linear,)) -> bool:
    """A module whose weight can be stacked with others: one of ``types`` exactly (not a float8
    linear, which computes differently) over a plain tensor (not tensor parallelism's DTensor)."""
    return type(module) in types and plain_tensor(module.weight)


def stacked_linear(x: Tensor, weights: list[Tensor]) -> Tensor:
    """x [..., d] times each weight [n_i, d] transposed, as one [..., sum n_i] output; under autocast
    the operands are cast to its dtype first, as autocast casts a linear's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if weights[0].dtype != torch.get_autocast_dtype(device_type):
            x, stacked = autocast_operands(x, torch.cat(weights))
            return F.linear(x, stacked)
        x, = autocast_operands(x)  # backward runs without autocast: its operands must agree already
    return _StackedLinear.apply(x, *weights)
