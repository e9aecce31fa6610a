"""Fused short causal depthwise convolution (+ SiLU) on Triton: autograd Function and launches.

Forward: one kernel (conv + SiLU, fp32 accumulation, output in x's dtype); it keeps no
pre-activation, the backward recomputes it. Backward: with SiLU a kernel writes the pre-activation
gradient dy = dout * silu'(y); then one kernel writes dx and per-program fp32 partial sums of
dweight ([programs along B*T, W, C]: 2W / BT of x's bf16 bytes, 1/16 at W=4, BT=128), summed here
in torch: no atomics, so the gradients are deterministic. Triton is imported on first use, so this
module imports without it (moe-lc's ``short_conv`` op is the public entry point: it checks the
inputs and picks these kernels or its PyTorch reference).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from moe_lc_kernels.tuning import parse_launch_choices

MAX_WIDTH = 8  # taps are unrolled in the kernels
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch choices: [BT, BC] tiles, C (contiguous) along BC, so a bf16 tile row is one 128-byte line.
# Memory-bound: each program issues all W shifted loads at once (x is read from DRAM ~once, the
# overlap hits L1/L2). Measured on an H200 ([8, 4096, 2048] bf16, W=4, conv + SiLU; the other
# choices tried: docs/performance.md §8): forward and SiLU backward 64 x 64 at 4 warps, dx/dweight
# 128 x 64 at 4 warps: f+b 0.63 ms (64 x 64 at 8 warps everywhere: 0.92; torch: 5.57). The fwd_*
# choices also launch the SiLU backward kernel.
# MOE_LC_SHORT_CONV_TUNING="key=value,..." overrides (a choice tried in a whole step: benchmarks/bench_ab.py).
# ``rows``: 1 runs the row kernels (short_conv_triton.py: each program walks its BT rows ``rows_r`` at a
# time, every row loaded once) with the same tile choices, 0 the tile kernels. ``fused_bwd``: with SiLU,
# 1 runs the backward as one row kernel (the SiLU derivative computed where dx and dweight use it:
# dy is never written) with its own tiles (``fused_*``), ``rows_r`` rows a step, whatever ``rows``
# is. Measured on H100s (k3-small's step at 8 of its 20 layers, three calls): -0.73%, -0.67% and
# -1.15% against the two-kernel backward; the row kernels in both passes with it -0.45%
# (docs/performance.md §8, §12.21). With rows carried between steps and steps inside a document unmasked
# it ran 247 -> 92 us a launch in the step and took 1.3% off it (one H100, §12.27); the row forward
# (``rows=1``) was no faster there.
TUNING = dict(fwd_bt=64, fwd_bc=64, fwd_warps=4, bwd_bt=128, bwd_bc=64, bwd_warps=4, rows=0, rows_r=8, fused_bwd=1,
              fused_bt=128, fused_bc=256, fused_warps=4)
TUNING.update(parse_launch_choices(os.environ.get("MOE_LC_SHORT_CONV_TUNING", ""), TUNING, "short conv"))


def _blocks(T: int, C: int, prefix: str) -> tuple[int, int, int]:
    """(BT, BC, warps) for a launch, shrunk to the next power of two of small T or C."""
    import triton

    bt = min(TUNING[f"{prefix}_bt"], triton.next_power_of_2(T))
    bc = min(TUNING[f"{prefix}_bc"], triton.next_power_of_2(C))
    return bt, bc, TUNING[f"{prefix}_warps"]


def _rows_per_step(bt: int) -> int:
    """Rows a step of a row kernel for a program of ``bt`` rows (``rows_r``, at most ``bt``)."""
    step = min(TUNING["rows_r"], bt)
    if step < 1 or bt % step:
        raise ValueError(f"short conv tuning: rows_r={TUNING['rows_r']} must divide the program's {bt} rows")
    return step


def _row_step(bt: int) -> Optional[int]:
    """Rows a step where the ``rows`` choice runs the row kernels; None where the tile kernels run."""
    return _rows_per_step(bt) if TUNING["rows"] else None


def _pieces(t: Tensor, pieces: int) -> list[Tensor]:
    """``pieces`` equal channel groups of [B, T, C] as views (no copy)."""
    width = t.shape[-1] // pieces
    return [t[..., g * width:(g + 1) * width] for g in range(pieces)]


class _ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, pos: Optional[Tensor], silu: bool, pieces: int):
        import triton

        from moe_lc_kernels import short_conv_triton as kt

        B, T, C = x.shape
        W = weight.shape[1]
        width = C // pieces
        ys = [x.new_empty(B, T, width) for _ in range(pieces)]
        bt, bc, warps = _blocks(T, width, "fwd")
        step = _row_step(bt)
        has_docs = pos is not None
        pos_arg = pos if has_docs else x
        for xg, wg, y in zip(_pieces(x, pieces), weight.split(width), ys):  # one launch per group
            grid = (triton.cdiv(T, bt), triton.cdiv(width, bc), B)
            if step is None:
                kt.short_conv_fwd_kernel[grid](xg, wg, pos_arg, y, T, width, C, width, W=W, BT=bt, BC=bc,
                                               HAS_DOCS=has_docs, SILU=silu, num_warps=warps)
            else:  # no output gradient to read: x stands in for it
                kt.short_conv_rows_kernel[grid](xg, wg, pos_arg, xg, y, T, width, XS=C, YS=C, OS=width, W=W, BT=bt,
                                                R=step, BC=bc, HAS_DOCS=has_docs, SILU=silu, SILU_GRAD=False,
                                                EVEN_C=width % bc == 0, num_warps=warps)
        ctx.save_for_backward(x, weight, pos)
        ctx.silu, ctx.pieces = silu, pieces
        return ys[0] if pieces == 1 else tuple(ys)

    @staticmethod
    def backward(ctx, *douts: Tensor):
        import triton

        from moe_lc_kernels import short_conv_triton as kt

        x, weight, pos = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[1]
        width = C // ctx.pieces
        has_docs = pos is not None
        pos_arg = pos if has_docs else x
        douts = [torch.zeros(B, T, width, device=x.device, dtype=x.dtype) if d is None else d.contiguous()
                 for d in douts]
        dx = torch.empty_like(x)
        if ctx.silu and TUNING["fused_bwd"]:
            # one pass per group: its output gradient in, its channels of dx and dw_part out
            bt, bc, warps = _blocks(T, width, "fused")
            t_blocks = triton.cdiv(T, bt)
            dw_part = torch.empty(B * t_blocks, W, C, device=x.device, dtype=torch.float32)
            for g, (xg, wg, dout) in enumerate(zip(_pieces(x, ctx.pieces), weight.split(width), douts)):
                kt.short_conv_bwd_rows_kernel[(t_blocks, triton.cdiv(width, bc), B)](
                    xg, wg, pos_arg, dout, dx[..., g * width:], dw_part[:, :, g * width:], T, width, XS=C, GS=width, DWS=C, W=W,
                    BT=bt, R=_rows_per_step(bt), BC=bc, HAS_DOCS=has_docs,
                    SILU_GRAD=True, EVEN_C=width % bc == 0, num_warps=warps)
            return dx, dw_part.sum(0).t().contiguous().to(weight.dtype), None, None, None
        bt, bc, warps = _blocks(T, C, "bwd")
        t_blocks = triton.cdiv(T, bt)
        step = _row_step(bt)
        dw_part = torch.empty(B * t_blocks, W, C, device=x.device, dtype=torch.float32)
        if ctx.silu:
            # dy in x's dtype, as torch autograd keeps silu's input gradient: one rounding (2^-9
            # relative in bf16) before fp32 accumulation, at half the bytes of an fp32 buffer that
            # is written once and read W times by the next kernel. Each group's kernel reads its own
            # output gradient and writes its channels of dy (no concatenation of the groups).
            dy = torch.empty_like(x)
            fbt, fbc, fwarps = _blocks(T, width, "fwd")
            fstep = _row_step(fbt)
            for xg, wg, dout, dyg in zip(_pieces(x, ctx.pieces), weight.split(width), douts, _pieces(dy, ctx.pieces)):
                grid = (triton.cdiv(T, fbt), triton.cdiv(width, fbc), B)
                if fstep is None:
                    kt.short_conv_bwd_silu_kernel[grid](xg, wg, pos_arg, dout, dyg, T, width, C, width, W=W, BT=fbt,
                                                        BC=fbc, HAS_DOCS=has_docs, num_warps=fwarps)
                else:
                    kt.short_conv_rows_kernel[grid](xg, wg, pos_arg, dout, dyg, T, width, XS=C, YS=width, OS=C, W=W,
                                                    BT=fbt, R=fstep, BC=fbc, HAS_DOCS=has_docs, SILU=True,
                                                    SILU_GRAD=True, EVEN_C=width % fbc == 0, num_warps=fwarps)
        else:
            dy = torch.cat(douts, dim=-1).to(x.dtype)
        grid = (t_blocks, triton.cdiv(C, bc), B)
        if step is None:
            kt.short_conv_bwd_kernel[grid](x, weight, pos_arg, dy, dx, dw_part, T, C, W=W, BT=bt, BC=bc,
                                           HAS_DOCS=has_docs, num_warps=warps)
        else:
            kt.short_conv_bwd_rows_kernel[grid](x, weight, pos_arg, dy, dx, dw_part, T, C, XS=C, GS=C, DWS=C, W=W,
                                                BT=bt, R=step, BC=bc, HAS_DOCS=has_docs, SILU_GRAD=False,
                                                EVEN_C=C % bc == 0, num_warps=warps)
        dweight = dw_part.sum(0).t().contiguous().to(weight.dtype)
        return dx, dweight, None, None, None


def _checked(x: Tensor, weight: Tensor, pos: Optional[Tensor]) -> None:
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"short_conv_triton: x and weight must be fp32/bf16/fp16, got {x.dtype}, {weight.dtype}")
    if weight.shape[1] > MAX_WIDTH:
        raise ValueError(f"short_conv_triton: at most {MAX_WIDTH} taps, got W = {weight.shape[1]}")
    if pos is not None and (pos.dtype != torch.int32 or pos.shape != (x.shape[1],)):
        raise ValueError(f"short_conv_triton: pos must be int32 [T = {x.shape[1]}], got {pos.dtype} {tuple(pos.shape)}")


def short_conv_triton(x: Tensor, weight: Tensor, pos: Optional[Tensor] = None, silu: bool = True) -> Tensor:
    """act(causal depthwise conv) of x [B, T, C] with weight [C, W], output in x's dtype.

    ``pos``: int32 [T] position of every token in its document (packed documents; B == 1), or
    None for one sequence per row. moe-lc's ``short_conv`` op checks the inputs and turns document
    boundaries into ``pos``.
    """
    _checked(x, weight, pos)
    if x.numel() == 0:  # nothing to launch: an empty output that autograd connects to x and weight
        y = x * weight[:, -1].to(x.dtype)
        return torch.nn.functional.silu(y) if silu else y
    return _ShortConvFunction.apply(x.contiguous(), weight.contiguous(), pos, silu, 1)


def short_conv_triton_pieces(x: Tensor, weight: Tensor, pieces: int, pos: Optional[Tensor] = None,
                             silu: bool = True) -> tuple[Tensor, ...]:
    """``short_conv_triton(x, weight, pos, silu).chunk(pieces, -1)``, each piece written as its own
    contiguous [B, T, C / pieces] tensor: what the KDA layer's stacked q, k, v convolution hands to
    kernels that take contiguous inputs, with no copy of the strided chunks forward and no
    concatenation of their gradients backward. C must divide into ``pieces``."""
    _checked(x, weight, pos)
    if pieces < 1 or x.shape[-1] % pieces:
        raise ValueError(f"short_conv_triton_pieces: C = {x.shape[-1]} channels do not split into {pieces} pieces")
    if x.numel() == 0:
        return short_conv_triton(x, weight, pos, silu).chunk(pieces, dim=-1)
    out = _ShortConvFunction.apply(x.contiguous(), weight.contiguous(), pos, silu, pieces)
    return (out,) if pieces == 1 else out
