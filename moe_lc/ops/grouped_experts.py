"""The routed experts' compute, one dispatch point: expert e runs its GLU on its contiguous rows.

    rows [o_{e-1}, o_e) of x_sorted:   y = act(x W_gate[e]^T, x W_in[e]^T) W_out[e]^T

with o_e = counts[0] + ... + counts[e]. Weights are stacked [E, h, l], [E, h, l], [E, l, h] (dim 0
is what expert parallelism shards). Backends:

- "torch": ``grouped_glu_reference``, a Python loop over experts: the readable definition. It needs
  the counts on the host and indexes ``w[e]`` per expert, so its backward zero-fills and adds one
  gradient of the whole stacked weight per expert and matrix;
- "grouped": one ``torch._grouped_mm`` per matrix with the offsets on the device: no host read, and
  the weight gradients come out of one grouped GEMM straight into the stacked [E, ...] layout;
- "float8": the grouped GEMMs in float8 through torchao on padded groups
  (``moe_lc.ops.grouped_experts_float8``; ``float8.experts=true`` under ``precision=fp8`` sets it);
- "auto": grouped on CUDA for bf16 and fp32, the reference otherwise (CPU runs stay bitwise what
  the reference computes). On an H200 (torch 2.11) the grouped GEMM gave bitwise the loop's result
  in both dtypes at the proxy preset's shapes ([32768, 512] rows, 64 experts of 512 x 512), 35x
  faster in bf16 and 2.7x in fp32 (forward of the three matrices and SiTU).

``torch._grouped_mm`` wants row strides that are multiples of 16 bytes (l and h multiples of 8 in
bf16, of 4 in fp32), int32 offsets on x's device, and it leaves rows past the last offset
unwritten, so the counts must add up to the rows of x (the callers' sort guarantees it).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc.ops.situ_glu import glu_activation, glu_activation_stacked, glu_activation_stacked_backward

__all__ = ["grouped_glu", "grouped_glu_stacked", "grouped_glu_reference", "grouped_glu_mm", "expert_offsets",
           "resolve_backend", "resolve_wgrad_backend", "grouped_unsupported_reason", "autocast_operands"]

Counts = Union[Tensor, Sequence[int]]
Activation = Callable[[Tensor, Tensor], Tensor]
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_AUTO_GROUPED_DTYPES = (torch.bfloat16, torch.float32)  # measured equal to the loop on CUDA (module docstring)
_STRIDE_ALIGNMENT = 16  # bytes


def expert_offsets(counts: Counts, device: torch.device) -> Tensor:
    """int32 [E] end row of each expert (cumulative counts) on ``device``, the form _grouped_mm takes."""
    return torch.as_tensor(counts, device=device).cumsum(0).to(torch.int32)


def grouped_glu_reference(
    x_sorted: Tensor, counts: Sequence[int], w_gate: Tensor, w_in: Tensor, w_out: Tensor, act: Activation
) -> Tensor:
    """Expert e on its slice of ``x_sorted`` ([sum counts, l]), one expert at a time. The reference.

    ``act(a, c)`` is the GLU activation (``glu_activation`` with its settings bound)."""
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = x_sorted[start : start + n]
        outs.append(act(xe @ w_gate[e].t(), xe @ w_in[e].t()) @ w_out[e].t())
        start += n
    return torch.cat(outs, dim=0)


def grouped_glu_mm(
    x_sorted: Tensor, offsets: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor, act: Activation
) -> Tensor:
    """The reference's math with one ``torch._grouped_mm`` per matrix; ``offsets`` from ``expert_offsets``."""
    x = x_sorted.contiguous()
    a = torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offsets)
    c = torch._grouped_mm(x, w_in.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(act(a, c), w_out.transpose(-2, -1), offs=offsets)


def _on_no_rows(x: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor, act: Activation) -> Tensor:
    """The empty result computed from the weights, so that backward still reaches them.

    An expert-parallel rank that received no rows must still run backward through this module:
    FSDP's per-module gradient reduction then happens in the same order on every rank.
    """
    return act(x @ w_gate[0].t(), x @ w_in[0].t()) @ w_out[0].t()


def autocast_operands(x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
    """x and the weights in autocast's dtype where autocast is on for x's device, as it casts a matmul's
    operands; unchanged otherwise.

    ``torch._grouped_mm`` is not on autocast's lists: without this, fp32 master weights under bf16
    autocast (one-process training) meet bf16 activations and the grouped GEMM cannot take them.
    The casts are differentiable, so the fp32 weights still get their gradients.
    """
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return (x, *weights)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (x, *weights))


def grouped_unsupported_reason(x: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor) -> Optional[str]:
    """Why ``torch._grouped_mm`` cannot take these operands, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    dtypes = {x.dtype, w_gate.dtype, w_in.dtype, w_out.dtype}
    if len(dtypes) != 1 or x.dtype not in _GROUPED_DTYPES:
        return f"the grouped GEMM takes x and weights of one dtype among fp32/bf16/fp16, got {sorted(map(str, dtypes))}"
    devices = {x.device, w_gate.device, w_in.device, w_out.device}
    if len(devices) != 1:
        return f"x and the weights must be on one device, got {sorted(map(str, devices))}"
    width, hidden = w_gate.shape[2], w_gate.shape[1]
    if (width * x.element_size()) % _STRIDE_ALIGNMENT or (hidden * x.element_size()) % _STRIDE_ALIGNMENT:
        return (f"the grouped GEMM needs rows of a multiple of {_STRIDE_ALIGNMENT} bytes: width {width} and hidden "
                f"{hidden} must be multiples of {_STRIDE_ALIGNMENT // x.element_size()} in {x.dtype}")
    return None


def resolve_wgrad_backend(device: torch.device, backend: str = "auto") -> str:
    """How the stacked step copies' weight gradients reach the fp32 ``.grad``: "torch" (autograd's bf16
    product, then ``accumulate_``) or "triton" (summed by the weight-gradient GEMM,
    ``_GroupedLinearSummingWeightGrads``); "auto" takes torch: the Triton GEMM runs at ~470 TFLOP/s where
    CUTLASS's runs at ~690, so it gains only the add it saves (6% of these ops at its best launch, and
    its first launch made the step 3.4% slower; docs/performance.md §12.20)."""
    return choose_backend("moe.wgrad_backend", backend, "triton", triton_device_reason(device), auto_takes_fast=False)


def resolve_backend(x: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor, backend: str = "auto") -> str:
    """The backend ``grouped_glu`` runs: "auto" takes the grouped GEMM for CUDA bf16 and fp32."""
    auto_grouped = x.is_cuda and x.dtype in _AUTO_GROUPED_DTYPES
    return choose_backend("grouped_glu", backend, "grouped", grouped_unsupported_reason(x, w_gate, w_in, w_out),
                          auto_takes_fast=auto_grouped)


def _check(x: Tensor, counts: Counts, w_gate: Tensor, w_in: Tensor, w_out: Tensor) -> None:
    """Shape errors that name the problem and the fix (no device sync: device counts are not summed)."""
    if x.dim() != 2:
        raise ValueError(f"grouped_glu: x_sorted must be [rows, width], got shape {tuple(x.shape)}")
    if w_gate.dim() != 3:
        raise ValueError(f"grouped_glu: w_gate must be stacked [E, h, l], got shape {tuple(w_gate.shape)}")
    experts, hidden, width = w_gate.shape
    if w_in.shape != w_gate.shape or w_out.shape != (experts, width, hidden) or x.shape[1] != width:
        raise ValueError(f"grouped_glu: want x [rows, l], w_gate and w_in [E, h, l], w_out [E, l, h]; got "
                         f"{tuple(x.shape)}, {tuple(w_gate.shape)}, {tuple(w_in.shape)}, {tuple(w_out.shape)}")
    if len(counts) != experts:
        raise ValueError(f"grouped_glu: {len(counts)} counts for {experts} experts; pass one row count per expert")
    if not isinstance(counts, Tensor) and sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_glu: the counts add up to {sum(counts)} rows, x_sorted has {x.shape[0]}")


def grouped_glu(
    x_sorted: Tensor,
    counts: Counts,
    w_gate: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    activation: str,
    beta1: float,
    beta2: float,
    backend: str = "auto",
    activation_backend: str = "auto",
) -> Tensor:
    """Expert e's GLU on rows [o_{e-1}, o_e) of ``x_sorted`` [rows, l], for every e; [rows, l] out.

    ``counts``: rows per expert [E] (a device tensor keeps the grouped path free of host reads; the
    reference reads it back). ``activation`` "situ" or "swiglu" with SiTU's betas;
    ``activation_backend`` goes to ``glu_activation``. Differentiable in x and the three weights.
    """
    _check(x_sorted, counts, w_gate, w_in, w_out)
    act = functools.partial(glu_activation, kind=activation, beta1=beta1, beta2=beta2, backend=activation_backend)
    if x_sorted.shape[0] == 0:
        return _on_no_rows(x_sorted, w_gate, w_in, w_out, act)
    if backend == "float8":
        from moe_lc.ops.grouped_experts_float8 import float8_grouped_glu

        return float8_grouped_glu(x_sorted, expert_offsets(counts, x_sorted.device), w_gate, w_in, w_out, act)
    operands = autocast_operands(x_sorted, w_gate, w_in, w_out)
    if resolve_backend(*operands, backend) == "grouped":
        return grouped_glu_mm(operands[0], expert_offsets(counts, x_sorted.device), *operands[1:], act)
    host_counts = counts.tolist() if isinstance(counts, Tensor) else list(counts)
    return grouped_glu_reference(x_sorted, host_counts, w_gate, w_in, w_out, act)


def grouped_glu_stacked(
    x_sorted: Tensor,
    counts: Counts,
    w_gate_in: Tensor,
    w_out: Tensor,
    activation: str,
    beta1: float,
    beta2: float,
    activation_backend: str = "auto",
    grad_targets: Optional[tuple[tuple[Tensor, Tensor], tuple[Tensor]]] = None,
) -> Tensor:
    """``grouped_glu``'s math with W_gate and W_in stacked along the hidden dim, ``w_gate_in`` [E, 2h, l]
    (gate rows first), on the grouped GEMM: one GEMM of twice the width instead of two, whose backward
    gives dx from one GEMM instead of two GEMMs and their sum (measured on an H200 at k3-small's
    experts, 131K rows: 2.69 against 3.00 ms forward and backward; docs/performance.md §12.3). The
    caller stacks the weights (``RoutedExperts``: in the per-step bf16 copies, where the cast writes
    them for free); operands must suit ``torch._grouped_mm`` (``grouped_unsupported_reason``).
    ``grad_targets`` ((W_gate, W_in), (W_out,)), the fp32 weights whose step copies these are: their
    gradients are summed into their ``.grad`` by the weight-gradient GEMMs themselves
    (``_GroupedLinearSummingWeightGrads``), not handed to the copies."""
    experts, double_hidden, width = w_gate_in.shape
    hidden = double_hidden // 2
    _check(x_sorted, counts, w_gate_in[:, :hidden], w_gate_in[:, hidden:], w_out)
    reason = grouped_unsupported_reason(x_sorted, w_gate_in[:, :hidden], w_gate_in[:, hidden:], w_out)
    if reason is not None:
        raise ValueError(f"grouped_glu_stacked: {reason}")
    offsets = expert_offsets(counts, x_sorted.device)
    if grad_targets is not None:
        act = functools.partial(glu_activation_stacked, kind=activation, beta1=beta1, beta2=beta2,
                                backend=activation_backend)
        gate_in_targets, out_targets = grad_targets
        y = _GroupedLinearSummingWeightGrads.apply(x_sorted.contiguous(), w_gate_in, offsets, gate_in_targets)
        return _GroupedLinearSummingWeightGrads.apply(act(y), w_out, offsets, out_targets)
    out, _, _ = _grouped_glu_stacked(x_sorted.contiguous(), offsets, w_gate_in, w_out, activation, float(beta1),
                                     float(beta2), activation_backend)
    return out


# The stacked experts as one custom op, forward and backward: a compiled MoE layer keeps them in its
# graph as one opaque call (Dynamo does not trace the grouped GEMMs, whose fake kernels take bf16
# only, nor the launches), and selective checkpointing sees one op whose outputs it keeps.

@torch.library.custom_op("moe_lc::grouped_glu_stacked", mutates_args=())
def _grouped_glu_stacked(x: Tensor, offsets: Tensor, w_gate_in: Tensor, w_out: Tensor, activation: str,
                         beta1: float, beta2: float, activation_backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out, y, h): y = x W_gate_in^T per expert, h = act(y), out = h W_out^T; y and h are what the
    backward reads (what autograd would keep for the two GEMMs and the activation)."""
    y = torch._grouped_mm(x, w_gate_in.transpose(-2, -1), offs=offsets)
    h = glu_activation_stacked(y, activation, beta1, beta2, activation_backend)
    return torch._grouped_mm(h, w_out.transpose(-2, -1), offs=offsets), y, h


@_grouped_glu_stacked.register_fake
def _(x: Tensor, offsets: Tensor, w_gate_in: Tensor, w_out: Tensor, activation: str, beta1: float, beta2: float,
      activation_backend: str) -> tuple[Tensor, Tensor, Tensor]:
    rows, double_hidden = x.shape[0], w_gate_in.shape[1]
    return (x.new_empty(rows, w_out.shape[1]), x.new_empty(rows, double_hidden), x.new_empty(rows, double_hidden // 2))


@torch.library.custom_op("moe_lc::grouped_glu_stacked_backward", mutates_args=())
def _grouped_glu_stacked_backward(dout: Tensor, x: Tensor, offsets: Tensor, w_gate_in: Tensor, w_out: Tensor,
                                  y: Tensor, h: Tensor, activation: str, beta1: float, beta2: float,
                                  activation_backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW_gate_in, dW_out), the weight gradients in the weights' own [E, rows, cols] layout."""
    dout = dout.contiguous()
    dh = torch._grouped_mm(dout, w_out, offs=offsets)
    dw_out = torch._grouped_mm(dout.t(), h, offs=offsets)
    dy = glu_activation_stacked_backward(y, dh, activation, beta1, beta2, activation_backend)
    dx = torch._grouped_mm(dy, w_gate_in, offs=offsets)
    dw_gate_in = torch._grouped_mm(dy.t(), x, offs=offsets)
    return dx, dw_gate_in, dw_out


@_grouped_glu_stacked_backward.register_fake
def _(dout: Tensor, x: Tensor, offsets: Tensor, w_gate_in: Tensor, w_out: Tensor, y: Tensor, h: Tensor,
      activation: str, beta1: float, beta2: float, activation_backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w_gate_in), torch.empty_like(w_out)


def _grouped_glu_stacked_setup(ctx, inputs, output) -> None:
    x, offsets, w_gate_in, w_out, *settings = inputs
    _, y, h = output
    ctx.save_for_backward(x, offsets, w_gate_in, w_out, y, h)
    ctx.settings = settings
    ctx.mark_non_differentiable(y, h)


def _grouped_glu_stacked_grad(ctx, dout: Tensor, _dy: Optional[Tensor], _dh: Optional[Tensor]):
    dx, dw_gate_in, dw_out = _grouped_glu_stacked_backward(dout, *ctx.saved_tensors, *ctx.settings)
    return dx, None, dw_gate_in, dw_out, None, None, None, None


_grouped_glu_stacked.register_autograd(_grouped_glu_stacked_grad, setup_context=_grouped_glu_stacked_setup)


def _sum_into_grads(weights: tuple[Tensor, ...], dy: Tensor, x: Tensor, offsets: Tensor) -> None:
    """The weights' fp32 ``.grad`` (stacked along their rows) += dy_e^T x_e per expert, by the GEMM;
    the step's first micro-batch stores it (contiguous) instead."""
    from moe_lc_kernels.grouped_wgrad import grouped_wgrad_

    first = weights[0].grad is None
    if first:
        for w in weights:
            w.grad = torch.empty_like(w, memory_format=torch.contiguous_format)
    grouped_wgrad_([w.grad for w in weights], dy, x.contiguous(), offsets, accumulate=not first)


class _GroupedLinearSummingWeightGrads(torch.autograd.Function):
    """``torch._grouped_mm(x, w^T, offs)`` for a step's bf16 copy ``w`` [E, M, N] of fp32 weights
    (``targets``, stacked along M), whose backward computes dx by the grouped GEMM and sums w's
    gradient into the targets' fp32 ``.grad`` from its own GEMM (moe_lc_kernels.grouped_wgrad): no
    bf16 product written and read back, no separate add (``RoutedExperts`` with
    ``wgrad_backend="triton"``; the copy's own backward then receives nothing)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor, targets: tuple[Tensor, ...]) -> Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.targets = targets
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offsets) if ctx.needs_input_grad[0] else None
        _sum_into_grads(ctx.targets, dy, x, offsets)
        return dx, None, None, None
