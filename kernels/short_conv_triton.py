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

The default backward with SiLU is ``short_conv_bwd_rows_kernel`` with SILU_GRAD (one pass, dy never
written); the two-kernel backward (SiLU's derivative into dy, then dx and dweight) stays for
``fused_bwd=0`` and for the convolution without SiLU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lc_kernels.fast_math_triton import sigmoid_pair


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
def _silu(y):
    """y sigmoid(y) (fast_math_triton's sigmoid: a third of tl.sigmoid's instructions)."""
    s, _ = sigmoid_pair(y)
    return y * s


@triton.jit
def _silu_grad(g, y):
    """g * silu'(y): silu'(y) = s (1 + y (1 - s)), s = sigmoid(y)."""
    s, one_minus_s = sigmoid_pair(y)
    return g * s * (1.0 + y * one_minus_s)


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
        acc = _silu(acc)
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
    tl.store(dy + rows * XS + c[None, :], _silu_grad(g, acc).to(dy.dtype.element_ty), mask=mask)


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


# The row kernels: the same three results, each program walking its BT rows R at a time, every row a
# [BC] tensor of its own. The W shifted reads of a [BT, BC] tile above are W loads of overlapping
# rows in flight at once, which the SM's L1 does not merge: each reaches L2, so x (and dy) cross L2
# about W times. Here a step of R rows loads its R new rows and the W - 1 before them (the previous
# step's last rows, already in L1) once each, and a shifted row is another tuple element: x crosses
# L2 (R + W - 1) / R times at a program's first step and about once after it.


@triton.jit
def _row_mask(c, c_in, t, T):
    """Channels c of row t, where row t is in [0, T) (a tensor mask whatever t is: in Triton's
    interpreter a step's row index is a Python int)."""
    rows = t + tl.zeros_like(c)
    return c_in & (rows >= 0) & (rows < T)


@triton.jit
def _row_tuple(ptr, row0, t_first, n: tl.constexpr, c, c_in, T, RS):
    """Rows t_first .. t_first + n - 1 (of the batch row starting at row0, rows RS apart), fp32 [BC]
    each, 0 outside [0, T)."""
    rows = ()
    for i in tl.static_range(n):
        t = t_first + i
        offs = (row0 + t).to(tl.int64) * RS + c
        rows = rows + (tl.load(ptr + offs, mask=_row_mask(c, c_in, t, T), other=0.0).to(tl.float32),)
    return rows


@triton.jit
def _position_tuple(pos, t_first, n: tl.constexpr, T, HAS_DOCS: tl.constexpr):
    """Positions in their documents of rows t_first .. t_first + n - 1 (0 past T; t itself without
    documents)."""
    out = ()
    for i in tl.static_range(n):
        t = t_first + i
        if HAS_DOCS:
            out = out + (tl.load(pos + t, mask=(t >= 0) & (t < T), other=0),)
        else:
            out = out + (t,)
    return out


@triton.jit
def _tap_weights(w, c, c_in, W: tl.constexpr):
    """weight[c, W-1-j] for every tap j, fp32 [BC] each."""
    taps = ()
    for j in tl.static_range(W):
        taps = taps + (tl.load(w + c * W + (W - 1 - j), mask=c_in, other=0.0).to(tl.float32),)
    return taps


@triton.jit
def _conv_row(xs, taps, p, r: tl.constexpr, W: tl.constexpr):
    """The pre-activation of the step's row r, from xs (the step's rows from W - 1 before its first)."""
    acc = taps[0] * xs[r + W - 1]
    for j in tl.static_range(1, W):
        acc += tl.where(p >= j, taps[j] * xs[r + W - 1 - j], 0.0)
    return acc


@triton.jit
def short_conv_rows_kernel(x, w, pos, dout, out, T, C, XS, YS, OS, W: tl.constexpr, BT: tl.constexpr, R: tl.constexpr,
                           BC: tl.constexpr, HAS_DOCS: tl.constexpr, SILU: tl.constexpr, SILU_GRAD: tl.constexpr):
    """``short_conv_fwd_kernel``'s y (rows OS apart), or with SILU_GRAD ``short_conv_bwd_silu_kernel``'s dy
    (dout's rows YS apart, dy's OS), R rows a step."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_in = c < C
    row0 = tl.program_id(2) * T
    taps = _tap_weights(w, c, c_in, W)
    for start in range(tl.program_id(0) * BT, tl.minimum(tl.program_id(0) * BT + BT, T), R):
        xs = _row_tuple(x, row0, start - (W - 1), R + W - 1, c, c_in, T, XS)
        ps = _position_tuple(pos, start, R, T, HAS_DOCS)
        for r in tl.static_range(R):
            t = start + r
            ok = _row_mask(c, c_in, t, T)
            offs = (row0 + t).to(tl.int64)
            acc = _conv_row(xs, taps, ps[r], r, W)
            if SILU_GRAD:
                acc = _silu_grad(tl.load(dout + offs * YS + c, mask=ok, other=0.0).to(tl.float32), acc)
            elif SILU:
                acc = _silu(acc)
            tl.store(out + offs * OS + c, acc.to(out.dtype.element_ty), mask=ok)


@triton.jit
def short_conv_bwd_rows_kernel(x, w, pos, g_in, dx, dw_part, T, C, XS, GS, DWS, W: tl.constexpr,
                               BT: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, HAS_DOCS: tl.constexpr,
                               SILU_GRAD: tl.constexpr):
    """``short_conv_bwd_kernel``'s dx and dweight partial sums (the same [programs, W, C] layout), R rows a
    step, from dy for the step's first row to W - 1 past its last and x from W - 1 before it.
    g_in is dy, or with SILU_GRAD the output gradient of y = silu(conv(x)): dy = dout * silu'(pre)
    is then formed here (pre recomputed from x, W - 1 rows further back), so the whole backward is one
    pass and dy never reaches memory; the W - 1 rows past a step are recomputed by the next step.
    x's and dx's rows XS apart, g_in's GS, dw_part's [programs, W] rows DWS."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_in = c < C
    row0 = tl.program_id(2) * T
    taps = _tap_weights(w, c, c_in, W)
    dw = ()  # tap j's sum over this program's rows: W [BC] vectors in the rows' own layout (no exchange a step)
    for j in tl.static_range(W):
        dw = dw + (tl.zeros([BC], dtype=tl.float32),)
    for start in range(pid_t * BT, tl.minimum(pid_t * BT + BT, T), R):
        ps = _position_tuple(pos, start, R + W - 1, T, HAS_DOCS)
        if SILU_GRAD:
            xs = _row_tuple(x, row0, start - (W - 1), R + 2 * W - 2, c, c_in, T, XS)
            gs = ()
            for i in tl.static_range(R + W - 1):
                t = start + i
                g = tl.load(g_in + (row0 + t).to(tl.int64) * GS + c, mask=_row_mask(c, c_in, t, T), other=0.0)
                gs = gs + (_silu_grad(g.to(tl.float32), _conv_row(xs, taps, ps[i], i, W)),)
        else:
            xs = _row_tuple(x, row0, start - (W - 1), R + W - 1, c, c_in, T, XS)
            gs = _row_tuple(g_in, row0, start, R + W - 1, c, c_in, T, GS)
        summed = ()
        for j in tl.static_range(W):
            tap_sum = dw[j]
            for r in tl.static_range(R):
                # dweight: output row t read x[t - j] through tap j when pos[t] >= j
                tap_sum += tl.where(ps[r] >= j, gs[r] * xs[r + W - 1 - j], 0.0)
            summed = summed + (tap_sum,)
        dw = summed
        for r in tl.static_range(R):
            # dx: output row t + j read x[t] through tap j when pos[t + j] >= j
            acc = taps[0] * gs[r]
            for j in tl.static_range(1, W):
                acc += tl.where(ps[r + j] >= j, taps[j] * gs[r + j], 0.0)
            t = start + r
            tl.store(dx + (row0 + t).to(tl.int64) * XS + c, acc.to(dx.dtype.element_ty), mask=_row_mask(c, c_in, t, T))
    part = dw_part + (tl.program_id(2) * tl.num_programs(0) + pid_t).to(tl.int64) * (W * DWS)
    for j in tl.static_range(W):
        tl.store(part + (W - 1 - j) * DWS + c, dw[j], mask=c_in)
