"""Several linear maps of one input as one GEMM: y = x [W_1; ...; W_n]^T, split by the caller.

One GEMM instead of n launches each way, and x's gradient is one GEMM instead of a sum of n.
Stacking must not add stored bytes. Without a cast (fp32 weights in fp32, bf16 weights in bf16) a
concatenation would be a copy the separate linears never make, so the forward keeps x and the
weights themselves and backward concatenates them again.

Under autocast over wider (fp32 master) weights, the GEMMs run on one bf16 copy of the stacked
weights, which is what backward keeps (the bytes the n separate linears' casts would keep), and
each weight's gradient is accumulated in fp32 by the weight-gradient GEMM itself, straight into
``.grad``: ``.grad = dy^T x`` with an fp32 output for the step's first micro-batch (the stacked
weights' gradients are row blocks of one buffer), ``.grad += dy^T x`` in the GEMM's epilogue for
the others. Autograd's way, a bf16 gradient, its cast to fp32 and AccumulateGrad's add, moves
about 20 bytes a parameter per micro-batch more (docs/performance.md §12.13), and rounds each
micro-batch's gradient to bf16 first. ``casts``: a dict that lives for one training step
(``reuse_weight_casts``), where the bf16 copy is made once for all the step's micro-batches
instead of once per micro-batch. For plain leaf weights only (not tensor parallelism's DTensors,
and never inside a ``torch.compile`` region, which keeps autograd's way); FSDP2 and ZeRO-1 read
``.grad`` after the backward, as they would after AccumulateGrad.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops.grouped_experts import autocast_operands

__all__ = ["linear", "stackable", "stacked_linear"]


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


class _LinearAccumulatingInFp32(torch.autograd.Function):
    """y = x W^T with W the compute-dtype copy of the stacked fp32 ``weights``; backward returns dx
    and adds each weight's gradient into its fp32 ``.grad`` in the GEMM (``_accumulate_weight_grads``),
    handing autograd nothing for the weights. The weights are inputs so that the output needs a
    gradient whenever they do."""

    @staticmethod
    def forward(ctx, x: Tensor, w_compute: Tensor, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, w_compute)
        ctx.weights = weights
        return F.linear(x, w_compute)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_compute = ctx.saved_tensors
        dx = dy @ w_compute if ctx.needs_input_grad[0] else None
        if any(ctx.needs_input_grad[2:]):
            # fp32 sums by construction, also where the backward runs inside an autocast region
            with torch.autocast(dy.device.type, enabled=False):
                _accumulate_weight_grads(ctx.weights, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]))
        return dx, None, *(None for _ in ctx.weights)


def _weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    """dy^T x in fp32: on CUDA the GEMM writes fp32 from bf16/fp16 operands; elsewhere the operands
    are upcast (the same products, summed in fp32)."""
    if dy.is_cuda and dy.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(dy.t(), x, out_dtype=torch.float32)
    return torch.mm(dy.t().float(), x.float())


def _add_weight_grad(grad: Tensor, dy: Tensor, x: Tensor) -> None:
    """grad += dy^T x, grad fp32 and contiguous: in the GEMM's epilogue on CUDA."""
    if dy.is_cuda and dy.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(grad, dy.t(), x, out_dtype=torch.float32, out=grad)
    else:
        grad.addmm_(dy.t().float(), x.float())


def _one_buffer(weights: Sequence[Tensor]) -> Optional[Tensor]:
    """The contiguous fp32 tensor whose consecutive row blocks are the weights' ``.grad`` (what the
    first micro-batch left), or None."""
    grads = [w.grad for w in weights]
    if any(g is None for g in grads):
        return None
    base = grads[0] if len(grads) == 1 else grads[0]._base
    rows = sum(w.shape[0] for w in weights)
    if (base is None or base.dtype != torch.float32 or not base.is_contiguous()
            or tuple(base.shape) != (rows, *weights[0].shape[1:])):
        return None
    offset = 0
    for w, g in zip(weights, grads):
        if g.data_ptr() != base[offset].data_ptr() or g.shape != w.shape or not g.is_contiguous():
            return None
        offset += w.shape[0]
    return base


def _accumulate_weight_grads(weights: Sequence[Tensor], dy: Tensor, x: Tensor) -> None:
    """Each weight's ``.grad += dy_i^T x`` in fp32 (dy_i: its columns of dy), as few GEMMs as the
    ``.grad`` layout allows: one over the stacked rows, else one per weight."""
    rows = [w.shape[0] for w in weights]
    if all(w.grad is None for w in weights):
        total = _weight_grad(dy, x)
        for w, part in zip(weights, total.split(rows)):
            w.grad = part
        return
    buffer = _one_buffer(weights)
    if buffer is not None:
        _add_weight_grad(buffer, dy, x)
        return
    for w, dy_i in zip(weights, dy.split(rows, dim=-1)):
        if not w.requires_grad:
            continue
        if w.grad is None:
            w.grad = _weight_grad(dy_i, x)
        elif w.grad.dtype == torch.float32 and w.grad.is_contiguous():
            _add_weight_grad(w.grad, dy_i, x)
        else:
            w.grad += _weight_grad(dy_i, x).to(w.grad.dtype)


def _accumulation_dtype(x: Tensor, weights: Sequence[Tensor]) -> Optional[torch.dtype]:
    """Autocast's dtype where the weights' gradients can go straight into their ``.grad``: autocast on
    for x's device over plain fp32 leaves that need one, autograd on, outside a compiled region; else None."""
    device_type = x.device.type
    if (not torch.is_autocast_enabled(device_type) or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype == torch.float32 or not all(w.is_leaf and w.requires_grad and type(w.data) is torch.Tensor
                                         and w.dtype == torch.float32 for w in weights):
        return None
    return dtype


def _compute_copy(weights: Sequence[Tensor], dtype: torch.dtype, casts: Optional[dict]) -> Tensor:
    """The stacked weights in ``dtype`` (no autograd), from ``casts`` when this step made it already."""
    key = tuple(id(w) for w in weights)
    if casts is not None and key in casts:
        return casts[key]
    with torch.no_grad():
        stacked = weights[0].to(dtype) if len(weights) == 1 else torch.cat([w.to(dtype) for w in weights])
    if casts is not None:
        casts[key] = stacked
    return stacked


def stackable(module: torch.nn.Module, types: tuple[type, ...] = (torch.nn.Linear,)) -> bool:
    """A module whose weight can be stacked with others: one of ``types`` exactly (not a float8
    linear, which computes differently) over a plain tensor (not tensor parallelism's DTensor)."""
    return type(module) in types and type(module.weight.data) is torch.Tensor


def stacked_linear(x: Tensor, weights: list[Tensor], casts: Optional[dict] = None) -> Tensor:
    """x [..., d] times each weight [n_i, d] transposed, as one [..., sum n_i] output; under autocast
    the operands are cast to its dtype first, as autocast casts a linear's. ``casts``: the step's
    copies of the weights in the compute dtype (module docstring), or None."""
    dtype = _accumulation_dtype(x, weights)
    if dtype is not None:
        return _LinearAccumulatingInFp32.apply(x.to(dtype), _compute_copy(weights, dtype, casts), *weights)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if weights[0].dtype != torch.get_autocast_dtype(device_type):
            x, stacked = autocast_operands(x, torch.cat(weights) if len(weights) > 1 else weights[0])
            return F.linear(x, stacked)
        x, = autocast_operands(x)  # backward runs without autocast: its operands must agree already
    return _StackedLinear.apply(x, *weights)


def linear(module: torch.nn.Module, x: Tensor, casts: Optional[dict] = None) -> Tensor:
    """``module(x)``; a plain bias-free nn.Linear runs as a one-weight ``stacked_linear``, so that under
    autocast over fp32 weights its gradient is accumulated in fp32 by its GEMM (module docstring)."""
    if stackable(module) and module.bias is None and _accumulation_dtype(x, [module.weight]) is not None:
        return stacked_linear(x, [module.weight], casts)
    return module(x)
