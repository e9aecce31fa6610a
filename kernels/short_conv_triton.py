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
# about W times. Here a step loads only its R new rows; the W - 1 rows of x (and, backward, of dy) it
# shares with the step before are carried over in registers, so each row is loaded once and the
# backward forms each row's dy once. Most steps lie inside one document and inside [0, T): they run
# without masks, at compile-time row strides (each row's offset is the load's immediate), which took
# the one-pass backward's step of 8 rows from 1,417 to 508 sm_90 instructions a warp
# (benchmarks/sass_audit.py); a step at a document start or an end of the row tests every row.


@triton.jit
def _row_mask(c, c_in, t, T):
    """Channels c of row t, where row t is in [0, T) (a tensor mask whatever t is: in Triton's
    interpreter a step's row index is a Python int)."""
    rows = t + tl.zeros_like(c)
    return c_in & (rows >= 0) & (rows < T)


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
def _row_rows(ptr, row0, t, RS: tl.constexpr, c):
    """Pointers to channels c of row t (of the batch row starting at row0, rows RS apart): a step's rows are
    ``i * RS`` further, compile-time offsets that become the loads' immediates."""
    return ptr + (row0 + t).to(tl.int64) * RS + c


@triton.jit
def _load_step_row(rows, i: tl.constexpr, RS: tl.constexpr, t, c, c_in, T, MASKED: tl.constexpr,
                   EVEN_C: tl.constexpr):
    """Row i past ``rows`` (``_row_rows`` of row t - i), fp32: 0 outside [0, T) where MASKED; unmasked where
    the caller has checked the row is in range (and every channel is, with EVEN_C)."""
    if MASKED:
        return tl.load(rows + i * RS, mask=_row_mask(c, c_in, t, T), other=0.0).to(tl.float32)
    elif EVEN_C:
        return tl.load(rows + i * RS).to(tl.float32)
    else:
        return tl.load(rows + i * RS, mask=c_in, other=0.0).to(tl.float32)


@triton.jit
def _store_step_row(rows, i: tl.constexpr, RS: tl.constexpr, t, value, c, c_in, T, MASKED: tl.constexpr,
                    EVEN_C: tl.constexpr):
    """``_load_step_row``'s store: value into row i past ``rows`` (row t), in the rows' dtype."""
    value = value.to(rows.dtype.element_ty)
    if MASKED:
        tl.store(rows + i * RS, value, mask=_row_mask(c, c_in, t, T))
    elif EVEN_C:
        tl.store(rows + i * RS, value)
    else:
        tl.store(rows + i * RS, value, mask=c_in)


@triton.jit
def _step_positions(pos, s, n: tl.constexpr, T, HAS_DOCS: tl.constexpr, MASKED: tl.constexpr):
    """``_position_tuple`` of rows s .. s + n - 1 where MASKED; a step without masks never reads them."""
    if MASKED:
        return _position_tuple(pos, s, n, T, HAS_DOCS)
    else:
        ps = ()
        for i in tl.static_range(n):
            ps = ps + (0,)
        return ps


@triton.jit
def _in_one_document(pos, s, n: tl.constexpr, T, W: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Whether rows s .. s + n - 1 are in [0, T) and each is at least W - 1 rows past its document's start
    (so the rows a step reads before them are in the document too): a step over them needs no mask.
    Positions in a document rise by one a row and restart at 0 past a boundary, so both ends tell."""
    inside = (s >= W - 1) & (s + n <= T)
    if HAS_DOCS:
        first = tl.load(pos + s, mask=inside, other=0)
        last = tl.load(pos + s + n - 1, mask=inside, other=0)
        inside = inside & (first >= W - 1) & (last - first == n - 1)
    return inside


@triton.jit
def _conv_row_in(xs, taps, p, i: tl.constexpr, W: tl.constexpr, MASKED: tl.constexpr):
    """The pre-activation of the row at xs[i + W - 1] (xs: consecutive rows), taps past its document
    start dropped where MASKED."""
    acc = taps[0] * xs[i + W - 1]
    for j in tl.static_range(1, W):
        if MASKED:
            acc += tl.where(p >= j, taps[j] * xs[i + W - 1 - j], 0.0)
        else:
            acc += taps[j] * xs[i + W - 1 - j]
    return acc


@triton.jit
def _fwd_rows_step(x, pos, dout, out, row0, s, xs_below, taps, c, c_in, T, XS: tl.constexpr, YS: tl.constexpr,
                   OS: tl.constexpr, W: tl.constexpr, R: tl.constexpr, HAS_DOCS: tl.constexpr, SILU: tl.constexpr,
                   SILU_GRAD: tl.constexpr, MASKED: tl.constexpr, EVEN_C: tl.constexpr):
    """Rows [s, s + R) of ``short_conv_rows_kernel``, from x's rows [s - W + 1, s) carried up in xs_below;
    returns x's rows [s + R - W + 1, s + R) for the step above. MASKED as in ``_bwd_rows_step``."""
    x_rows = _row_rows(x, row0, s, XS, c)
    g_rows = _row_rows(dout, row0, s, YS, c)
    out_rows = _row_rows(out, row0, s, OS, c)
    xs = xs_below
    for i in tl.static_range(R):
        xs = xs + (_load_step_row(x_rows, i, XS, s + i, c, c_in, T, MASKED, EVEN_C),)
    ps = _step_positions(pos, s, R, T, HAS_DOCS, MASKED)
    for r in tl.static_range(R):
        acc = _conv_row_in(xs, taps, ps[r], r, W, MASKED)
        if SILU_GRAD:
            acc = _silu_grad(_load_step_row(g_rows, r, YS, s + r, c, c_in, T, MASKED, EVEN_C), acc)
        elif SILU:
            acc = _silu(acc)
        _store_step_row(out_rows, r, OS, s + r, acc, c, c_in, T, MASKED, EVEN_C)
    xs_above = ()
    for i in tl.static_range(W - 1):
        xs_above = xs_above + (xs[R + i],)
    return xs_above


@triton.jit
def short_conv_rows_kernel(x, w, pos, dout, out, T, C, XS: tl.constexpr, YS: tl.constexpr, OS: tl.constexpr,
                           W: tl.constexpr, BT: tl.constexpr, R: tl.constexpr, BC: tl.constexpr,
                           HAS_DOCS: tl.constexpr, SILU: tl.constexpr, SILU_GRAD: tl.constexpr, EVEN_C: tl.constexpr):
    """``short_conv_fwd_kernel``'s y (rows OS apart), or with SILU_GRAD ``short_conv_bwd_silu_kernel``'s dy
    (dout's rows YS apart, dy's OS), R rows a step from the program's first row up, the W - 1 rows of x
    before a step carried up from the step below (each row of x loaded once). A step whose rows and
    the W - 1 before them are in [0, T) and in one document runs without masks (a uniform branch)."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_in = c < C
    row0 = tl.program_id(2) * T
    taps = _tap_weights(w, c, c_in, W)
    lo = tl.program_id(0) * BT
    x_rows = _row_rows(x, row0, lo - (W - 1), XS, c)
    xs_below = ()
    for i in tl.static_range(W - 1):
        xs_below = xs_below + (_load_step_row(x_rows, i, XS, lo - (W - 1) + i, c, c_in, T, True, EVEN_C),)
    for k in range(tl.cdiv(tl.minimum(BT, T - lo), R)):
        s = lo + k * R
        if _in_one_document(pos, s, R, T, W, HAS_DOCS):
            xs_below = _fwd_rows_step(x, pos, dout, out, row0, s, xs_below, taps, c, c_in, T, XS, YS, OS, W, R,
                                      HAS_DOCS, SILU, SILU_GRAD, False, EVEN_C)
        else:
            xs_below = _fwd_rows_step(x, pos, dout, out, row0, s, xs_below, taps, c, c_in, T, XS, YS, OS, W, R,
                                      HAS_DOCS, SILU, SILU_GRAD, True, EVEN_C)


@triton.jit
def _bwd_rows_step(x, pos, g_in, dx, row0, s, xs_above, dys_above, taps, dw, c, c_in, T, XS: tl.constexpr, GS: tl.constexpr,
                   W: tl.constexpr, R: tl.constexpr, HAS_DOCS: tl.constexpr, SILU_GRAD: tl.constexpr,
                   MASKED: tl.constexpr, EVEN_C: tl.constexpr):
    """Rows [s, s + R) of ``short_conv_bwd_rows_kernel``: dx stored, dweight's sums added to dw. xs_above
    holds x's rows [s + R - W + 1, s + R) and dys_above dy's rows [s + R, s + R + W - 1), both from the
    step above; returns the same two for the step below (x's rows [s - W + 1, s), dy's [s, s + W - 1))
    and the new sums. MASKED: rows may fall outside [0, T) or past a document start; otherwise the
    caller has checked that none does and every mask is dropped."""
    # x's rows [s - W + 1, s + R): R new ones under the W - 1 carried down
    x_rows = _row_rows(x, row0, s - (W - 1), XS, c)
    g_rows = _row_rows(g_in, row0, s, GS, c)
    dx_rows = _row_rows(dx, row0, s, XS, c)
    xs = ()
    for i in tl.static_range(R):
        xs = xs + (_load_step_row(x_rows, i, XS, s - (W - 1) + i, c, c_in, T, MASKED, EVEN_C),)
    xs = xs + xs_above
    ps = _step_positions(pos, s, R + W - 1, T, HAS_DOCS, MASKED)
    # dy of the step's rows, then dy's rows [s, s + R + W - 1)
    dys = ()
    for r in tl.static_range(R):
        g = _load_step_row(g_rows, r, GS, s + r, c, c_in, T, MASKED, EVEN_C)
        if SILU_GRAD:
            g = _silu_grad(g, _conv_row_in(xs, taps, ps[r], r, W, MASKED))
        dys = dys + (g,)
    dys = dys + dys_above
    summed = ()
    for j in tl.static_range(W):
        tap_sum = dw[j]
        for r in tl.static_range(R):
            # dweight: output row t read x[t - j] through tap j when pos[t] >= j
            if MASKED:
                tap_sum += tl.where(ps[r] >= j, dys[r] * xs[r + W - 1 - j], 0.0)
            else:
                tap_sum += dys[r] * xs[r + W - 1 - j]
        summed = summed + (tap_sum,)
    for r in tl.static_range(R):
        # dx: output row t + j read x[t] through tap j when pos[t + j] >= j
        acc = taps[0] * dys[r]
        for j in tl.static_range(1, W):
            if MASKED:
                acc += tl.where(ps[r + j] >= j, taps[j] * dys[r + j], 0.0)
            else:
                acc += taps[j] * dys[r + j]
        _store_step_row(dx_rows, r, XS, s + r, acc, c, c_in, T, MASKED, EVEN_C)
    xs_below = ()
    dys_below = ()
    for i in tl.static_range(W - 1):
        xs_below = xs_below + (xs[i],)
        dys_below = dys_below + (dys[i],)
    return xs_below, dys_below, summed


@triton.jit
def short_conv_bwd_rows_kernel(x, w, pos, g_in, dx, dw_part, T, C, XS: tl.constexpr, GS: tl.constexpr, DWS, W: tl.constexpr,
                               BT: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, HAS_DOCS: tl.constexpr,
                               SILU_GRAD: tl.constexpr, EVEN_C: tl.constexpr):
    """``short_conv_bwd_kernel``'s dx and dweight partial sums (the same [programs, W, C] layout), R rows a
    step, from the program's last rows down. g_in is dy, or with SILU_GRAD the output
    gradient of y = silu(conv(x)): dy = dout * silu'(pre) is then formed here (pre recomputed from x), so
    the whole backward is one pass and dy never reaches memory.

    Walking down, a step's dx needs dy W - 1 rows past its own and its pre-activations x W - 1 rows
    before: the step above computed and loaded those, so they are carried down in registers and each
    row is loaded, and its dy formed, once (the W - 1 rows past the program's last are formed once, at
    its start). A step whose rows, and the W - 1 on either side, are in [0, T) and in one document runs
    without masks (a uniform branch); the others test every row. x's and dx's rows XS apart, g_in's GS,
    dw_part's [programs, W] rows DWS."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_in = c < C
    row0 = tl.program_id(2) * T
    taps = _tap_weights(w, c, c_in, W)
    lo = pid_t * BT
    n_steps = tl.cdiv(tl.minimum(BT, T - lo), R)
    top = lo + n_steps * R  # one past the first step's rows
    # carried into the first step: x's rows [top - W + 1, top) and dy's rows [top, top + W - 1)
    x_rows = _row_rows(x, row0, top - (W - 1), XS, c)
    g_rows = _row_rows(g_in, row0, top, GS, c)
    xs = ()
    for i in tl.static_range(2 * W - 2):
        xs = xs + (_load_step_row(x_rows, i, XS, top - (W - 1) + i, c, c_in, T, True, EVEN_C),)
    ps = _position_tuple(pos, top, W - 1, T, HAS_DOCS)
    xs_above = ()
    dys_above = ()
    for i in tl.static_range(W - 1):
        xs_above = xs_above + (xs[i],)
        g = _load_step_row(g_rows, i, GS, top + i, c, c_in, T, True, EVEN_C)
        if SILU_GRAD:
            g = _silu_grad(g, _conv_row_in(xs, taps, ps[i], i, W, True))
        dys_above = dys_above + (g,)
    dw = ()  # tap j's sum over this program's rows: W [BC] vectors in the rows' own layout (no exchange a step)
    for j in tl.static_range(W):
        dw = dw + (tl.zeros([BC], dtype=tl.float32),)
    for k in range(n_steps):
        s = top - (k + 1) * R
        if _in_one_document(pos, s, R + W - 1, T, W, HAS_DOCS):  # the step's rows and the W - 1 after them
            xs_above, dys_above, dw = _bwd_rows_step(x, pos, g_in, dx, row0, s, xs_above, dys_above, taps, dw, c,
                                                     c_in, T, XS, GS, W, R, HAS_DOCS, SILU_GRAD, False, EVEN_C)
        else:
            xs_above, dys_above, dw = _bwd_rows_step(x, pos, g_in, dx, row0, s, xs_above, dys_above, taps, dw, c,
                                                     c_in, T, XS, GS, W, R, HAS_DOCS, SILU_GRAD, True, EVEN_C)
    part = dw_part + (tl.program_id(2) * tl.num_programs(0) + pid_t).to(tl.int64) * (W * DWS)
    for j in tl.static_range(W):
        tl.store(part + (W - 1 - j) * DWS + c, dw[j], mask=c_in)
