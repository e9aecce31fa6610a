"""Triton kernels of the sigmoid output gate, y = sigmoid(g) * f(x); launched from output_gate.py.

f is RMSNorm over each group of GROUP consecutive columns scaled by a weight of GROUP values (NORM:
KDA's output, one group a head) or the identity (MLA's output). x and g are seen as [N, C] with
unit column stride and rows ``x_stride`` / ``g_stride`` elements apart (the gate is a column slice
of a wider projection's output, read in place); y and the gradients are contiguous [N, C]. Each
program owns BLOCK_N rows of one column group (program_id(1)); a group wider than GROUP is never
needed: without NORM, GROUP is any column block and the last one is masked.

Math in fp32 with fast_math_triton's sigmoid, loads and stores in the tensors' dtypes. Backward
(r = 1 / rms(x) kept by the forward, xh = x r, n = w xh, s = sigmoid(g)):

    dn = dy s,   dg = dy n s (1 - s),   dw = sum over rows of dn xh,
    dx = r (w dn - xh mean(w dn xh))   (identity: dn, n = x)

The weight gradient is summed per program into ``dw_part`` [programs along N, C] (no atomics, so
the sum is the same every run); the launcher adds the partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lc_kernels.fast_math_triton import sigmoid_pair


@triton.jit
def _block(N, C, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows (int64), columns, and their masks."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    return rows, cols, (rows < N)[:, None] & (cols < C)[None, :]


@triton.jit
def gated_output_fwd_kernel(x, g, w, y, rstd, N, C, x_stride, g_stride, eps, GROUP: tl.constexpr,
                            BLOCK_N: tl.constexpr, NORM: tl.constexpr):
    """y = sigmoid(g) * (w x / rms(x) per group, or x); with NORM also 1 / rms(x) into rstd [N, C / GROUP]."""
    rows, cols, mask = _block(N, C, GROUP, BLOCK_N)
    xv = tl.load(x + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(g + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, _ = sigmoid_pair(gv)
    if NORM:
        r = tl.math.rsqrt(tl.sum(xv * xv, axis=1) / GROUP + eps)
        tl.store(rstd + rows * (C // GROUP) + tl.program_id(1), r, mask=rows < N)
        xv = xv * r[:, None] * tl.load(w + cols - tl.program_id(1) * GROUP).to(tl.float32)[None, :]
    tl.store(y + rows[:, None] * C + cols[None, :], (xv * s).to(y.dtype.element_ty), mask=mask)


@triton.jit
def gated_output_bwd_kernel(x, g, w, rstd, dy, dx, dg, dw_part, N, C, x_stride, g_stride,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr):
    """dx, dg (contiguous [N, C]) and, with NORM, this program's rows' share of dw."""
    rows, cols, mask = _block(N, C, GROUP, BLOCK_N)
    xv = tl.load(x + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(g + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dyv = tl.load(dy + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, one_minus_s = sigmoid_pair(gv)
    dn = dyv * s
    if NORM:
        r = tl.load(rstd + rows * (C // GROUP) + tl.program_id(1), mask=rows < N, other=0.0)
        wv = tl.load(w + cols - tl.program_id(1) * GROUP).to(tl.float32)[None, :]
        xh = xv * r[:, None]
        n = xh * wv
        tl.store(dw_part + tl.program_id(0) * C + cols, tl.sum(dn * xh, axis=0))
        wdn = wv * dn
        dxv = r[:, None] * (wdn - xh * (tl.sum(wdn * xh, axis=1) / GROUP)[:, None])
    else:
        n = xv
        dxv = dn
    tl.store(dx + rows[:, None] * C + cols[None, :], dxv.to(dx.dtype.element_ty), mask=mask)
    tl.store(dg + rows[:, None] * C + cols[None, :], (dyv * n * s * one_minus_s).to(dg.dtype.element_ty),
             mask=mask)
