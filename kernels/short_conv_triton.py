"""Triton kernels of the short causal depthwise convolution (+ SiLU); launched from short_conv.py.

Layout: x, y, dout, dy, dx are [B, T, C] with C innermost and contiguous (every tile row is one
coalesced segment of BC channels). dy and dx are contiguous; x's rows are XS elements apart, and
y's (forward) or dout's (SiLU backward) YS apart: a launch over a group of C channels of a wider
x writes (or reads) that group's own contiguous tensor. weight is contiguous [C, W]; ``pos`` is
the int32 [T] position of each token in its document (read only when HAS_DOCS). Every program owns a [BT, BC] tile of one
batch row: grid (cdiv(T, BT), cdiv(C, BC), B). The W shifted tiles a program loads overlap in all
but W - 1 rows, so x is read from DRAM about once; the rest hits L1/L2.

Tap j (0 <= j < W) pairs y[t] with x[t - j] and weight[c, W-1-j]; it is valid when t - j >= 0 and
t - j is in t's document, i.e. pos[t] >= j (pos[t] <= t, the first test only keeps addresses in
bounds should pos be inconsistent). Row offsets are int64: B*T*C can exceed 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_tile(x, w, row0, t, c, p, t_in, c_in, XS, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """fp32 [BT, BC] pre-activation y for rows t (of the batch row starting at row0, rows XS apart)
    and channels c."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w + c * W + (W - 1 - j), mask=c_in, other=0.0).to(tl.float32)
        ok = t_in & (t >= j) & (p >= j)
        rows = (row0 + t - j).to(tl.int64) * XS
        xj = tl.load(x + rows[:, None] + c[None, :], mask=ok[:, None] & c_in[None, :], other=0.0)
        acc += xj.to(tl.float32) * wj[None, :]
    return acc


@triton.jit
def _positions(pos, t, t_in, HAS_DOCS: tl.constexpr):
    """Position of rows t in their documents (t itself without documents)."""
    if HAS_DOCS:
        return tl.load(pos + t, mask=t_in, other=0)
    else:
        return t


@triton.jit
def short_conv_fwd_kernel(x, w, pos, y, T, C, XS, YS, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          HAS_DOCS: tl.constexpr, SILU: tl.constexpr):
    """y = act(conv(x)) in y's dtype; the pre-activation is not stored (the backward recomputes it)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    row0 = tl.program_id(2) * T
    t_in = t < T
    c_in = c < C
    p = _positions(pos, t, t_in, HAS_DOCS)
    acc = _conv_tile(x, w, row0, t, c, p, t_in, c_in, XS, W, BT, BC)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    offs = (row0 + t).to(tl.int64)[:, None] * YS + c[None, :]
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=t_in[:, None] & c_in[None, :])


@triton.jit
def short_conv_bwd_silu_kernel(x, w, pos, dout, dy, T, C, XS, YS, W: tl.constexpr, BT: tl.constexpr,
                               BC: tl.constexpr, HAS_DOCS: tl.constexpr):
    """dy = dout * silu'(y) with y recomputed: silu'(y) = s (1 + y (1 - s)), s = sigmoid(y); dy's rows
    XS apart (x's), dout's YS apart."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    row0 = tl.program_id(2) * T
    t_in = t < T
    c_in = c < C
    p = _positions(pos, t, t_in, HAS_DOCS)
    acc = _conv_tile(x, w, row0, t, c, p, t_in, c_in, XS, W, BT, BC)
    rows = (row0 + t).to(tl.int64)[:, None]
    mask = t_in[:, None] & c_in[None, :]
    g = tl.load(dout + rows * YS + c[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(acc)
    tl.store(dy + rows * XS + c[None, :], (g * s * (1.0 + acc * (1.0 - s))).to(dy.dtype.element_ty), mask=mask)


@triton.jit
def short_conv_bwd_kernel(x, w, pos, dy, dx, dw_part, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          HAS_DOCS: tl.constexpr):
    """dx[t] = sum_j weight[c, W-1-j] dy[t+j] over valid taps of t+j, and this program's share of
    dweight[c, W-1-j] = sum_t dy[t] x[t-j] into dw_part[program along (B, T), W-1-j, c] (fp32)."""
    pid_t = tl.program_id(0)
    t = pid_t * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    row0 = tl.program_id(2) * T
    t_in = t < T
    c_in = c < C
    p = _positions(pos, t, t_in, HAS_DOCS)
    offs = (row0 + t).to(tl.int64)[:, None] * C + c[None, :]
    g = tl.load(dy + offs, mask=t_in[:, None] & c_in[None, :], other=0.0).to(tl.float32)
    part = dw_part + (tl.program_id(2) * tl.num_programs(0) + pid_t).to(tl.int64) * (W * C)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w + c * W + (W - 1 - j), mask=c_in, other=0.0).to(tl.float32)
        # dx: output row t + j read x[t] through tap j when pos[t + j] >= j
        src = t + j
        src_in = src < T
        ok = src_in & (_positions(pos, src, src_in, HAS_DOCS) >= j)
        gj = tl.load(dy + offs + j * C, mask=ok[:, None] & c_in[None, :], other=0.0)
        acc += gj.to(tl.float32) * wj[None, :]
        # dweight: output row t read x[t - j] through tap j when pos[t] >= j
        okx = t_in & (t >= j) & (p >= j)
        rows = (row0 + t - j).to(tl.int64) * C
        xj = tl.load(x + rows[:, None] + c[None, :], mask=okx[:, None] & c_in[None, :], other=0.0)
        tl.store(part + (W - 1 - j) * C + c, tl.sum(g * xj.to(tl.float32), axis=0), mask=c_in)
    tl.store(dx + offs, acc.to(dx.dtype.element_ty), mask=t_in[:, None] & c_in[None, :])
