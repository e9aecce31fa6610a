r"""Triton kernels for chunked KDA (SPEC 2.2), forward and backward.

Per head, per chunk of C = 64 tokens entered with state S (K x V), with G the in-chunk cumulative
log-decay, Gamma = exp(G), b = beta and q pre-scaled by ``scale``:

    R   = StrictTril((K Gamma)(K / Gamma)^T)          decayed key-key scores
    Aqk = Tril((Q Gamma)(K / Gamma)^T)                 decayed query-key scores
    X   = (I + Diag(b) R)^-1,   T = X Diag(b)          the UT transform
    W   = T (Gamma K),   U = T V
    Delta = U - W S,   O = (Gamma Q) S + Aqk Delta,   S' = Diag(Gamma_C) S + (Gamma_C / Gamma K)^T Delta

Kernels (one launch each, all rows of a chunk in one program):
- ``_prep_kernel``    parallel over (chunk, head): raw q/k/gate/beta -> L2 norm, gate, cumsum,
                      R and Aqk, X, W, U, Gamma Q, Gamma_C / Gamma K, Gamma_C.
- ``_state_fwd_kernel`` serial over the chunks of one segment: Delta, O, next state. With
                      ``TRANSITION`` it also carries K identity columns with zero values, which end as
                      the segment's transition M (S_end = M S_start + S~).
- ``_state_bwd_kernel``: the same, reversed, for dS (the transition is M^T).
(The composition of segments, S_{j+1} = M_j S_j + S~_j, is a few batched matmuls in kernels/kda.py.)
- ``_bwd_intra_kernel`` parallel over (chunk, head): every parameter gradient of one chunk from
                      its entering state, the state gradient after it and dDelta.

The bounded gate is what makes the score matrices one dense matmul per 16-token tile: for key tile
b we factor exp(G_i - G_j) = exp(G_i - rho_b) * exp(rho_b - G_j), rho_b the log-decay at the tile's
start. The second factor is at most exp(16 |g_min|) = e^80 (finite in fp32 and bf16), the first at
most 1 (rows i before tile b are masked), so R = sum_b (K F_b)(K E masked to tile b)^T exactly,
with no position-pair special case on the diagonal tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64
TILE = 16
NORM_EPS = tl.constexpr(1e-6)


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _load_chunk(q, k, gz, beta, A_log, dt_bias, bos, eos, h, H, lower_bound,
                K: tl.constexpr, BT: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Normalised q, k, the log-decay g and beta of one chunk (fp32), plus what backward needs."""
    rows = tl.arange(0, BT)
    valid = (bos + rows) < eos
    ck = tl.arange(0, K)
    offs = ((bos + rows)[:, None] * H + h) * K + ck[None, :]
    m2 = valid[:, None]
    qv = tl.load(q + offs, mask=m2, other=0.0).to(tl.float32)
    kv = tl.load(k + offs, mask=m2, other=0.0).to(tl.float32)
    if L2NORM:
        rq = 1.0 / tl.sqrt(tl.sum(qv * qv, axis=1) + NORM_EPS)
        rk = 1.0 / tl.sqrt(tl.sum(kv * kv, axis=1) + NORM_EPS)
        qv = qv * rq[:, None]
        kv = kv * rk[:, None]
    else:
        rq = tl.full([BT], 1.0, tl.float32)
        rk = tl.full([BT], 1.0, tl.float32)
    zv = tl.load(gz + offs, mask=m2, other=0.0).to(tl.float32)
    if GATE_IN_KERNEL:
        rate = tl.exp(tl.load(A_log + h).to(tl.float32))
        if HAS_DT_BIAS:
            zv = zv + tl.load(dt_bias + h * K + ck).to(tl.float32)[None, :]
        s = rate * zv
        sig = tl.minimum(tl.maximum(tl.sigmoid(s), 1.1754944e-38), 0.99999994)
        g = lower_bound * sig
    else:
        s = zv
        sig = zv
        g = zv
    g = tl.where(m2, g, 0.0)
    bv = tl.load(beta + (bos + rows) * H + h, mask=valid, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        bv = tl.sigmoid(bv)
    bv = tl.where(valid, bv, 0.0)
    return qv, kv, rq, rk, g, s, sig, bv


@triton.jit
def _tile_start(G, rows, BT: tl.constexpr):
    """rho_b (log-decay at the start of 16-token tile b, b = 1..3) and rho for every row's own tile."""
    r1 = tl.sum(tl.where(rows[:, None] == 15, G, 0.0), axis=0)
    r2 = tl.sum(tl.where(rows[:, None] == 31, G, 0.0), axis=0)
    r3 = tl.sum(tl.where(rows[:, None] == 47, G, 0.0), axis=0)
    tile = (rows // 16)[:, None]
    rho_row = tl.where(tile == 1, r1[None, :], tl.where(tile == 2, r2[None, :], tl.where(tile == 3, r3[None, :], 0.0)))
    return r1, r2, r3, rho_row


@triton.jit
def _from_tile(G, rho, rows, start: tl.constexpr):
    """exp(G_i - rho) for rows at or after ``start`` (<= 1), 0 before (masked; never overflows)."""
    return tl.where(rows[:, None] >= start, tl.exp(tl.minimum(G - rho[None, :], 0.0)), 0.0)


@triton.jit
def _in_tile(x, rows, b: tl.constexpr):
    return tl.where((rows // 16)[:, None] == b, x, 0.0)


@triton.jit
def _scores(qs, kv, G, rows, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """R = StrictTril((K Gamma)(K/Gamma)^T), Aqk = Tril((Q Gamma)(K/Gamma)^T), one matmul per key tile."""
    r1, r2, r3, rho_row = _tile_start(G, rows, BT)
    kn = kv * tl.exp(rho_row - G)  # K / Gamma relative to the own tile's start: <= e^(16 |g_min|)
    f0 = tl.exp(G)
    f1 = _from_tile(G, r1, rows, 16)
    f2 = _from_tile(G, r2, rows, 32)
    f3 = _from_tile(G, r3, rows, 48)
    kn0 = tl.trans(_in_tile(kn, rows, 0))
    kn1 = tl.trans(_in_tile(kn, rows, 1))
    kn2 = tl.trans(_in_tile(kn, rows, 2))
    kn3 = tl.trans(_in_tile(kn, rows, 3))
    R = tl.dot(kv * f0, kn0, input_precision=DOT_PREC)
    R += tl.dot(kv * f1, kn1, input_precision=DOT_PREC)
    R += tl.dot(kv * f2, kn2, input_precision=DOT_PREC)
    R += tl.dot(kv * f3, kn3, input_precision=DOT_PREC)
    Aqk = tl.dot(qs * f0, kn0, input_precision=DOT_PREC)
    Aqk += tl.dot(qs * f1, kn1, input_precision=DOT_PREC)
    Aqk += tl.dot(qs * f2, kn2, input_precision=DOT_PREC)
    Aqk += tl.dot(qs * f3, kn3, input_precision=DOT_PREC)
    cols = tl.arange(0, BT)
    R = tl.where(rows[:, None] > cols[None, :], R, 0.0)
    Aqk = tl.where(rows[:, None] >= cols[None, :], Aqk, 0.0)
    return R, Aqk


@triton.jit
def _unit_lower_inverse(A, rows, BT: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A, by forward substitution one row at a time."""
    cols = tl.arange(0, BT)
    X = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)  # A[i, :] (zero from column i on)
        contrib = tl.sum(a_i[:, None] * X, axis=0)  # sum_j A[i, j] X[j, :]
        X = tl.where(rows[:, None] == i, tl.where(cols == i, 1.0, 0.0)[None, :] - contrib[None, :], X)
    return X


@triton.jit
def _unit_lower_inverse_blocked(A, rows, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower A with matmuls: the four 16x16 diagonal blocks at once, then
    (I + A)^-1 = (I + Xd Ao)^-1 Xd with Xd = (I + Ad)^-1, Ad/Ao the block-diagonal/-off-diagonal
    parts; N = Xd Ao is strictly block-lower, so N^4 = 0 and the series stops after N^3."""
    cols = tl.arange(0, BT)
    eye = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    same_tile = (rows[:, None] // 16) == (cols[None, :] // 16)
    Ad = tl.where(same_tile, A, 0.0)
    Ao = A - Ad
    X = eye
    local = (rows % 16)[:, None]
    for i in range(1, 16):  # row i of every tile, from rows before it in the same tile
        contrib = tl.dot(tl.where(local == i, Ad, 0.0), X, input_precision=PREC)
        X = tl.where(local == i, eye - contrib, X)
    N = tl.dot(X, Ao, input_precision=PREC)
    N2 = tl.dot(N, N, input_precision=PREC)
    series = eye - N + N2 - tl.dot(N2, N, input_precision=PREC)
    return tl.dot(series, X, input_precision=PREC)


# ----------------------------------------------------------------------------- forward, parallel part
@triton.jit
def _prep_kernel(q, k, v, gz, beta, A_log, dt_bias, chunk_bos, chunk_eos,
                 w_out, u_out, qg_out, kend_out, aqk_out, gc_out, x_out,
                 scale, lower_bound, H,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                 BETA_SIGMOID: tl.constexpr, STORE_X: tl.constexpr, DOT_PREC: tl.constexpr,
                 INV_BLOCKED: tl.constexpr, INV_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(chunk_bos + c).to(tl.int64)
    eos = tl.load(chunk_eos + c).to(tl.int64)
    rows = tl.arange(0, BT)
    valid = (bos + rows) < eos
    ck = tl.arange(0, K)
    cv = tl.arange(0, V)
    cb = tl.arange(0, BT)

    qv, kv, rq, rk, g, s, sig, bv = _load_chunk(q, k, gz, beta, A_log, dt_bias, bos, eos, h, H, lower_bound,
                                                K, BT, GATE_IN_KERNEL, HAS_DT_BIAS, L2NORM, BETA_SIGMOID)
    qs = qv * scale
    G = tl.cumsum(g, axis=0)
    R, Aqk = _scores(qs, kv, G, rows, BT, DOT_PREC)
    if INV_BLOCKED:
        X = _unit_lower_inverse_blocked(R * bv[:, None], rows, BT, INV_PREC)
    else:
        X = _unit_lower_inverse(R * bv[:, None], rows, BT)
    T = X * bv[None, :]
    eG = tl.exp(G)
    GC = tl.sum(g, axis=0)
    vv = tl.load(v + ((bos + rows)[:, None] * H + h) * V + cv[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    W = tl.dot(T, kv * eG, input_precision=DOT_PREC)
    U = tl.dot(T, vv, input_precision=DOT_PREC)

    offk = ((bos + rows)[:, None] * H + h) * K + ck[None, :]
    m2 = valid[:, None]
    ty = w_out.dtype.element_ty
    tl.store(w_out + offk, W.to(ty), mask=m2)
    tl.store(qg_out + offk, (qs * eG).to(ty), mask=m2)
    tl.store(kend_out + offk, (kv * tl.exp(GC[None, :] - G)).to(ty), mask=m2)
    tl.store(u_out + ((bos + rows)[:, None] * H + h) * V + cv[None, :], U.to(ty), mask=m2)
    tl.store(aqk_out + ((bos + rows)[:, None] * H + h) * BT + cb[None, :], Aqk.to(ty), mask=m2)
    tl.store(gc_out + (c.to(tl.int64) * H + h) * K + ck, tl.exp(GC))
    if STORE_X:
        tl.store(x_out + ((c.to(tl.int64) * H + h) * BT + rows[:, None]) * BT + cb[None, :], X)


# ----------------------------------------------------------------------------- forward, state pass
@triton.jit
def _state_fwd_kernel(w, u, qg, kend, aqk, gc, o, states, seg_init, seg_end,
                      seg_chunk0, seg_nchunks, seg_bos, seg_eos, H,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      V_END: tl.constexpr, HAS_INIT: tl.constexpr, TRANSITION: tl.constexpr,
                      STORE_OUTPUT: tl.constexpr, STORE_STATES: tl.constexpr, DOT_PREC: tl.constexpr):
    """One program: columns [pv*BV, pv*BV+BV) of one segment's state for one head, chunk by chunk.

    Column blocks past V (only with TRANSITION) carry identity columns with zero values: they end
    as the transition M of the segment. ``seg_end`` has V_END = V (+ K with TRANSITION) columns.
    """
    pv = tl.program_id(0)
    sh = tl.program_id(1)
    seg = sh // H
    h = sh % H
    c0 = tl.load(seg_chunk0 + seg)
    nc = tl.load(seg_nchunks + seg)
    rk = tl.arange(0, K)
    cv = tl.arange(0, BV)
    cb = tl.arange(0, BT)
    col = pv * BV + cv  # column in [0, V) for values, V + (transition column) past it
    is_value = (col < V)[None, :]
    if HAS_INIT:
        S = tl.load(seg_init + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V + col[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if TRANSITION:
        S = tl.where(is_value, S, tl.where(rk[:, None] == (col - V)[None, :], 1.0, 0.0))
    bos0 = tl.load(seg_bos + seg).to(tl.int64)
    eos = tl.load(seg_eos + seg).to(tl.int64)
    for i in range(0, nc):  # chunks of a segment are contiguous: affine addresses, pipelined loads
        c = (c0 + i).to(tl.int64)
        rows = bos0 + i * BT + tl.arange(0, BT)
        m2 = (rows < eos)[:, None]
        if STORE_STATES:
            tl.store(states + ((c * H + h) * K + rk[:, None]) * V + col[None, :], S.to(states.dtype.element_ty))
        Wt = tl.load(w + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
        Ut = tl.load(u + (rows[:, None] * H + h) * V + col[None, :], mask=m2 & is_value, other=0.0)
        Sb = S.to(Wt.dtype)
        D = Ut.to(tl.float32) - tl.dot(Wt, Sb, input_precision=DOT_PREC)
        Db = D.to(Wt.dtype)
        if STORE_OUTPUT:
            Qt = tl.load(qg + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
            At = tl.load(aqk + (rows[:, None] * H + h) * BT + cb[None, :], mask=m2, other=0.0)
            Ot = tl.dot(Qt, Sb, input_precision=DOT_PREC) + tl.dot(At, Db, input_precision=DOT_PREC)
            tl.store(o + (rows[:, None] * H + h) * V + col[None, :], Ot.to(o.dtype.element_ty), mask=m2)
        Kt = tl.load(kend + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
        gct = tl.load(gc + (c * H + h) * K + rk)
        S = S * gct[:, None] + tl.dot(tl.trans(Kt), Db, input_precision=DOT_PREC)
    tl.store(seg_end + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V_END + (pv * BV + cv)[None, :], S)


# ----------------------------------------------------------------------------- backward, state pass
@triton.jit
def _state_bwd_kernel(qg, w, kend, aqk, gc, do, dh, ddelta, seg_init, seg_start_grad,
                      seg_chunk0, seg_nchunks, seg_bos, seg_eos, H,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Reverse pass over one segment: dS (gradient of the state after a chunk), chunk by chunk.

    dDelta = Aqk^T dO + Kend dS;  dS_before = Diag(Gamma_C) dS + Qg^T dO - W^T dDelta.
    With STORE it writes dS after every chunk (``dh``) and dDelta; at the end dS at the segment start.
    """
    pv = tl.program_id(0)
    sh = tl.program_id(1)
    seg = sh // H
    h = sh % H
    c0 = tl.load(seg_chunk0 + seg)
    nc = tl.load(seg_nchunks + seg)
    rk = tl.arange(0, K)
    col = pv * BV + tl.arange(0, BV)
    cb = tl.arange(0, BT)
    if HAS_INIT:
        dS = tl.load(seg_init + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V + col[None, :])
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    bos0 = tl.load(seg_bos + seg).to(tl.int64)
    eos = tl.load(seg_eos + seg).to(tl.int64)
    for i in range(0, nc):
        c = (c0 + nc - 1 - i).to(tl.int64)
        rows = bos0 + (nc - 1 - i) * BT + tl.arange(0, BT)
        m2 = (rows < eos)[:, None]
        if STORE:
            tl.store(dh + ((c * H + h) * K + rk[:, None]) * V + col[None, :], dS.to(dh.dtype.element_ty))
        At = tl.load(aqk + (rows[:, None] * H + h) * BT + cb[None, :], mask=m2, other=0.0)
        Kt = tl.load(kend + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
        dOt = tl.load(do + (rows[:, None] * H + h) * V + col[None, :], mask=m2, other=0.0).to(At.dtype)
        dD = tl.dot(tl.trans(At), dOt, input_precision=DOT_PREC) + tl.dot(Kt, dS.to(Kt.dtype), input_precision=DOT_PREC)
        if STORE:
            tl.store(ddelta + (rows[:, None] * H + h) * V + col[None, :], dD.to(ddelta.dtype.element_ty), mask=m2)
        Qt = tl.load(qg + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
        Wt = tl.load(w + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0)
        gct = tl.load(gc + (c * H + h) * K + rk)
        dS = (dS * gct[:, None] + tl.dot(tl.trans(Qt), dOt, input_precision=DOT_PREC)
              - tl.dot(tl.trans(Wt), dD.to(Wt.dtype), input_precision=DOT_PREC))
    tl.store(seg_start_grad + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V + col[None, :], dS)


@triton.jit
def _score_grads_tile(dA, dAqk, bv, kv, qs, kn, f, pk, pq, dkn, db, rows, b: tl.constexpr, PREC: tl.constexpr):
    """Backward of one key tile b of R and Aqk (see _bwd_intra_kernel)."""
    kn_b = _in_tile(kn, rows, b)
    u = tl.dot(dA, kn_b, input_precision=PREC)
    db += tl.sum(kv * f * u, axis=1)
    pk += u * f * bv[:, None]
    pq += tl.dot(dAqk, kn_b, input_precision=PREC) * f
    kf = kv * f * bv[:, None]  # dR^T (K F_b) = dA^T (Diag(b) K F_b)
    dkn += _in_tile(tl.dot(tl.trans(dA), kf, input_precision=PREC)
                    + tl.dot(tl.trans(dAqk), qs * f, input_precision=PREC), rows, b)
    return pk, pq, dkn, db


# ----------------------------------------------------------------------------- backward, parallel part
@triton.jit
def _bwd_intra_kernel(q, k, v, gz, beta, A_log, dt_bias, chunk_bos, chunk_eos,
                      x_in, states, dh, ddelta, do,
                      dq, dk, dv, dgz, dbeta, dA_part, ddtb_part,
                      scale, lower_bound, H,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr,
                      BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr, PREC: tl.constexpr):
    """Every input gradient of one chunk, given its entering state S, dS after it and dDelta."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    c64 = c.to(tl.int64)
    bos = tl.load(chunk_bos + c).to(tl.int64)
    eos = tl.load(chunk_eos + c).to(tl.int64)
    rows = tl.arange(0, BT)
    valid = (bos + rows) < eos
    m2 = valid[:, None]
    ck = tl.arange(0, K)
    cb = tl.arange(0, BT)
    offk = ((bos + rows)[:, None] * H + h) * K + ck[None, :]

    qv, kv, rq, rk, g, s, sig, bv = _load_chunk(q, k, gz, beta, A_log, dt_bias, bos, eos, h, H, lower_bound,
                                                K, BT, GATE_IN_KERNEL, HAS_DT_BIAS, L2NORM, BETA_SIGMOID)
    qs = qv * scale
    G = tl.cumsum(g, axis=0)
    GC = tl.sum(g, axis=0)
    eG = tl.exp(G)
    X = tl.load(x_in + ((c64 * H + h) * BT + rows[:, None]) * BT + cb[None, :])
    T = X * bv[None, :]
    kg = kv * eG
    W = tl.dot(T, kg, input_precision=PREC)

    # Gradients of the chunk's state-pass operands, V in blocks of BV (bounded shared memory).
    Wb = W.to(states.dtype.element_ty)
    dqg = tl.zeros([BT, K], dtype=tl.float32)
    dW = tl.zeros([BT, K], dtype=tl.float32)
    dkend = tl.zeros([BT, K], dtype=tl.float32)
    dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    dgc = tl.zeros([K], dtype=tl.float32)
    for vb in tl.static_range(0, V // BV):
        cvb = vb * BV + tl.arange(0, BV)
        offb = ((bos + rows)[:, None] * H + h) * V + cvb[None, :]
        vv = tl.load(v + offb, mask=m2, other=0.0).to(tl.float32)
        base_s = ((c64 * H + h) * K + ck[:, None]) * V + cvb[None, :]
        S = tl.load(states + base_s)
        dH = tl.load(dh + base_s)
        D = tl.dot(T, vv, input_precision=PREC) - tl.dot(Wb, S, input_precision=PREC)
        dOt = tl.load(do + offb, mask=m2, other=0.0).to(tl.float32)
        dD = tl.load(ddelta + offb, mask=m2, other=0.0).to(tl.float32)
        dgc += tl.sum(S.to(tl.float32) * dH.to(tl.float32), axis=1)
        dqg += tl.dot(dOt.to(S.dtype), tl.trans(S), input_precision=PREC)
        dW -= tl.dot(dD.to(S.dtype), tl.trans(S), input_precision=PREC)
        dkend += tl.dot(D.to(dH.dtype), tl.trans(dH), input_precision=PREC)
        dAqk += tl.dot(dOt, tl.trans(D), input_precision=PREC)
        dT += tl.dot(dD, tl.trans(vv), input_precision=PREC)  # U = T V
        dvv = tl.dot(tl.trans(T), dD, input_precision=PREC)
        tl.store(dv + offb, dvv.to(dv.dtype.element_ty), mask=m2)
    dAqk = tl.where(rows[:, None] >= cb[None, :], dAqk, 0.0)

    # W = T (Gamma K), T = X Diag(b), X = (I + Diag(b) R)^-1.
    dT += tl.dot(dW, tl.trans(kg), input_precision=PREC)
    dkg = tl.dot(tl.trans(T), dW, input_precision=PREC)
    db = tl.sum(dT * X, axis=0)  # over rows i: d b_j from T = X Diag(b)
    dX = dT * bv[None, :]
    dA = -tl.dot(tl.dot(tl.trans(X), dX, input_precision=PREC), tl.trans(X), input_precision=PREC)
    dA = tl.where(rows[:, None] > cb[None, :], dA, 0.0)

    # R = sum_b (K F_b)(K E in tile b)^T, Aqk = sum_b (Q F_b)(K E in tile b)^T; rho_b cancels.
    # One key tile at a time, so only one tile's operands are live; d b_i from A = Diag(b) R is
    # sum_j dA_ij R_ij = sum_b rowsum((K F_b) * (dA (K E)_b)), with no need to rebuild R.
    r1, r2, r3, rho_row = _tile_start(G, rows, BT)
    E = tl.exp(rho_row - G)
    kn = kv * E
    pk = tl.zeros([BT, K], dtype=tl.float32)
    pq = tl.zeros([BT, K], dtype=tl.float32)
    dkn = tl.zeros([BT, K], dtype=tl.float32)
    pk, pq, dkn, db = _score_grads_tile(dA, dAqk, bv, kv, qs, kn, eG, pk, pq, dkn, db, rows, 0, PREC)
    pk, pq, dkn, db = _score_grads_tile(dA, dAqk, bv, kv, qs, kn, _from_tile(G, r1, rows, 16), pk, pq, dkn, db,
                                        rows, 1, PREC)
    pk, pq, dkn, db = _score_grads_tile(dA, dAqk, bv, kv, qs, kn, _from_tile(G, r2, rows, 32), pk, pq, dkn, db,
                                        rows, 2, PREC)
    pk, pq, dkn, db = _score_grads_tile(dA, dAqk, bv, kv, qs, kn, _from_tile(G, r3, rows, 48), pk, pq, dkn, db,
                                        rows, 3, PREC)

    kend_f = tl.exp(GC[None, :] - G)
    dkk = pk + dkn * E + dkg * eG + dkend * kend_f
    dqs = pq + dqg * eG
    dG = (pk * kv + pq * qs - dkn * kn + dkg * kg + dqg * qs * eG - dkend * kv * kend_f)
    dGC = tl.sum(dkend * kv * kend_f, axis=0) + dgc * tl.exp(GC)
    dg = tl.cumsum(dG, axis=0, reverse=True) + dGC[None, :]

    if GATE_IN_KERNEL:
        ds = dg * lower_bound * sig * (1.0 - sig)
        ds = tl.where(m2, ds, 0.0)
        rate = tl.exp(tl.load(A_log + h).to(tl.float32))
        tl.store(dgz + offk, (ds * rate).to(dgz.dtype.element_ty), mask=m2)
        tl.store(ddtb_part + (c64 * H + h) * K + ck, tl.sum(ds * rate, axis=0))
        tl.store(dA_part + c64 * H + h, tl.sum(tl.sum(ds * s, axis=1), axis=0))
    else:
        tl.store(dgz + offk, dg.to(dgz.dtype.element_ty), mask=m2)

    if BETA_SIGMOID:
        db = db * bv * (1.0 - bv)
    tl.store(dbeta + (bos + rows) * H + h, db.to(dbeta.dtype.element_ty), mask=valid)

    dqn = dqs * scale
    if L2NORM:
        dqn = (dqn - qv * tl.sum(dqn * qv, axis=1)[:, None]) * rq[:, None]
        dkk = (dkk - kv * tl.sum(dkk * kv, axis=1)[:, None]) * rk[:, None]
    tl.store(dq + offk, dqn.to(dq.dtype.element_ty), mask=m2)
    tl.store(dk + offk, dkk.to(dk.dtype.element_ty), mask=m2)
