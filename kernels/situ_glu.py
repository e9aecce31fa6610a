"""Fused SiTU-GLU on Triton: custom ops, their autograd and launches.

Forward: one pass reads a and c and writes h (the unfused composition makes about ten elementwise
passes, each a full read and write of the [tokens, hidden] activation). Backward: one pass reads a,
c and dh and writes da and dc; the activation's intermediates are recomputed, so only a and c are
kept for backward (the GEMMs producing them keep them anyway). Triton is imported on first use, so
this module imports without it (``moe_lc.ops.situ_glu.situ_glu`` is the public entry point).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from moe_lc_kernels.layout import row_stride
from moe_lc_kernels.tuning import parse_launch_choices

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program and warps. On an H200 at 64M bf16 elements, 2048 x 4 warps ran the forward of the
# IEEE-math kernels at 2.38 TB/s (3 streams) and the backward at 3.29 TB/s (5 streams) against a 3.94
# TB/s copy; 1024 x 4 and 4096 x 8 were within 5%, 16 warps and 4096 x 4 10-35% slower. The forward was
# bound by instruction issue (fast_math_triton.py): on one H100 at [131072, 2 x 896], 261 us with the
# fast math against 311.
# The backward has its own: at 2048 x 4 its sm_90 code holds 111 registers a thread (four programs an SM);
# at 1024 x 8, 32. On one H100 at [131072, 2 x 896]: 385 us against 437 at 2048 x 4 (the kernel before
# fast_math_triton: 403 at 2048 x 4), 406 at 1024 x 4, 429 at 2048 x 8, 444 at 4096 x 8.
# MOE_LC_SITU_TUNING="key=value,..." overrides (a choice tried in a whole step: benchmarks/bench_ab.py).
TUNING = dict(block=2048, warps=4, bwd_block=1024, bwd_warps=8)
TUNING.update(parse_launch_choices(os.environ.get("MOE_LC_SITU_TUNING", ""), TUNING, "SiTU"))


def _launch(kernel, n: int, *args, stacked: bool = False, prefix: str = "") -> None:
    import triton

    block = TUNING[f"{prefix}block"]
    kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, STACKED=stacked, num_warps=TUNING[f"{prefix}warps"])


# The kernels as custom ops (forward and backward each one op, autograd registered on the forward):
# a compiled region (the MoE layer's, the shared experts') keeps them in its graph as opaque calls
# instead of breaking the graph or tracing into the launches.

@torch.library.custom_op("moe_lc::situ_glu", mutates_args=())
def _situ_glu(a: Tensor, c: Tensor, beta1: float, beta2: float) -> Tensor:
    from moe_lc_kernels import situ_glu_triton as kt

    h = torch.empty_like(a)
    if a.numel():
        _launch(kt.situ_glu_fwd_kernel, a.numel(), a, c, h, a.numel(), 1, 0, beta1, beta2)
    return h


@_situ_glu.register_fake
def _(a: Tensor, c: Tensor, beta1: float, beta2: float) -> Tensor:
    return torch.empty_like(a)


@torch.library.custom_op("moe_lc::situ_glu_backward", mutates_args=())
def _situ_glu_backward(a: Tensor, c: Tensor, dh: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    from moe_lc_kernels import situ_glu_triton as kt

    dh = dh.contiguous()
    da, dc = torch.empty_like(a), torch.empty_like(c)
    if a.numel():
        _launch(kt.situ_glu_bwd_kernel, a.numel(), a, c, dh, da, dc, a.numel(), 1, 0, 0, beta1, beta2, prefix="bwd_")
    return da, dc


@_situ_glu_backward.register_fake
def _(a: Tensor, c: Tensor, dh: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(a), torch.empty_like(c)


def _situ_glu_setup(ctx, inputs, output) -> None:
    a, c, beta1, beta2 = inputs
    ctx.save_for_backward(a, c)  # h is recomputed by the backward kernel, never kept
    ctx.betas = (beta1, beta2)


def _situ_glu_grad(ctx, dh: Tensor):
    a, c = ctx.saved_tensors
    da, dc = _situ_glu_backward(a, c, dh, *ctx.betas)
    return da, dc, None, None


_situ_glu.register_autograd(_situ_glu_grad, setup_context=_situ_glu_setup)


@torch.library.custom_op("moe_lc::situ_glu_stacked", mutates_args=())
def _situ_glu_stacked(y: Tensor, beta1: float, beta2: float) -> Tensor:
    """SiTU of the halves of each row of y [rows, 2 hidden] (rows ``y.stride(0)`` elements apart)."""
    from moe_lc_kernels import situ_glu_triton as kt

    hidden = y.shape[-1] // 2
    h = y.new_empty(y.shape[0], hidden)
    if h.numel():
        _launch(kt.situ_glu_fwd_kernel, h.numel(), y, y[:, hidden:], h, h.numel(), hidden, row_stride(y),
                beta1, beta2, stacked=True)
    return h


@_situ_glu_stacked.register_fake
def _(y: Tensor, beta1: float, beta2: float) -> Tensor:
    return y.new_empty(y.shape[0], y.shape[-1] // 2)


@torch.library.custom_op("moe_lc::situ_glu_stacked_backward", mutates_args=())
def _situ_glu_stacked_backward(y: Tensor, dh: Tensor, beta1: float, beta2: float) -> Tensor:
    """dy in one contiguous tensor like y (no concatenation of da and dc for the GEMM before it,
    which produced y as one output)."""
    from moe_lc_kernels import situ_glu_triton as kt

    hidden = y.shape[-1] // 2
    dh = dh.contiguous()
    dy = y.new_empty(y.shape[0], 2 * hidden)
    if dh.numel():
        _launch(kt.situ_glu_bwd_kernel, dh.numel(), y, y[:, hidden:], dh, dy, dy[:, hidden:], dh.numel(),
                hidden, row_stride(y), 2 * hidden, beta1, beta2, stacked=True, prefix="bwd_")
    return dy


@_situ_glu_stacked_backward.register_fake
def _(y: Tensor, dh: Tensor, beta1: float, beta2: float) -> Tensor:
    return y.new_empty(y.shape[0], y.shape[-1])


def _situ_glu_stacked_setup(ctx, inputs, output) -> None:
    y, beta1, beta2 = inputs
    ctx.save_for_backward(y)
    ctx.betas = (beta1, beta2)


def _situ_glu_stacked_grad(ctx, dh: Tensor):
    y, = ctx.saved_tensors
    return _situ_glu_stacked_backward(y, dh, *ctx.betas), None, None


_situ_glu_stacked.register_autograd(_situ_glu_stacked_grad, setup_context=_situ_glu_stacked_setup)


def situ_glu_triton(a: Tensor, c: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """[b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(c/b2)] for a, c of one shape and dtype, output in that dtype.

    fp32 math; differentiable in a and c. Use ``moe_lc.ops.situ_glu.situ_glu``, which picks this or
    the reference.
    """
    if a.shape != c.shape or a.dtype != c.dtype or a.device != c.device:
        raise ValueError(f"situ_glu_triton: a and c must share shape, dtype and device, got {tuple(a.shape)} "
                         f"{a.dtype} {a.device} and {tuple(c.shape)} {c.dtype} {c.device}")
    if a.dtype not in DTYPES:
        raise ValueError(f"situ_glu_triton: a and c must be fp32/bf16/fp16, got {a.dtype}")
    return _situ_glu(a.contiguous(), c.contiguous(), float(beta1), float(beta2))


def situ_glu_stacked_triton(y: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """SiTU(a, c) with a, c the first and second halves of y's last dim, output [..., hidden] in y's
    dtype; differentiable in y. Use ``moe_lc.ops.situ_glu.glu_activation_stacked``."""
    if y.shape[-1] % 2 or y.dtype not in DTYPES:
        raise ValueError(f"situ_glu_stacked_triton: y must be fp32/bf16/fp16 with an even last dim, got "
                         f"{tuple(y.shape)} {y.dtype}")
    rows = y.reshape(-1, y.shape[-1])  # a view for a contiguous y or a 2-D one with strided rows
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    h = _situ_glu_stacked(rows, float(beta1), float(beta2))
    return h.view(*y.shape[:-1], y.shape[-1] // 2)


def situ_glu_stacked_backward_triton(y: Tensor, dh: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """The gradient of ``situ_glu_stacked_triton`` with respect to y [rows, 2 hidden] for dh [rows, hidden],
    contiguous like y: for callers that keep y themselves (the routed experts' custom op)."""
    return _situ_glu_stacked_backward(y, dh, float(beta1), float(beta2))
