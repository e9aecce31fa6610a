r"""Triton kernels for chunked KDA (docs/design.md §2.6), forward and backward.

Per head, per chunk of C = 64 tokens entered with state S (K x V), with G the in-chunk cumulative
log-decay, Gamma = exp(G), b = beta and q pre-scaled by ``scale``:

    R   = StrictTril((K Gamma)(K / Gamma)^T)          decayed key-key scores
    Aqk = Tril((Q Gamma)(K / Gamma)^T)                 decayed query-key scores
    X   = (I + Diag(b) R)^-1,   T = X Diag(b)          the UT transform
    W   = T (Gamma K),   U = T V
    Delta = U - W S,   O = (Gamma Q) S + Aqk Delta,   S' = Diag(Gamma_C) S + (Gamma_C / Gamma K)^T Delta

Kernels (one launch each):
- ``_row_norms_kernel`` per (chunk, head): 1 / |q| and 1 / |k| of every row (kept for the backward).
- ``_prep_blocked_kernel`` per (chunk, head, key block): raw q/k/gate -> gate, cumsum G (kept in
                      log2 units for the score kernels), Gamma Q, Gamma K, Gamma_C / Gamma K, Gamma_C.
- ``_prep_scores_kernel`` per (chunk, head, 16x16 tile pair i >= j): R_ij and Aqk_ij over all K.
- ``_ut_inverse_kernel`` per (chunk, head): X from Diag(b) R by 16x16 blocks.
- ``_wu_kernel``      per (chunk, head): W and U from X, beta, Gamma K and V.
- ``_state_fwd_kernel`` serial over the chunks of one segment: Delta, O, next state. With
                      ``TRANSITION`` it also carries K identity columns with zero values, which end as
                      the segment's transition M (S_end = M S_start + S~). In the backward it keeps
                      every chunk's state and Delta for the gradient kernels.
- ``_state_bwd_kernel``: the same, reversed, for dS (the transition is M^T).
(The composition of segments, S_{j+1} = M_j S_j + S~_j, is a few batched matmuls in kernels/kda.py.)
- ``_bwd_vside_kernel`` per (chunk, head, role): the gradients that contract over V, from each
                      chunk's entering state, the state gradient after it and dDelta.
- ``_bwd_kside_chunk_kernel`` per (chunk, head), ``_bwd_kside_tile_kernel`` per (chunk, head, 16-row
                      tile, key block), ``_bwd_kside_gate_kernel`` per (chunk, head, key block): the
                      key side (UT backward; score-tile products; cumsum, gate, L2-norm and beta).
Work that needs all 64 rows of a chunk at once (cumsums, the UT transform) stays in per-chunk
programs; the score products run one 16-row tile per program, so few registers and many programs
per SM hide the latency of the small products (docs/performance.md §4.3). Grids are 1-D with the
programs of one chunk adjacent (``_program_split``), so the rows they share come from L2.

The bounded gate is what makes the score matrices one dense matmul per 16-token tile: for key tile
b we factor exp(G_i - G_j) = exp(G_i - rho_b) * exp(rho_b - G_j), rho_b the log-decay at the tile's
start. The second factor is at most exp(16 |g_min|) = e^80 (finite in fp32 and bf16), the first at
most 1 (rows i before tile b are masked), so every tile pair, diagonal ones included, is one dense
product with no position-pair special case.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

TILE = tl.constexpr(16)
NORM_EPS = tl.constexpr(1e-6)
LOG2E = tl.constexpr(1.4426950408889634)  # G in log2 units: exp(G) = exp2(G log2(e)), one instruction
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")  # Triton's CPU interpreter


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) with a fast division (2 ulp): tl.sigmoid's IEEE division was a fifth of the
    prep's instructions. The CPU interpreter has no fast division, so it divides exactly."""
    e = 1.0 + tl.exp2(-x * LOG2E)
    if INTERPRETED:
        return 1.0 / e
    else:
        return libdevice.fast_dividef(1.0, e)


@triton.jit
def _gate(zv, A_log, dt_bias, h, cols, lower_bound, K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
          HAS_DT_BIAS: tl.constexpr):
    """Log-decay g = lower_bound * sigmoid(exp(A_log) (z + dt_bias)), with the logit s and sigmoid for backward."""
    if GATE_IN_KERNEL:
        rate = tl.exp(tl.load(A_log + h).to(tl.float32))
        if HAS_DT_BIAS:
            zv = zv + tl.load(dt_bias + h * K + cols).to(tl.float32)[None, :]
        s = rate * zv
        sig = tl.minimum(tl.maximum(_sigmoid(s), 1.1754944e-38), 0.99999994)
        g = lower_bound * sig
    else:
        s = zv
        sig = zv
        g = zv
    return g, s, sig


@triton.jit
def _program_split(R: tl.constexpr, H):
    """(chunk, head, part) of a 1-D grid over chunks x heads x R parts, the part fastest, then the
    head: the programs of one chunk run together, so the rows they share come from L2 (on (chunk,
    head, part) grids they were a whole grid plane apart and came from DRAM each time: 9.30 ->
    8.44 ms forward+backward at B=8,T=4K; docs/performance.md §4.8), and neighbouring heads share DRAM
    pages."""
    pid = tl.program_id(0)
    part = pid % R
    ch = pid // R
    return ch // H, ch % H, part


@triton.jit
def _chunk_rows(chunk_bos, chunk_eos, c, BT: tl.constexpr):
    """First token, end of the sequence, row indices and the valid-row mask of chunk ``c``."""
    bos = tl.load(chunk_bos + c).to(tl.int64)
    eos = tl.load(chunk_eos + c).to(tl.int64)
    rows = tl.arange(0, BT)
    valid = (bos + rows) < eos
    return bos, eos, rows, valid


@triton.jit
def _chunk_beta(beta, bos, rows, valid, h, H, BETA_SIGMOID: tl.constexpr):
    """b of the chunk's rows (the sigmoid of the raw logits with BETA_SIGMOID), 0 on rows past the end."""
    bv = tl.load(beta + bos * H + h + rows * H, mask=valid, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        bv = tl.sigmoid(bv)
    return tl.where(valid, bv, 0.0)


@triton.jit
def _tile_block(ptr, tok, trow, cols, n, H: tl.constexpr, K: tl.constexpr):
    """Rows ``trow`` (0 at and past the chunk's ``n`` rows) and columns ``cols`` of a [T, H, K] tensor."""
    return tl.load(ptr + tok + trow[:, None] * (H * K) + cols[None, :], mask=(trow < n)[:, None], other=0.0)


@triton.jit
def _tile_keys(q, k, beta, gcum, rnorm, bos, tok, trow, cols, n, h, H: tl.constexpr, K: tl.constexpr,
               BETA_SIGMOID: tl.constexpr):
    """G (log2 units), normalised q and k, and b of one 16-row tile, from ``gcum`` and ``rnorm``."""
    valid = trow < n
    nrm = rnorm + ((bos + trow) * H + h) * 2
    G = _tile_block(gcum, tok, trow, cols, n, H, K)
    qv = _tile_block(q, tok, trow, cols, n, H, K).to(tl.float32) * tl.load(nrm, mask=valid, other=0.0)[:, None]
    kv = _tile_block(k, tok, trow, cols, n, H, K).to(tl.float32) * tl.load(nrm + 1, mask=valid, other=0.0)[:, None]
    return G, qv, kv, _chunk_beta(beta, bos, trow, valid, h, H, BETA_SIGMOID)


@triton.jit
def _tile_start_at(gcum, tok, b, cols, H: tl.constexpr, K: tl.constexpr):
    """rho_b: G on the row before 16-token tile b (0 for b = 0), for one column block."""
    return tl.load(gcum + tok + (b * TILE - 1) * (H * K) + cols, mask=cols < K * tl.minimum(b, 1), other=0.0)


@triton.jit
def _keys_over_decay(k, gcum, rnorm, bos, tok, j, rho_j, cols, n, h, H: tl.constexpr, K: tl.constexpr):
    """K / Gamma of key tile j relative to its start rho_j: normalised k * exp(rho_j - G), <= e^80."""
    rows_j = j * TILE + tl.arange(0, TILE)
    kv = (_tile_block(k, tok, rows_j, cols, n, H, K).to(tl.float32)
          * tl.load(rnorm + ((bos + rows_j) * H + h) * 2 + 1, mask=rows_j < n, other=0.0)[:, None])
    return kv * tl.exp2(rho_j[None, :] - _tile_block(gcum, tok, rows_j, cols, n, H, K))


@triton.jit
def _decay_from(G, rho, b):
    """exp(G - rho_b) for rows at or after tile b's start (<= 1; tile 0 starts at G = 0, unclamped), G and
    rho in log2 units."""
    d = G - rho[None, :]
    return tl.exp2(tl.where(b > 0, tl.minimum(d, 0.0), d))


@triton.jit
def _to_tf32(x, ROUND: tl.constexpr):
    """x rounded to tf32 (10 mantissa bits, half away from zero) when ROUND, else x unchanged. A
    rounded value goes through a tf32 tensor-core product unchanged, so the same product can be
    formed twice, in two orders, with equal terms."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _state_halves(b, OPD: tl.constexpr, SPLIT: tl.constexpr):
    """An fp32 state-side operand (a state, a state gradient, Delta) for the state-pass products: b as
    OPD, or with SPLIT as two bf16 halves b = hi + lo that keep 16 of its mantissa bits (tf32: 10)
    in products at the bf16 rate. Without SPLIT the second half is the first (unused)."""
    hi = b.to(OPD)
    if SPLIT:
        lo = (b - hi.to(tl.float32)).to(OPD)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _dot_halves(a, hi, lo, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr):
    """a @ (hi + lo) from _state_halves."""
    if SPLIT:
        return tl.dot(a, lo, tl.dot(a, hi))
    else:
        return tl.dot(a, hi, input_precision=DOT_PREC)


@triton.jit
def _unit_lower_inverse_tile(N, PREC: tl.constexpr):
    """(I + N)^-1 of a strictly lower 16x16 tile: N^16 = 0, so it is sum_k (-N)^k =
    (I - N)(I + N^2)(I + N^4)(I + N^8), seven small products and no row-by-row reductions (19%
    less prep time on an H200 than forward substitution). With unit keys |N_ij| <= 1, so powers
    stay below C(15, 7) = 6435: fp32 loses ~3e-4 in the worst case (one key repeated, no decay;
    tested), ~1e-6 on random keys."""
    r = tl.arange(0, TILE)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    N2 = tl.dot(N, N, input_precision=PREC)
    N4 = tl.dot(N2, N2, input_precision=PREC)
    N8 = tl.dot(N4, N4, input_precision=PREC)
    X = tl.dot(eye - N, eye + N2, input_precision=PREC)
    X = tl.dot(X, eye + N4, input_precision=PREC)
    return tl.dot(X, eye + N8, input_precision=PREC)


# ----------------------------------------------------------------------------- forward, parallel part
@triton.jit
def _block(ptr, base, a: tl.constexpr, b: tl.constexpr, BT: tl.constexpr):
    """Pointers to block (a, b) of a [BT, BT] matrix at ``base``."""
    r = tl.arange(0, TILE)
    return ptr + base + (a * TILE + r[:, None]) * BT + b * TILE + r[None, :]


@triton.jit
def _row_norms(x, bos, eos, h, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr):
    """1 / |x| per row of one chunk, accumulated over key blocks."""
    rows = bos + tl.arange(0, BT)
    acc = tl.zeros([BT], dtype=tl.float32)
    for kb in tl.static_range(K // BK):
        offs = (rows[:, None] * H + h) * K + kb * BK + tl.arange(0, BK)[None, :]
        xv = tl.load(x + offs, mask=(rows < eos)[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(xv * xv, axis=1)
    return 1.0 / tl.sqrt(acc + NORM_EPS)


@triton.jit
def _ut_inverse_kernel(x, H, BT: tl.constexpr, INV_PREC: tl.constexpr):
    """X = (I + A)^-1 in place for one chunk's strictly lower A, by 16x16 blocks: X_aa = (I + A_aa)^-1
    as a product of powers, X_ab = -X_aa sum_{b<=c<a} A_ac X_cb, all exact fp32 products. A kernel of
    its own, apart from the prep: a chain of small dependent products that needs few registers, so
    many chunks share an SM and hide each other's latency."""
    c, h, _ = _program_split(1, H)
    xbase = (c.to(tl.int64) * H + h) * BT * BT
    X00 = _unit_lower_inverse_tile(tl.load(_block(x, xbase, 0, 0, BT)), INV_PREC)
    X11 = _unit_lower_inverse_tile(tl.load(_block(x, xbase, 1, 1, BT)), INV_PREC)
    X22 = _unit_lower_inverse_tile(tl.load(_block(x, xbase, 2, 2, BT)), INV_PREC)
    X33 = _unit_lower_inverse_tile(tl.load(_block(x, xbase, 3, 3, BT)), INV_PREC)
    M10 = tl.load(_block(x, xbase, 1, 0, BT))
    M21 = tl.load(_block(x, xbase, 2, 1, BT))
    M32 = tl.load(_block(x, xbase, 3, 2, BT))
    X10 = -tl.dot(X11, tl.dot(M10, X00, input_precision=INV_PREC), input_precision=INV_PREC)
    X21 = -tl.dot(X22, tl.dot(M21, X11, input_precision=INV_PREC), input_precision=INV_PREC)
    X32 = -tl.dot(X33, tl.dot(M32, X22, input_precision=INV_PREC), input_precision=INV_PREC)
    M20 = tl.load(_block(x, xbase, 2, 0, BT))
    X20 = -tl.dot(X22, tl.dot(M20, X00, input_precision=INV_PREC) + tl.dot(M21, X10, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    M31 = tl.load(_block(x, xbase, 3, 1, BT))
    X31 = -tl.dot(X33, tl.dot(M31, X11, input_precision=INV_PREC) + tl.dot(M32, X21, input_precision=INV_PREC),
                  input_precision=INV_PREC)
    M30 = tl.load(_block(x, xbase, 3, 0, BT))
    X30 = -tl.dot(X33, tl.dot(M30, X00, input_precision=INV_PREC) + tl.dot(M31, X10, input_precision=INV_PREC)
                  + tl.dot(M32, X20, input_precision=INV_PREC), input_precision=INV_PREC)
    tl.debug_barrier()  # every block of A is read before X overwrites it
    tl.store(_block(x, xbase, 0, 0, BT), X00)
    tl.store(_block(x, xbase, 1, 0, BT), X10)
    tl.store(_block(x, xbase, 1, 1, BT), X11)
    tl.store(_block(x, xbase, 2, 0, BT), X20)
    tl.store(_block(x, xbase, 2, 1, BT), X21)
    tl.store(_block(x, xbase, 2, 2, BT), X22)
    tl.store(_block(x, xbase, 3, 0, BT), X30)
    tl.store(_block(x, xbase, 3, 1, BT), X31)
    tl.store(_block(x, xbase, 3, 2, BT), X32)
    tl.store(_block(x, xbase, 3, 3, BT), X33)


@triton.jit
def _row_norms_kernel(q, k, chunk_bos, chunk_eos, rnorm, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                      L2NORM: tl.constexpr):
    """Per (chunk, head): 1 / |q| and 1 / |k| of every row into ``rnorm`` [T, H, 2] (ones without
    L2NORM). Its own kernel so that the elementwise prep can run one program per key block; the
    forward keeps ``rnorm`` (8 bytes a row) for the backward."""
    c, h, _ = _program_split(1, H)
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    if L2NORM:
        rq = _row_norms(q, bos, eos, h, H, K, BK, BT)
        rk = _row_norms(k, bos, eos, h, H, K, BK, BT)
    else:
        rq = tl.full([BT], 1.0, tl.float32)
        rk = tl.full([BT], 1.0, tl.float32)
    nrm = rnorm + ((bos + rows) * H + h) * 2
    tl.store(nrm, rq, mask=valid)
    tl.store(nrm + 1, rk, mask=valid)


@triton.jit
def _prep_blocked_kernel(q, k, gz, A_log, dt_bias, chunk_bos, chunk_eos, rnorm,
                         kg_out, qg_out, kend_out, gc_out, gcum,
                         scale, lower_bound, H,
                         K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                         GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """Per (chunk, head, block of BK key columns): the gate, its cumsum G (log2 units, into ``gcum``
    for the score kernels), Gamma Q, Gamma K, Gamma_C / Gamma K and Gamma_C, with the row norms from
    ``rnorm``. Every output is separable over key columns, so a program holds one [BT, BK] block."""
    c, h, kb = _program_split(K // BK, H)
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    m2 = valid[:, None]
    nrm = rnorm + ((bos + rows) * H + h) * 2
    rq = tl.load(nrm, mask=valid, other=0.0)
    rk = tl.load(nrm + 1, mask=valid, other=0.0)
    cols = kb * BK + tl.arange(0, BK)
    offs = ((bos + rows)[:, None] * H + h) * K + cols[None, :]
    qv = tl.load(q + offs, mask=m2, other=0.0).to(tl.float32) * (rq * scale)[:, None]
    kv = tl.load(k + offs, mask=m2, other=0.0).to(tl.float32) * rk[:, None]
    zv = tl.load(gz + offs, mask=m2, other=0.0).to(tl.float32)
    g, _, _ = _gate(zv, A_log, dt_bias, h, cols, lower_bound, K, GATE_IN_KERNEL, HAS_DT_BIAS)
    G = tl.cumsum(tl.where(m2, g, 0.0), axis=0) * LOG2E
    tl.store(gcum + offs, G, mask=m2)
    eG = tl.exp2(G)
    GC = tl.sum(tl.where(rows[:, None] == BT - 1, G, 0.0), axis=0)
    tl.store(qg_out + offs, (qv * eG).to(qg_out.dtype.element_ty), mask=m2)
    tl.store(kg_out + offs, (kv * eG).to(kg_out.dtype.element_ty), mask=m2)
    tl.store(kend_out + offs, (kv * tl.exp2(GC[None, :] - G)).to(kend_out.dtype.element_ty), mask=m2)
    tl.store(gc_out + (c.to(tl.int64) * H + h) * K + cols, tl.exp2(GC))


@triton.jit
def _prep_scores_kernel(q, k, beta, chunk_bos, chunk_eos, gcum, rnorm, aqk_out, a_out, scale, H: tl.constexpr,
                        K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                        DOT_PREC: tl.constexpr):
    """One 16x16 tile pair (i >= j) of a chunk's scores, summed over the key dimension: Aqk_ij and
    A_ij = Diag(b_i) R_ij into ``a_out`` (where _ut_inverse_kernel turns A into X). Ten pairs per
    chunk, one program each (the program of a diagonal pair also zeroes the blocks right of it).

    For key tile j, exp(G_r - G_s) = exp(G_r - rho_j) exp(rho_j - G_s): the first factor is at most
    1, the second at most exp(16 |g_min|) = e^80, finite in fp32 (the bounded gate), so every pair,
    diagonal ones included, is one dense product.
    """
    c, h, p = _program_split(10, H)
    i = (p >= 1).to(tl.int32) + (p >= 3).to(tl.int32) + (p >= 6).to(tl.int32)
    j = p - i * (i + 1) // 2
    bos = tl.load(chunk_bos + c).to(tl.int64)
    n = tl.load(chunk_eos + c).to(tl.int64) - bos
    r = tl.arange(0, TILE)
    rows_i = i * TILE + r
    rows_j = j * TILE + r
    tok = (bos * H + h) * K
    R = tl.zeros([TILE, TILE], dtype=tl.float32)
    Aqk = tl.zeros([TILE, TILE], dtype=tl.float32)
    if i * TILE < n:  # a tile past the end keeps zeros (X must stay finite there); rho_j is then in range
        for kb in tl.static_range(K // BK):
            cols = kb * BK + tl.arange(0, BK)
            G_i, qv_i, kv_i, _ = _tile_keys(q, k, beta, gcum, rnorm, bos, tok, rows_i, cols, n, h, H, K, False)
            rho_j = _tile_start_at(gcum, tok, j, cols, H, K)
            kn_j = tl.trans(_keys_over_decay(k, gcum, rnorm, bos, tok, j, rho_j, cols, n, h, H, K))
            f = _decay_from(G_i, rho_j, j)
            R = tl.dot(kv_i * f, kn_j, R, input_precision=DOT_PREC)
            Aqk = tl.dot(qv_i * scale * f, kn_j, Aqk, input_precision=DOT_PREC)
    R = tl.where((i > j) | (r[:, None] > r[None, :]), R, 0.0)
    Aqk = tl.where((i > j) | (r[:, None] >= r[None, :]), Aqk, 0.0)
    valid = rows_i < n
    b = _chunk_beta(beta, bos, rows_i, valid, h, H, BETA_SIGMOID)
    abase = a_out + (c.to(tl.int64) * H + h) * BT * BT + rows_i[:, None] * BT
    aqk_rows = aqk_out + ((bos + rows_i) * H + h)[:, None] * BT
    tl.store(abase + rows_j[None, :], R * b[:, None])
    tl.store(aqk_rows + rows_j[None, :], Aqk.to(aqk_out.dtype.element_ty), mask=valid[:, None])
    if i == j:
        zero = tl.zeros([TILE, TILE], dtype=tl.float32)
        for j2 in tl.static_range(1, BT // TILE):
            cols_j2 = r + j2 * TILE
            right = (cols_j2 >= (i + 1) * TILE)[None, :]  # blocks right of the diagonal
            tl.store(abase + cols_j2[None, :], zero, mask=right)
            tl.store(aqk_rows + cols_j2[None, :], zero.to(aqk_out.dtype.element_ty), mask=right & valid[:, None])


@triton.jit
def _wu_kernel(v, beta, x, chunk_bos, chunk_eos, w, u, H,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               BETA_SIGMOID: tl.constexpr, DOT_PREC: tl.constexpr):
    """W = T (Gamma K) and U = T V for one chunk, T = X Diag(b), in column blocks of BC.

    ``w`` holds Gamma K on entry and W on exit (each program reads its rows before writing them).
    """
    c, h, _ = _program_split(1, H)
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    m2 = valid[:, None]
    X = tl.load(x + ((c.to(tl.int64) * H + h) * BT + rows[:, None]) * BT + rows[None, :])
    T = X * _chunk_beta(beta, bos, rows, valid, h, H, BETA_SIGMOID)[None, :]
    cols = tl.arange(0, BC)
    for cb in tl.static_range(K // BC):
        offs = ((bos + rows)[:, None] * H + h) * K + cb * BC + cols[None, :]
        kg = tl.load(w + offs, mask=m2, other=0.0).to(tl.float32)
        tl.store(w + offs, tl.dot(T, kg, input_precision=DOT_PREC).to(w.dtype.element_ty), mask=m2)
    for cb in tl.static_range(V // BC):
        offs = ((bos + rows)[:, None] * H + h) * V + cb * BC + cols[None, :]
        vv = tl.load(v + offs, mask=m2, other=0.0).to(tl.float32)
        tl.store(u + offs, tl.dot(T, vv, input_precision=DOT_PREC).to(u.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------- forward, state pass
@triton.jit
def _state_fwd_kernel(w, u, qg, kend, aqk, gc, o, states, delta, seg_init, seg_end,
                      seg_chunk0, seg_nchunks, seg_bos, seg_eos, seg_order, H,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      V_END: tl.constexpr, HAS_INIT: tl.constexpr, TRANSITION: tl.constexpr,
                      STORE_OUTPUT: tl.constexpr, STORE_STATES: tl.constexpr, DOT_PREC: tl.constexpr,
                      OPD: tl.constexpr, SPLIT: tl.constexpr):
    """One program: columns [pv*BV, pv*BV+BV) of one segment's state for one head, chunk by chunk.

    Column blocks past V (only with TRANSITION) carry identity columns with zero values: they end
    as the transition M of the segment. ``seg_end`` has V_END = V (+ K with TRANSITION) columns.
    The state is fp32; its products take it (and their other operands) as OPD (SPLIT: see
    _dot_state). With STORE_STATES
    (the backward's pass) each chunk's state and its corrected values Delta = U - W S are kept.
    """
    pv = tl.program_id(0)
    sh = tl.program_id(1)
    seg = tl.load(seg_order + sh // H)  # longest segments first (see kda.build_plan)
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
        Wt = tl.load(w + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
        Ut = tl.load(u + (rows[:, None] * H + h) * V + col[None, :], mask=m2 & is_value, other=0.0)
        Sh, Sl = _state_halves(S, OPD, SPLIT)
        D = Ut.to(tl.float32) - _dot_halves(Wt, Sh, Sl, SPLIT, DOT_PREC)
        if STORE_STATES:
            tl.store(delta + (rows[:, None] * H + h) * V + col[None, :], D.to(delta.dtype.element_ty), mask=m2)
        Dh, Dl = _state_halves(D, OPD, SPLIT)
        if STORE_OUTPUT:
            Qt = tl.load(qg + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
            At = tl.load(aqk + (rows[:, None] * H + h) * BT + cb[None, :], mask=m2, other=0.0).to(OPD)
            Ot = _dot_halves(Qt, Sh, Sl, SPLIT, DOT_PREC) + _dot_halves(At, Dh, Dl, SPLIT, DOT_PREC)
            tl.store(o + (rows[:, None] * H + h) * V + col[None, :], Ot.to(o.dtype.element_ty), mask=m2)
        Kt = tl.load(kend + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
        gct = tl.load(gc + (c * H + h) * K + rk)
        S = S * gct[:, None] + _dot_halves(tl.trans(Kt), Dh, Dl, SPLIT, DOT_PREC)
    tl.store(seg_end + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V_END + (pv * BV + cv)[None, :], S)


# ----------------------------------------------------------------------------- backward, state pass
@triton.jit
def _state_bwd_kernel(qg, w, kend, aqk, gc, do, dh, ddelta, seg_init, seg_start_grad,
                      seg_chunk0, seg_nchunks, seg_bos, seg_eos, seg_order, H,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE: tl.constexpr, DOT_PREC: tl.constexpr,
                      OPD: tl.constexpr, SPLIT: tl.constexpr):
    """Reverse pass over one segment: dS (gradient of the state after a chunk), chunk by chunk.

    dDelta = Aqk^T dO + Kend dS;  dS_before = Diag(Gamma_C) dS + Qg^T dO - W^T dDelta.
    With STORE it writes dS after every chunk (``dh``) and dDelta; at the end dS at the segment start.
    Products take dS, dDelta and their other operands as OPD (SPLIT: see _dot_state).
    """
    pv = tl.program_id(0)
    sh = tl.program_id(1)
    seg = tl.load(seg_order + sh // H)  # longest segments first (see kda.build_plan)
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
        At = tl.load(aqk + (rows[:, None] * H + h) * BT + cb[None, :], mask=m2, other=0.0).to(OPD)
        Kt = tl.load(kend + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
        dOt = tl.load(do + (rows[:, None] * H + h) * V + col[None, :], mask=m2, other=0.0).to(OPD)
        dSh, dSl = _state_halves(dS, OPD, SPLIT)
        dD = tl.dot(tl.trans(At), dOt, input_precision=DOT_PREC) + _dot_halves(Kt, dSh, dSl, SPLIT, DOT_PREC)
        if STORE:
            tl.store(ddelta + (rows[:, None] * H + h) * V + col[None, :], dD.to(ddelta.dtype.element_ty), mask=m2)
        dDh, dDl = _state_halves(dD, OPD, SPLIT)
        Qt = tl.load(qg + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
        Wt = tl.load(w + (rows[:, None] * H + h) * K + rk[None, :], mask=m2, other=0.0).to(OPD)
        gct = tl.load(gc + (c * H + h) * K + rk)
        dS = (dS * gct[:, None] + tl.dot(tl.trans(Qt), dOt, input_precision=DOT_PREC)
              - _dot_halves(tl.trans(Wt), dDh, dDl, SPLIT, DOT_PREC))
    tl.store(seg_start_grad + ((seg.to(tl.int64) * H + h) * K + rk[:, None]) * V + col[None, :], dS)


@triton.jit
def _bwd_vside_kernel(v, beta, chunk_bos, chunk_eos, x_in, delta, states, dh, ddelta, do,
                      dv, dqg_out, dw_out, dkend_out, daqk_out, dt_out, dgc_out, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                      BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, ROUND_DAQK: tl.constexpr):
    """The gradients that contract over V, V in blocks of BV; 2 K/BK + 2 roles per (chunk, head).

    Per key block of BK columns: dQg = dO S^T and dW = -dDelta S^T (roles [0, NKB)); dKend = Delta
    dS^T and dGamma_C = rowsum(S * dS) (roles [NKB, 2 NKB)), with Delta = U - W S as the backward's
    state pass kept it. Role 2 NKB: dAqk = dO Delta^T (rounded to tf32 with ROUND_DAQK: the key side
    reads it in both orientations, see _bwd_kside_tile_kernel). Last role: dV = T^T dDelta and dT = dDelta
    V^T (no state; T = X Diag(b)). Key blocks keep each program's accumulators and state slabs small
    (the whole [64, K] in one program spilled at d=128); the programs of one chunk run together and
    re-read dO, Delta and dDelta from L2.
    """
    NKB: tl.constexpr = K // BK
    c, h, role = _program_split(2 * NKB + 2, H)
    c64 = c.to(tl.int64)
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    m2 = valid[:, None]
    cb = tl.arange(0, BT)
    tok_k = (bos * H + h) * K  # row 0 of the chunk in [T, H, K] tensors
    tok_v = (bos * H + h) * V
    st = (c64 * H + h) * K * V  # this chunk's [K, V] state
    sq = (c64 * H + h) * BT * BT
    ck = (role % NKB) * BK + tl.arange(0, BK)
    if role < NKB:
        dqg = tl.zeros([BT, BK], dtype=tl.float32)
        dW = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in tl.static_range(0, V // BV):
            cvb = vb * BV + tl.arange(0, BV)
            S = tl.load(states + st + ck[:, None] * V + cvb[None, :])
            dOt = tl.load(do + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dD = tl.load(ddelta + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dqg += tl.dot(dOt.to(S.dtype), tl.trans(S), input_precision=PREC)
            dW -= tl.dot(dD.to(S.dtype), tl.trans(S), input_precision=PREC)
        tl.store(dqg_out + tok_k + rows[:, None] * (H * K) + ck[None, :], dqg, mask=m2)
        tl.store(dw_out + tok_k + rows[:, None] * (H * K) + ck[None, :], dW, mask=m2)
    elif role < 2 * NKB:
        dkend = tl.zeros([BT, BK], dtype=tl.float32)
        dgc = tl.zeros([BK], dtype=tl.float32)
        for vb in tl.static_range(0, V // BV):
            cvb = vb * BV + tl.arange(0, BV)
            S = tl.load(states + st + ck[:, None] * V + cvb[None, :])
            dH = tl.load(dh + st + ck[:, None] * V + cvb[None, :])
            D = tl.load(delta + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dgc += tl.sum(S.to(tl.float32) * dH.to(tl.float32), axis=1)
            dkend += tl.dot(D.to(dH.dtype), tl.trans(dH), input_precision=PREC)
        tl.store(dkend_out + tok_k + rows[:, None] * (H * K) + ck[None, :], dkend, mask=m2)
        tl.store(dgc_out + (c64 * H + h) * K + ck, dgc)
    elif role == 2 * NKB:
        dAqk = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in tl.static_range(0, V // BV):
            cvb = vb * BV + tl.arange(0, BV)
            D = tl.load(delta + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dOt = tl.load(do + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dAqk += tl.dot(dOt, tl.trans(D), input_precision=PREC)
        tl.store(daqk_out + sq + rows[:, None] * BT + cb[None, :],
                 _to_tf32(tl.where(rows[:, None] >= cb[None, :], dAqk, 0.0), ROUND_DAQK))
    else:
        T = tl.load(x_in + sq + rows[:, None] * BT + cb[None, :]) * _chunk_beta(beta, bos, rows, valid, h, H,
                                                                                  BETA_SIGMOID)[None, :]
        dT = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in tl.static_range(0, V // BV):
            cvb = vb * BV + tl.arange(0, BV)
            vv = tl.load(v + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dD = tl.load(ddelta + tok_v + rows[:, None] * (H * V) + cvb[None, :], mask=m2, other=0.0).to(tl.float32)
            dT += tl.dot(dD, tl.trans(vv), input_precision=PREC)  # U = T V
            tl.store(dv + tok_v + rows[:, None] * (H * V) + cvb[None, :],
                     tl.dot(tl.trans(T), dD, input_precision=PREC).to(dv.dtype.element_ty), mask=m2)
        tl.store(dt_out + sq + rows[:, None] * BT + cb[None, :], dT)


# ----------------------------------------------------------------------------- backward, key side
# Three kernels: the work that spans a chunk's 64 rows (_bwd_kside_chunk_kernel), the score-tile
# products one 16-row tile at a time (_bwd_kside_tile_kernel), then the reverse cumsum with the
# gate, L2-norm and beta backward (_bwd_kside_gate_kernel). One fused program per chunk held every
# [64, BK] operand at once: 255 registers, 2 programs per SM, latency-bound (docs/performance.md §4.3).
@triton.jit
def _bwd_kside_chunk_kernel(k, beta, chunk_bos, chunk_eos, x_in, dw_in, dt_in, gcum, rnorm, db_part,
                            H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                            BETA_SIGMOID: tl.constexpr, PREC: tl.constexpr, SCORE_PREC: tl.constexpr):
    """Key side 1/3, per (chunk, head): dT += dW (Gamma K)^T (G and the row norms as the backward's prep
    left them in ``gcum`` / ``rnorm``), then the UT backward (T = X Diag(b), X = (I + Diag(b) R)^-1):
    its share of d b (``db_part`` slot 0), dA over dT in its scratch, and d(Gamma K) = T^T dW over
    dW in its scratch. At SCORE_PREC="tf32" dA is rounded to tf32 here, once (dAqk by the value
    side), because step 2 reads their slabs in both orientations (see _bwd_kside_tile_kernel)."""
    ROUND: tl.constexpr = SCORE_PREC == "tf32"
    c, h, _ = _program_split(1, H)
    c64 = c.to(tl.int64)
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    m2 = valid[:, None]
    cb = tl.arange(0, BT)
    tok = (bos * H + h) * K  # row 0 of the chunk in [T, H, K] tensors; + rows * H * K + column
    sq = (c64 * H + h) * BT * BT
    rk = tl.load(rnorm + ((bos + rows) * H + h) * 2 + 1, mask=valid, other=0.0)
    bv = _chunk_beta(beta, bos, rows, valid, h, H, BETA_SIGMOID)

    dT = tl.load(dt_in + sq + rows[:, None] * BT + cb[None, :])
    for kb in tl.range(0, K // BK):
        offs = rows[:, None] * (H * K) + (kb * BK + tl.arange(0, BK))[None, :]
        kg = (tl.load(k + tok + offs, mask=m2, other=0.0).to(tl.float32) * rk[:, None]
              * tl.exp2(tl.load(gcum + tok + offs, mask=m2, other=0.0)))
        dWb = tl.load(dw_in + tok + offs, mask=m2, other=0.0)
        dT += tl.dot(dWb, tl.trans(kg), input_precision=PREC)
    X = tl.load(x_in + sq + rows[:, None] * BT + cb[None, :])
    tl.store(db_part + (bos + rows) * H + h, tl.sum(dT * X, axis=0), mask=valid)  # over rows i: d b_j
    dA = -tl.dot(tl.dot(tl.trans(X), dT * bv[None, :], input_precision=PREC), tl.trans(X), input_precision=PREC)
    dA = tl.where(rows[:, None] > cb[None, :], dA, 0.0)
    T = X * bv[None, :]
    tl.debug_barrier()  # every thread has read dT before dA overwrites it
    tl.store(dt_in + sq + rows[:, None] * BT + cb[None, :], _to_tf32(dA, ROUND))
    for kb in tl.range(0, K // BK):
        offs = rows[:, None] * (H * K) + (kb * BK + tl.arange(0, BK))[None, :]
        dkg = tl.dot(tl.trans(T), tl.load(dw_in + tok + offs, mask=m2, other=0.0), input_precision=PREC)
        tl.debug_barrier()  # every thread has read this block of dW
        tl.store(dw_in + tok + offs, dkg, mask=m2)


@triton.jit
def _bwd_kside_tile_kernel(q, k, beta, chunk_bos, chunk_eos, gcum, rnorm, dqg_in, dw_in, dkend_in, daqk_in,
                           dt_in, dq, dk, db_part, row_part, esum_part, scale, NTOK, H: tl.constexpr,
                           K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
                           BETA_SIGMOID: tl.constexpr, SCORE_PREC: tl.constexpr):
    """Key side 2/3, per (chunk, head, 16-row tile i, column block): every column gradient of tile i's rows.

    Score products (R = StrictTril((K Gamma)(K / Gamma)^T), Aqk likewise with Q) by 16x16 tile pairs,
    with exp(G_r - G_s) = exp(G_r - rho_j) exp(rho_j - G_s) for key tile j: as rows, tile i against
    key tiles j <= i; as keys, tile i against row tiles i2 >= i. The pair (i2, j) is formed once in
    each role, by two programs, from the same operands: at tf32 they are rounded (b K F, Q F and
    K / Gamma, F = exp(G - rho_j)) so both see equal terms and the pairs cancel in dG (left to the
    tensor cores, d dt_bias was 2-3e-2 from float64; docs/performance.md §4.5). Then the d(Gamma Q), d(Gamma K) and
    d(Gamma_C / Gamma K) terms, for dq, dk (unnormalised with L2NORM) and dG (over step 1's
    d(Gamma K) in the dW scratch); partial row sums per column block (d b, the L2-norm products) and
    the column sum of the Gamma_C term per tile go to small buffers for step 3.
    """
    ROUND: tl.constexpr = SCORE_PREC == "tf32"
    NKB: tl.constexpr = K // BK
    c, h, t = _program_split((BT // TILE) * NKB, H)
    i = t // NKB
    kb = t % NKB
    c64 = c.to(tl.int64)
    bos = tl.load(chunk_bos + c).to(tl.int64)
    n = tl.load(chunk_eos + c).to(tl.int64) - bos
    if i * TILE >= n:
        return
    r = tl.arange(0, TILE)
    cols = kb * BK + tl.arange(0, BK)
    tok = (bos * H + h) * K
    sq = (c64 * H + h) * BT * BT
    rows_i = i * TILE + r
    G_i, qv_i, kv_i, b_i = _tile_keys(q, k, beta, gcum, rnorm, bos, tok, rows_i, cols, n, h, H, K, BETA_SIGMOID)
    qs_i = qv_i * scale
    kf_i = kv_i * b_i[:, None]

    # Tile i as rows against key tiles j <= i.
    pr = tl.zeros([TILE, BK], dtype=tl.float32)  # sum_j F (dA K/Gamma): d b and the row part of dk
    pq = tl.zeros([TILE, BK], dtype=tl.float32)
    drow = tl.zeros([TILE, BK], dtype=tl.float32)
    for j in range(0, i + 1):
        rows_j = j * TILE + r
        rho_j = _tile_start_at(gcum, tok, j, cols, H, K)
        kn_j = _to_tf32(_keys_over_decay(k, gcum, rnorm, bos, tok, j, rho_j, cols, n, h, H, K), ROUND)
        f = _decay_from(G_i, rho_j, j)
        u = tl.dot(tl.load(dt_in + sq + rows_i[:, None] * BT + rows_j[None, :]), kn_j, input_precision=SCORE_PREC)
        u2 = tl.dot(tl.load(daqk_in + sq + rows_i[:, None] * BT + rows_j[None, :]), kn_j,
                    input_precision=SCORE_PREC)
        pr += f * u
        pq += f * u2
        drow += _to_tf32(kf_i * f, ROUND) * u + _to_tf32(qs_i * f, ROUND) * u2

    # Tile i as keys against row tiles i2 >= i: d(K / Gamma) of its rows.
    rho_i = _tile_start_at(gcum, tok, i, cols, H, K)
    dkn = tl.zeros([TILE, BK], dtype=tl.float32)
    for i2 in range(i, tl.cdiv(n, TILE)):
        rows2 = i2 * TILE + r
        G2, qv2, kv2, b2 = _tile_keys(q, k, beta, gcum, rnorm, bos, tok, rows2, cols, n, h, H, K, BETA_SIGMOID)
        f2 = _decay_from(G2, rho_i, i)
        kff2 = _to_tf32(kv2 * b2[:, None] * f2, ROUND)
        qff2 = _to_tf32(qv2 * scale * f2, ROUND)
        dkn += tl.dot(tl.load(dt_in + sq + rows2[None, :] * BT + rows_i[:, None]), kff2, input_precision=SCORE_PREC)
        dkn += tl.dot(tl.load(daqk_in + sq + rows2[None, :] * BT + rows_i[:, None]), qff2,
                      input_precision=SCORE_PREC)

    e_row = tl.exp2(rho_i[None, :] - G_i)
    kn = _to_tf32(kv_i * e_row, ROUND)  # the same bits as other programs' kn_j for this tile
    eG = tl.exp2(G_i)
    kend_f = tl.exp2(tl.load(gcum + tok + (n - 1) * (H * K) + cols)[None, :] - G_i)
    dkg = _tile_block(dw_in, tok, rows_i, cols, n, H, K)
    dqg = _tile_block(dqg_in, tok, rows_i, cols, n, H, K)
    dke = _tile_block(dkend_in, tok, rows_i, cols, n, H, K)
    dkk = pr * b_i[:, None] + dkn * e_row + dkg * eG + dke * kend_f
    dqn = (pq + dqg * eG) * scale
    # The score terms of dG as drow - kn * dkn: every (r, s) product appears once in each, with
    # equal operands, so the pairs cancel.
    dG = drow - kn * dkn + dkg * kv_i * eG + dqg * qs_i * eG - dke * kv_i * kend_f
    tl.store(esum_part + ((c64 * H + h) * (BT // TILE) + i) * K + cols, tl.sum(dke * kv_i * kend_f, axis=0))
    valid = rows_i < n
    offs = rows_i[:, None] * (H * K) + cols[None, :]
    tl.debug_barrier()  # every thread has read its d(Gamma K), dQg and dKend rows
    tl.store(dw_in + tok + offs, dG, mask=valid[:, None])
    ntok_h = NTOK.to(tl.int64) * H
    tok_row = (bos + rows_i) * H + h
    tl.store(db_part + (1 + kb) * ntok_h + tok_row, tl.sum(kv_i * pr, axis=1), mask=valid)
    if L2NORM:
        tl.store(dqg_in + tok + offs, dqn, mask=valid[:, None])
        tl.store(dkend_in + tok + offs, dkk, mask=valid[:, None])
        tl.store(row_part + kb * ntok_h + tok_row, tl.sum(dqn * qv_i, axis=1), mask=valid)
        tl.store(row_part + (NKB + kb) * ntok_h + tok_row, tl.sum(dkk * kv_i, axis=1), mask=valid)
    else:
        tl.store(dq + tok + offs, dqn.to(dq.dtype.element_ty), mask=valid[:, None])
        tl.store(dk + tok + offs, dkk.to(dk.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _bwd_kside_gate_kernel(q, k, gz, beta, A_log, dt_bias, chunk_bos, chunk_eos, gcum, rnorm, dqg_in, dw_in,
                           dkend_in, dgc_in, esum_part, db_part, row_part, dq, dk, dgz, dbeta, dA_part, ddtb_part,
                           lower_bound, NTOK, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           BT: tl.constexpr, TILE_BLOCKS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                           HAS_DT_BIAS: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Key side 3/3, per (chunk, head, column block): dg = reverse cumsum of dG plus dGamma_C's share,
    the gate backward (dz, and per-chunk A_log / dt_bias partials), the L2-norm backward d x = (d xn
    - xn sum(d xn * xn)) / |x| from step 2's row-sum partials, and (block 0) d beta."""
    c, h, kb = _program_split(K // BK, H)
    c64 = c.to(tl.int64)
    ch = c64 * H + h
    bos, eos, rows, valid = _chunk_rows(chunk_bos, chunk_eos, c, BT)
    n = eos - bos
    m2 = valid[:, None]
    cols = kb * BK + tl.arange(0, BK)
    tok = (bos * H + h) * K
    offs = rows[:, None] * (H * K) + cols[None, :]
    tiles = tl.arange(0, BT // TILE)
    esum = tl.sum(tl.load(esum_part + (ch * (BT // TILE) + tiles[:, None]) * K + cols[None, :],
                          mask=(tiles * TILE < n)[:, None], other=0.0), axis=0)
    GC = tl.load(gcum + tok + (n - 1) * (H * K) + cols)
    dGC = esum + tl.load(dgc_in + ch * K + cols) * tl.exp2(GC)
    dg = tl.cumsum(tl.load(dw_in + tok + offs, mask=m2, other=0.0), axis=0, reverse=True) + dGC[None, :]
    if GATE_IN_KERNEL:
        zv = tl.load(gz + tok + offs, mask=m2, other=0.0).to(tl.float32)
        _, s, sig = _gate(zv, A_log, dt_bias, h, cols, lower_bound, K, GATE_IN_KERNEL, HAS_DT_BIAS)
        rate = tl.exp(tl.load(A_log + h).to(tl.float32))
        ds = tl.where(m2, dg * lower_bound * sig * (1.0 - sig), 0.0)
        tl.store(dgz + tok + offs, (ds * rate).to(dgz.dtype.element_ty), mask=m2)
        tl.store(ddtb_part + ch * K + cols, tl.sum(ds * rate, axis=0))
        tl.store(dA_part + ch * (K // BK) + kb, tl.sum(tl.sum(ds * s, axis=1), axis=0))
    else:
        tl.store(dgz + tok + offs, dg.to(dgz.dtype.element_ty), mask=m2)
    ntok_h = NTOK.to(tl.int64) * H
    tok_row = (bos + rows) * H + h
    slots = tl.arange(0, TILE_BLOCKS)
    if L2NORM:
        part = row_part + slots[:, None] * ntok_h + tok_row[None, :]
        rowq = tl.sum(tl.load(part, mask=valid[None, :], other=0.0), axis=0)
        rowk = tl.sum(tl.load(part + TILE_BLOCKS * ntok_h, mask=valid[None, :], other=0.0), axis=0)
        nrm = rnorm + tok_row * 2
        rq = tl.load(nrm, mask=valid, other=0.0)
        rk = tl.load(nrm + 1, mask=valid, other=0.0)
        qv = tl.load(q + tok + offs, mask=m2, other=0.0).to(tl.float32) * rq[:, None]
        kv = tl.load(k + tok + offs, mask=m2, other=0.0).to(tl.float32) * rk[:, None]
        dqn = tl.load(dqg_in + tok + offs, mask=m2, other=0.0)
        dkk = tl.load(dkend_in + tok + offs, mask=m2, other=0.0)
        tl.store(dq + tok + offs, ((dqn - qv * rowq[:, None]) * rq[:, None]).to(dq.dtype.element_ty), mask=m2)
        tl.store(dk + tok + offs, ((dkk - kv * rowk[:, None]) * rk[:, None]).to(dk.dtype.element_ty), mask=m2)
    if kb == 0:
        db = tl.load(db_part + tok_row, mask=valid, other=0.0) + tl.sum(
            tl.load(db_part + (1 + slots[:, None]) * ntok_h + tok_row[None, :], mask=valid[None, :], other=0.0), axis=0)
        if BETA_SIGMOID:
            bv = _chunk_beta(beta, bos, rows, valid, h, H, BETA_SIGMOID)
            db = db * bv * (1.0 - bv)
        tl.store(dbeta + tok_row, db.to(dbeta.dtype.element_ty), mask=valid)
