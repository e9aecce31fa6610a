"""The sigmoid output gate on Triton, y = sigmoid(g) * f(x): custom ops, their autograd and launches.

One pass each way, where the unfused forms make several: KDA's gated output norm compiled by
Inductor ran its forward at ~1.3 TB/s on an H100 (it reads the gate, a column slice of a wider
projection, with strided rows), MLA's eager gate a sigmoid of that slice, unvectorised, and a
product (docs/performance.md §12.26). ``moe_lc.ops.output_gate.gated_output`` is the entry point.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from moe_lc_kernels.layout import row_stride
from moe_lc_kernels.tuning import parse_launch_choices

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows per program and warps, forward and backward; a program covers one column group (a head of
# 128 with the norm, else 128 columns). Compiled for sm_90 (Triton 3.6, benchmarks/sass_audit.py),
# the backward with the norm at 32 rows and 4 warps holds 226 registers a thread (two programs an
# SM), at 8 warps 80; the forward 78. MOE_LC_OUTPUT_GATE_TUNING="key=value,..." overrides.
TUNING = dict(rows=32, warps=4, bwd_rows=32, bwd_warps=8, group=128)
TUNING.update(parse_launch_choices(os.environ.get("MOE_LC_OUTPUT_GATE_TUNING", ""), TUNING, "output gate"))


def _grid(n: int, c: int, group: int, rows: int) -> tuple[int, int]:
    return (-(-n // rows), -(-c // group))


@torch.library.custom_op("moe_lc::gated_output", mutates_args=())
def _gated_output(x: Tensor, g: Tensor, w: Optional[Tensor], eps: float, group: int) -> tuple[Tensor, Tensor]:
    """y [N, C] in g's dtype and 1 / rms(x) [N, C / group] (empty without w) for x, g [N, C] with unit
    column stride."""
    from moe_lc_kernels import output_gate_triton as kt

    n, c = x.shape
    y = torch.empty(n, c, device=x.device, dtype=g.dtype)
    rstd = torch.empty(n if w is not None else 0, c // group, device=x.device, dtype=torch.float32)
    if y.numel():
        kt.gated_output_fwd_kernel[_grid(n, c, group, TUNING["rows"])](
            x, g, w if w is not None else x, y, rstd, n, c, row_stride(x), row_stride(g), eps, GROUP=group,
            BLOCK_N=TUNING["rows"], NORM=w is not None, num_warps=TUNING["warps"])
    return y, rstd


@_gated_output.register_fake
def _(x: Tensor, g: Tensor, w: Optional[Tensor], eps: float, group: int) -> tuple[Tensor, Tensor]:
    n, c = x.shape
    return (x.new_empty(n, c, dtype=g.dtype),
            x.new_empty(n if w is not None else 0, c // group, dtype=torch.float32))


@torch.library.custom_op("moe_lc::gated_output_backward", mutates_args=())
def _gated_output_backward(x: Tensor, g: Tensor, w: Optional[Tensor], rstd: Tensor, dy: Tensor,
                           group: int) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dg (contiguous, in x's and g's dtypes) and dw (fp32; empty without w)."""
    from moe_lc_kernels import output_gate_triton as kt

    n, c = x.shape
    dy = dy.contiguous()
    dx = torch.empty(n, c, device=x.device, dtype=x.dtype)
    dg = torch.empty(n, c, device=x.device, dtype=g.dtype)
    rows = TUNING["bwd_rows"]
    grid = _grid(n, c, group, rows)
    dw_part = torch.empty(grid[0] if w is not None else 0, c, device=x.device, dtype=torch.float32)
    if dx.numel():
        kt.gated_output_bwd_kernel[grid](
            x, g, w if w is not None else x, rstd, dy, dx, dg, dw_part, n, c, row_stride(x), row_stride(g),
            GROUP=group, BLOCK_N=rows, NORM=w is not None, num_warps=TUNING["bwd_warps"])
    if w is None:
        return dx, dg, dw_part
    return dx, dg, dw_part.view(-1, c // group, group).sum((0, 1))


@_gated_output_backward.register_fake
def _(x: Tensor, g: Tensor, w: Optional[Tensor], rstd: Tensor, dy: Tensor,
      group: int) -> tuple[Tensor, Tensor, Tensor]:
    n, c = x.shape
    return (x.new_empty(n, c), x.new_empty(n, c, dtype=g.dtype),
            x.new_empty(group if w is not None else 0, dtype=torch.float32))


def _setup(ctx, inputs, output) -> None:
    x, g, w, eps, group = inputs
    ctx.save_for_backward(x, g, w, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.group = group


def _grad(ctx, dy: Tensor, _drstd: Optional[Tensor]):
    x, g, w, rstd = ctx.saved_tensors
    dx, dg, dw = _gated_output_backward(x, g, w, rstd, dy, ctx.group)
    return dx, dg, (dw.to(w.dtype) if w is not None else None), None, None


_gated_output.register_autograd(_grad, setup_context=_setup)


def _rows(t: Tensor, columns: int) -> Tensor:
    """t as [N, columns] with unit column stride: a view where the layout allows (a column slice of a
    wider tensor stays in place), else a copy."""
    rows = t.reshape(-1, columns)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gated_output_triton(x: Tensor, g: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """sigmoid(g) * (RMSNorm(x) over the last dim, times ``weight``; or x without a weight), in g's dtype.

    x and g of one shape; with a weight, x has two dims or more and its last one is weight's size.
    fp32 math; differentiable in x, g and weight. Use ``moe_lc.ops.output_gate.gated_output``.
    """
    if x.shape != g.shape or x.device != g.device:
        raise ValueError(f"gated_output_triton: x and g must share shape and device, got {tuple(x.shape)} "
                         f"{x.device} and {tuple(g.shape)} {g.device}")
    if x.dtype not in DTYPES or g.dtype not in DTYPES:
        raise ValueError(f"gated_output_triton: x and g must be fp32/bf16/fp16, got {x.dtype} and {g.dtype}")
    if weight is not None:
        group = x.shape[-1]
        if weight.shape != (group,) or group & (group - 1) or x.dim() < 2:
            raise ValueError(f"gated_output_triton: the norm takes a weight of x's last dim, a power of two, "
                             f"and x of two dims or more; got weight {tuple(weight.shape)} for x {tuple(x.shape)}")
        columns = x.shape[-2] * group
    else:
        group, columns = TUNING["group"], x.shape[-1] if x.dim() else 1
    y, _ = _gated_output(_rows(x, columns), _rows(g, columns), weight, float(eps), group)
    return y.view(x.shape)
