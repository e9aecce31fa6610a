"""Triton kernels of the AttnRes depth mixture; launched from depth_mixture.py.

    h = sum_i a_i v_i,   a = softmax_i(logit_i),   logit_i = r_i (w . v_i),   r_i = 1 / sqrt(mean(v_i^2) + eps)

with w = g * query (the norm's gain folded into the query on the host: (g v r) . q = r (g q) . v).

With NORM the kernels also apply the sublayer's pre-norm that reads the mixture (one fewer pass over
h each way, and h is never kept): y = gamma * h^ rho, h^ = h rounded to the output dtype (what an
RMSNorm reading a stored h would see), rho = 1 / sqrt(mean(h^2) + eps2), stored fp32 [N]. Backward,
for the output gradient Y: d gamma = sum over tokens of Y h^ rho, and the mixture's gradient
G = rho (gamma Y) - h^ rho^3 c / D with c = (gamma Y) . h^, never stored: h^ is recomputed from the
sources and a in each tile, so da_i = G . v_i = rho P_i - rho^3 (c / D) Q_i with P_i = (gamma Y) . v_i
and Q_i = h^ . v_i, all three accumulated in the first pass.

Layout: every source v_i, the mixture h, its gradient and the source gradients are contiguous
[N, D] rows (N tokens); the mixture weights a are fp32 [S, N], the inverse rms r_i and the logits
r_i (w . v_i) fp32 [2S, N] (r_out / r_in, rows i and S + i: the resident backward reads the logits
rather than summing w . v_i across the warps again). A program owns
ROWS consecutive rows and walks D in BLOCK_D tiles, so any width fits. Per-source per-row scalars
are tuples of S [ROWS] vectors (built and indexed at compile time, so they stay in registers in
the tiles' own layout). Math in fp32; loads and stores in each tensor's own dtype. Row offsets
are int64 (N * D can exceed 2^31).

The sources are one tuple argument of S pointers, not a device array of addresses: Triton
specialises every element of a tuple on its own element type and alignment, so an fp32 embedding
and bf16 block sums are loaded as they are (no cast, no stacked copy) with 16-byte vector loads,
and S is a compile-time length that ``tl.static_range`` unrolls. An int64 array of data pointers
would force one element type on all sources (or a per-source dtype code and a branch around
every load), lose the alignment the JIT proves for tensor arguments, and cost a host-to-device
copy of the addresses on every call. The price is one compilation per (S, source dtypes), and code
that grows with S, hence the maximum in depth_mixture.py.

Bandwidth: each pass reads every source twice and writes each output once (a row's statistics
are needed before any of it can be mixed); the second read is meant to come from L2. What has to
stay there is every row the GPU reads between a row's two reads: about programs x ROWS x the row's
bytes over all sources. So the programs stride over the row blocks and the host sizes the grid
from an L2 budget, instead of leaving the concurrency to the occupancy (at ~8 programs per SM,
the k3-small rows in flight would fill an H200's 50 MB L2 twice over). Both first passes go tile
by tile with the sources in an inner unrolled loop: S tiles in flight per program (the grid is
small, so each program must keep many bytes in flight), and the output gradient read once for
all sources. The price is one reduction per tile and source, within a warp when a warp spans a
tile's row (BLOCK_D at most 32 lanes x 16 bytes, ROWS a multiple of the warps).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lc_kernels.fast_math_triton import exp_neg


@triton.jit
def _load_tile(ptr, base, cols, mask):
    """An fp32 [ROWS, BLOCK_D] tile of the rows starting at ``base`` (int64 element offsets)."""
    return tl.load(ptr + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_block(blk, N, D, ROWS: tl.constexpr):
    """Rows of row block ``blk``, which of them exist, and their int64 element offsets."""
    rows = blk * ROWS + tl.arange(0, ROWS)
    return rows, rows < N, rows.to(tl.int64) * D


@triton.jit
def _source_dots(srcs, grad, w, base, row_in, D, WITH_GRAD: tl.constexpr, S: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Tuples of S [ROWS] vectors: (x . v_i, w . v_i) with x = grad (WITH_GRAD) or v_i itself (sum of v_i^2).

    Tile by tile with every source in the inner unrolled loop: S tiles in flight at once, and the
    gradient read once for all of them."""
    first = ()
    second = ()
    for i in tl.static_range(S):
        first = first + (tl.zeros([ROWS], dtype=tl.float32),)
        second = second + (tl.zeros([ROWS], dtype=tl.float32),)
    for k in range(0, D, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        col_in = cols < D
        mask = row_in[:, None] & col_in[None, :]
        wt = tl.load(w + cols, mask=col_in, other=0.0)[None, :]
        if WITH_GRAD:
            g = _load_tile(grad, base, cols, mask)
        first_k = ()
        second_k = ()
        for i in tl.static_range(S):
            v = _load_tile(srcs[i], base, cols, mask)
            if WITH_GRAD:
                first_k = first_k + (first[i] + tl.sum(g * v, axis=1),)
            else:
                first_k = first_k + (first[i] + tl.sum(v * v, axis=1),)
            second_k = second_k + (second[i] + tl.sum(v * wt, axis=1),)
        first = first_k
        second = second_k
    return first, second


@triton.jit
def _mixed_tile(vs, a, S: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """h^ of a tile: sum_i a_i v_i in the forward's order, rounded to the output dtype, back in fp32."""
    acc = tl.zeros_like(vs[0])
    for i in tl.static_range(S):
        acc += a[i][:, None] * vs[i]
    return acc.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _normed_source_dots(srcs, grad, w, gamma, a, rho, part2, base, row_in, D, S: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The first backward pass under NORM: tuples of S [ROWS] vectors da_i = G . v_i and w . v_i, and
    c = (gamma Y) . h^ [ROWS], with G = rho (gamma Y) - rho^3 (c / D) h^ (module docstring); gamma's
    gradient Y h^ rho summed over this block's rows into this program's row of ``part2``."""
    part2_row = part2 + tl.program_id(0).to(tl.int64) * D
    p = ()
    q = ()
    dot = ()
    for i in tl.static_range(S):
        p = p + (tl.zeros([ROWS], dtype=tl.float32),)
        q = q + (tl.zeros([ROWS], dtype=tl.float32),)
        dot = dot + (tl.zeros([ROWS], dtype=tl.float32),)
    c = tl.zeros([ROWS], dtype=tl.float32)
    for k in range(0, D, BLOCK_D):
        cols = k + tl.arange(0, BLOCK_D)
        col_in = cols < D
        mask = row_in[:, None] & col_in[None, :]
        wt = tl.load(w + cols, mask=col_in, other=0.0)[None, :]
        gam = tl.load(gamma + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        y_grad = _load_tile(grad, base, cols, mask)
        gy = gam * y_grad
        vs = ()
        for i in tl.static_range(S):
            vs = vs + (_load_tile(srcs[i], base, cols, mask),)
        h_hat = _mixed_tile(vs, a, S, OUT_DTYPE)
        c += tl.sum(gy * h_hat, axis=1)
        p_k = ()
        q_k = ()
        dot_k = ()
        for i in tl.static_range(S):
            p_k = p_k + (p[i] + tl.sum(gy * vs[i], axis=1),)
            q_k = q_k + (q[i] + tl.sum(h_hat * vs[i], axis=1),)
            dot_k = dot_k + (dot[i] + tl.sum(vs[i] * wt, axis=1),)
        p = p_k
        q = q_k
        dot = dot_k
        total = tl.load(part2_row + cols, mask=col_in, other=0.0) + tl.sum(y_grad * h_hat * rho[:, None], axis=0)
        tl.store(part2_row + cols, total, mask=col_in)
    da = ()
    for i in tl.static_range(S):
        da = da + (rho * p[i] - rho * rho * rho * (c / D) * q[i],)
    return da, dot, c


@triton.jit
def _inv_rms(sum_sq, D, eps):
    """1 / sqrt(sum_sq / D + eps): the approximate rsqrt (one instruction, within 2 ulps, as torch's
    RMSNorm on a GPU) where the IEEE square root and division took ~20 a row and source."""
    return tl.math.rsqrt(sum_sq / D + eps)


@triton.jit
def _softmax_weights(logits, S: tl.constexpr):
    """softmax over a tuple of S logits (scalars, or [ROWS] vectors), as a tuple."""
    top = logits[0]
    for i in tl.static_range(1, S):
        top = tl.maximum(top, logits[i])
    exps = ()
    total = 0.0
    for i in tl.static_range(S):
        exps = exps + (exp_neg(top - logits[i]),)
        total += exps[i]
    inv_total = 1.0 / total
    a = ()
    for i in tl.static_range(S):
        a = a + (exps[i] * inv_total,)
    return a


@triton.jit
def depth_mixture_fwd_kernel(srcs, w, h, a_out, r_out, gamma, rho_out, N, D, eps, eps2, S: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """h = sum_i a_i v_i in h's dtype; a, r and the logits stored for the backward (module docstring). With NORM, ``h``
    receives gamma * h^ rho instead (module docstring) and rho goes to ``rho_out`` (fp32 [N]).

    Programs stride over the row blocks: the grid, not the GPU's occupancy, sets how many rows are
    in flight between their two reads (what has to stay in L2)."""
    for blk in range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0)):
        rows, row_in, base = _row_block(blk, N, D, ROWS)
        # pass 1: every source's sum of squares and dot with w, then the softmax over the sources
        square, dot = _source_dots(srcs, h, w, base, row_in, D, False, S, ROWS, BLOCK_D)
        logits = ()
        inv_rms = ()
        for i in tl.static_range(S):
            r = _inv_rms(square[i], D, eps)
            inv_rms = inv_rms + (r,)
            logits = logits + (r * dot[i],)
        a = _softmax_weights(logits, S)
        for i in tl.static_range(S):
            tl.store(a_out + i * N + rows, a[i], mask=row_in)
            tl.store(r_out + i * N + rows, inv_rms[i], mask=row_in)
            tl.store(r_out + (S + i) * N + rows, logits[i], mask=row_in)
        # pass 2: the sources again (from L2: this program read them a moment ago), mixed tile by tile
        square_h = tl.zeros([ROWS], dtype=tl.float32)
        for k in range(0, D, BLOCK_D):
            cols = k + tl.arange(0, BLOCK_D)
            mask = row_in[:, None] & (cols < D)[None, :]
            acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for i in tl.static_range(S):
                acc += a[i][:, None] * _load_tile(srcs[i], base, cols, mask)
            stored = acc.to(h.dtype.element_ty)
            tl.store(h + base[:, None] + cols[None, :], stored, mask=mask)
            if NORM:
                rounded = stored.to(tl.float32)
                square_h += tl.sum(rounded * rounded, axis=1)
        if NORM:
            # pass 3: h^ back from L2 (just written by these threads), normalised in place
            rho = _inv_rms(square_h, D, eps2)
            tl.store(rho_out + rows, rho, mask=row_in)
            tl.debug_barrier()
            for k in range(0, D, BLOCK_D):
                cols = k + tl.arange(0, BLOCK_D)
                col_in = cols < D
                mask = row_in[:, None] & col_in[None, :]
                gam = tl.load(gamma + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
                # .cg: from L2, past this SM's L1, which need not hold what the other warps wrote
                h_hat = tl.load(h + base[:, None] + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
                y = h_hat.to(tl.float32) * rho[:, None] * gam
                tl.store(h + base[:, None] + cols[None, :], y.to(h.dtype.element_ty), mask=mask)


@triton.jit
def depth_mixture_bwd_kernel(srcs, dsrcs, seeds, grad, w, a_in, r_in, part, gamma, rho_in, part2, N, D, S: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ADD_TO: tl.constexpr, NORM: tl.constexpr):
    """dv_i = a_i grad + r_i dl_i (w - u_i logit_i / D) into ``dsrcs[i]`` in its dtype, u_i = r_i v_i, plus
    what ``seeds[i]`` holds where bit i of ``ADD_TO`` is set (one rounding: the sum is taken in fp32; a
    seed may be ``dsrcs[i]`` itself, each element read before it is written), and this
    program's share of sum over tokens and sources of dl_i u_i into its row of ``part`` (fp32
    [programs, D], zeroed by the caller), where dl_i = a_i (da_i - sum_j a_j da_j), da_i = grad . v_i.

    Programs stride over the row blocks as in the forward, so ``part`` has one row per program, not
    per block. Each program adds to its own row only (deterministic, no atomics); a barrier orders
    one block's read-modify-write of it after the previous block's.

    With NORM, ``grad`` is the normalised output's gradient Y, the mixture's gradient G is recomputed
    in each tile from Y, the sources and a (module docstring), and this program's share of gamma's
    gradient, sum over tokens of Y h^ rho, goes into its row of ``part2`` (fp32 [programs, D], zeroed).
    """
    part_row = part + tl.program_id(0).to(tl.int64) * D
    for blk in range(tl.program_id(0), tl.cdiv(N, ROWS), tl.num_programs(0)):
        rows, row_in, base = _row_block(blk, N, D, ROWS)
        a = ()
        for i in tl.static_range(S):
            a = a + (tl.load(a_in + i * N + rows, mask=row_in, other=0.0),)
        if NORM:
            rho = tl.load(rho_in + rows, mask=row_in, other=0.0)
            da, dot, c_norm = _normed_source_dots(srcs, grad, w, gamma, a, rho, part2, base, row_in, D, S, ROWS,
                                                  BLOCK_D, grad.dtype.element_ty)
        else:
            # pass 1: da_i = grad . v_i and w . v_i (the logit before its 1/rms), then through the softmax
            da, dot = _source_dots(srcs, grad, w, base, row_in, D, True, S, ROWS, BLOCK_D)
        mean = tl.zeros([ROWS], dtype=tl.float32)
        for i in tl.static_range(S):
            mean += a[i] * da[i]
        w_coef = ()  # r_i dl_i: of w in dv_i, and of v_i in the query's gradient (dl_i u_i = r_i dl_i v_i)
        v_coef = ()  # r_i dl_i logit_i / D times u_i = r_i v_i, logit_i = r_i (w . v_i)
        for i in tl.static_range(S):
            r = tl.load(r_in + i * N + rows, mask=row_in, other=0.0)
            wc = r * a[i] * (da[i] - mean)
            w_coef = w_coef + (wc,)
            v_coef = v_coef + (wc * r * (r * dot[i]) / D,)
        tl.debug_barrier()
        # pass 2: every source gradient and the [D] partial sums, tile by tile
        for k in range(0, D, BLOCK_D):
            cols = k + tl.arange(0, BLOCK_D)
            col_in = cols < D
            mask = row_in[:, None] & col_in[None, :]
            g = _load_tile(grad, base, cols, mask)
            wt = tl.load(w + cols, mask=col_in, other=0.0)[None, :]
            weighted = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            vs = ()
            for i in tl.static_range(S):
                vs = vs + (_load_tile(srcs[i], base, cols, mask),)
            if NORM:  # G from Y: rho (gamma Y) - rho^3 (c / D) h^, h^ recomputed as the forward rounded it
                gam = tl.load(gamma + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
                h_hat = _mixed_tile(vs, a, S, grad.dtype.element_ty)
                g = rho[:, None] * (gam * g) - (rho * rho * rho * c_norm / D)[:, None] * h_hat
            for i in tl.static_range(S):
                v = vs[i]
                dv = a[i][:, None] * g + w_coef[i][:, None] * wt - v_coef[i][:, None] * v
                if (ADD_TO >> i) & 1:
                    dv += _load_tile(seeds[i], base, cols, mask)
                tl.store(dsrcs[i] + base[:, None] + cols[None, :], dv.to(dsrcs[i].dtype.element_ty), mask=mask)
                weighted += w_coef[i][:, None] * v
            total = tl.load(part_row + cols, mask=col_in, other=0.0) + tl.sum(weighted, axis=0)
            tl.store(part_row + cols, total, mask=col_in)


# The resident kernels: ROWS whole rows of every tensor in registers (BLOCK >= D columns), so each
# source and the output gradient are read from memory once, and the [D] partial sums of the parameter
# gradients stay in registers across all the rows a program handles (written once, at its end). For
# widths whose rows fit (depth_mixture.py's ``*_resident_max_d``): the tiled kernels above read every
# source twice and keep their [D] partial sums in memory, read and written once per row block and tile.


@triton.jit
def _source_tiles(srcs, base, cols, mask, S: tl.constexpr):
    """Every source's fp32 tile of the rows at ``base``."""
    vs = ()
    for i in tl.static_range(S):
        vs = vs + (_load_tile(srcs[i], base, cols, mask),)
    return vs


@triton.jit
def depth_mixture_fwd_resident_kernel(srcs, w, h, a_out, r_out, gamma, rho_out, N, D, eps, eps2, S: tl.constexpr,
                                      ROWS: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                                      PREFETCH: tl.constexpr):
    """``depth_mixture_fwd_kernel``'s results, ROWS whole rows at a time (programs stride over the row blocks).
    With PREFETCH a program loads its next row block's sources before working on the current one, so
    their reads are in flight during its reductions (a row block's reads otherwise wait for the
    previous one's stores)."""
    cols = tl.arange(0, BLOCK)
    col_in = cols < D
    wt = tl.load(w + cols, mask=col_in, other=0.0)[None, :]
    if NORM:
        gam = tl.load(gamma + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    step = tl.num_programs(0)
    if PREFETCH:
        rows, row_in, base = _row_block(tl.program_id(0), N, D, ROWS)
        ahead = _source_tiles(srcs, base, cols, row_in[:, None] & col_in[None, :], S)
    for blk in range(tl.program_id(0), tl.cdiv(N, ROWS), step):
        rows, row_in, base = _row_block(blk, N, D, ROWS)
        mask = row_in[:, None] & col_in[None, :]
        if PREFETCH:
            vs = ahead
            _, next_in, next_base = _row_block(blk + step, N, D, ROWS)
            ahead = _source_tiles(srcs, next_base, cols, next_in[:, None] & col_in[None, :], S)
        else:
            vs = _source_tiles(srcs, base, cols, mask, S)
        logits = ()
        for i in tl.static_range(S):
            r = _inv_rms(tl.sum(vs[i] * vs[i], axis=1), D, eps)
            tl.store(r_out + i * N + rows, r, mask=row_in)
            logits = logits + (r * tl.sum(vs[i] * wt, axis=1),)
            tl.store(r_out + (S + i) * N + rows, logits[i], mask=row_in)
        a = _softmax_weights(logits, S)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for i in tl.static_range(S):
            tl.store(a_out + i * N + rows, a[i], mask=row_in)
            acc += a[i][:, None] * vs[i]
        stored = acc.to(h.dtype.element_ty)
        if NORM:
            h_hat = stored.to(tl.float32)
            rho = _inv_rms(tl.sum(h_hat * h_hat, axis=1), D, eps2)
            tl.store(rho_out + rows, rho, mask=row_in)
            stored = (h_hat * rho[:, None] * gam).to(h.dtype.element_ty)
        tl.store(h + base[:, None] + cols[None, :], stored, mask=mask)


@triton.jit
def _bwd_row_inputs(srcs, seeds, grad, a_in, r_in, rho_in, blk, N, D, cols, col_in, S: tl.constexpr,
                    ROWS: tl.constexpr, ADD_TO: tl.constexpr, NORM: tl.constexpr):
    """What the resident backward reads of row block ``blk`` (nothing past N): the output gradient's
    tile, the sources' tiles, their weights a and inverse rms r, rho (NORM), and the seeds' tiles (an
    empty [ROWS] vector for a source without one)."""
    rows, row_in, base = _row_block(blk, N, D, ROWS)
    mask = row_in[:, None] & col_in[None, :]
    g = _load_tile(grad, base, cols, mask)
    vs = ()
    a = ()
    r = ()
    logit = ()
    sd = ()
    for i in tl.static_range(S):
        vs = vs + (_load_tile(srcs[i], base, cols, mask),)
        a = a + (tl.load(a_in + i * N + rows, mask=row_in, other=0.0),)
        r = r + (tl.load(r_in + i * N + rows, mask=row_in, other=0.0),)
        logit = logit + (tl.load(r_in + (S + i) * N + rows, mask=row_in, other=0.0),)
        if (ADD_TO >> i) & 1:
            sd = sd + (_load_tile(seeds[i], base, cols, mask),)
        else:
            sd = sd + (tl.zeros([ROWS], dtype=tl.float32),)
    rho = tl.load(rho_in + rows, mask=row_in, other=0.0) if NORM else tl.zeros([ROWS], dtype=tl.float32)
    return g, vs, a, r, logit, rho, sd


@triton.jit
def depth_mixture_bwd_resident_kernel(srcs, dsrcs, seeds, grad, w, a_in, r_in, part, gamma, rho_in, part2, N, D,
                                      S: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ADD_TO: tl.constexpr,
                                      NORM: tl.constexpr, PREFETCH: tl.constexpr):
    """``depth_mixture_bwd_kernel``'s results, ROWS whole rows at a time: ``part`` (and ``part2``) [programs, D]
    receive each program's sums over its rows, written once (not added to: the caller need not zero them).
    PREFETCH as in the forward: the next row block's inputs are loaded before the current one's work."""
    cols = tl.arange(0, BLOCK)
    col_in = cols < D
    inv_d = 1.0 / D  # once, not a division a row
    wt = tl.load(w + cols, mask=col_in, other=0.0)[None, :]
    if NORM:
        gam = tl.load(gamma + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    query_sum = tl.zeros([BLOCK], dtype=tl.float32)
    gain_sum = tl.zeros([BLOCK], dtype=tl.float32)
    step = tl.num_programs(0)
    if PREFETCH:
        ahead = _bwd_row_inputs(srcs, seeds, grad, a_in, r_in, rho_in, tl.program_id(0), N, D, cols, col_in, S, ROWS,
                                ADD_TO, NORM)
    for blk in range(tl.program_id(0), tl.cdiv(N, ROWS), step):
        rows, row_in, base = _row_block(blk, N, D, ROWS)
        mask = row_in[:, None] & col_in[None, :]
        if PREFETCH:
            g, vs, a, rs, logits, rho, sd = ahead
            ahead = _bwd_row_inputs(srcs, seeds, grad, a_in, r_in, rho_in, blk + step, N, D, cols, col_in, S, ROWS,
                                    ADD_TO, NORM)
        else:
            g, vs, a, rs, logits, rho, sd = _bwd_row_inputs(srcs, seeds, grad, a_in, r_in, rho_in, blk, N, D, cols, col_in, S,
                                                    ROWS, ADD_TO, NORM)
        if NORM:  # G = rho (gamma Y) - rho^3 (c / D) h^, h^ recomputed as the forward rounded it
            h_hat = _mixed_tile(vs, a, S, grad.dtype.element_ty)
            gain_sum += tl.sum(g * h_hat * rho[:, None], axis=0)
            gy = gam * g
            c = tl.sum(gy * h_hat, axis=1)
            g = rho[:, None] * gy - (rho * rho * rho * c * inv_d)[:, None] * h_hat
        da = ()
        mean = tl.zeros([ROWS], dtype=tl.float32)
        for i in tl.static_range(S):
            da = da + (tl.sum(g * vs[i], axis=1),)
            mean += a[i] * da[i]
        weighted = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for i in tl.static_range(S):
            r = rs[i]
            wc = r * a[i] * (da[i] - mean)
            vc = wc * r * logits[i] * inv_d
            dv = a[i][:, None] * g + wc[:, None] * wt - vc[:, None] * vs[i]
            if (ADD_TO >> i) & 1:
                dv += sd[i]
            tl.store(dsrcs[i] + base[:, None] + cols[None, :], dv.to(dsrcs[i].dtype.element_ty), mask=mask)
            weighted += wc[:, None] * vs[i]
        query_sum += tl.sum(weighted, axis=0)
    own = tl.program_id(0).to(tl.int64) * D
    tl.store(part + own + cols, query_sum, mask=col_in)
    if NORM:
        tl.store(part2 + own + cols, gain_sum, mask=col_in)
