"""Triton kernels of SiTU-GLU, h = [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(c/b2)]; launched from situ_glu.py.

Elementwise over contiguous, equally shaped a, c (any shape, seen flat): each program owns BLOCK
consecutive elements of h. STACKED: a and c are the two halves of each row of one [rows, 2 hidden]
tensor (gate columns first; the grouped GEMM over the stacked weights writes it so), c the pointer
``hidden`` elements past a; its rows may lie ``row_stride`` elements apart (columns of a wider GEMM
output), and the backward writes da and dc into one contiguous [rows, 2 hidden] tensor. Math in fp32, loads and stores in the tensors' dtype. Offsets are int64: a
[tokens, hidden] activation can exceed 2^31 elements.

tanh and sigmoid are written out from one exp each so that every quantity keeps its relative
precision (the interpreter has no libdevice tanh, and ``2 sigmoid(2x) - 1`` loses all relative
precision near 0, where b tanh(x/b) ~ x must stay exact to an ulp):

- tanh(x): an odd Taylor polynomial to x^9 for |x| < 1/4 (truncation < 1e-8 relative), else
  (1 - e) / (1 + e) with e = exp(-2|x|) (1 - e >= 0.39 there, so no cancellation);
- 1 - tanh(x)^2 = 4e / (1 + e)^2: no cancellation when tanh(x) is close to 1;
- sigmoid(x) and 1 - sigmoid(x) from e = exp(-|x|): no overflow and no cancellation at either end.

The kernels are bound by instruction issue, not memory: their exponentials, reciprocals and sigmoids
are fast_math_triton's (every exponential is of -|x|, every divisor 1 + e in [1, 2]).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_lc_kernels.fast_math_triton import exp_neg, reciprocal_1_to_2, sigmoid_pair

SMALL_TANH = tl.constexpr(0.25)  # below it the polynomial, above it the exp formula


@triton.jit
def _tanh_sech2(x):
    """tanh(x) and its derivative 1 - tanh(x)^2, both to a few fp32 ulps of relative precision."""
    ax = tl.abs(x)
    e = exp_neg(ax, 2.0)
    r = reciprocal_1_to_2(1.0 + e)
    x2 = x * x
    poly = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < SMALL_TANH, poly, (1.0 - e) * r)
    t = tl.where(x < 0.0, -t, t)
    return t, 4.0 * e * r * r


@triton.jit
def _source(offs, hidden: tl.constexpr, row_stride, STACKED: tl.constexpr):
    """Where element ``offs`` of h reads a and c: the same place, or in rows ``row_stride`` elements
    apart whose first 2 hidden values are [a, c] (``hidden`` a compile-time constant, so that the
    division is a multiply and shift)."""
    if STACKED:
        return (offs // hidden) * row_stride + offs % hidden
    return offs


@triton.jit
def situ_glu_fwd_kernel(a, c, h, n, hidden: tl.constexpr, row_stride, beta1, beta2, BLOCK: tl.constexpr,
                        STACKED: tl.constexpr):
    """h = (b1 tanh(a/b1) sigmoid(a)) (b2 tanh(c/b2)) in h's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = _source(offs, hidden, row_stride, STACKED)
    av = tl.load(a + src, mask=mask, other=0.0).to(tl.float32)
    cv = tl.load(c + src, mask=mask, other=0.0).to(tl.float32)
    t1, _ = _tanh_sech2(av * (1.0 / beta1))
    t2, _ = _tanh_sech2(cv * (1.0 / beta2))
    s, _ = sigmoid_pair(av)
    out = (beta1 * t1 * s) * (beta2 * t2)
    tl.store(h + offs, out.to(h.dtype.element_ty), mask=mask)


@triton.jit
def situ_glu_bwd_kernel(a, c, dh, da, dc, n, hidden: tl.constexpr, row_stride, grad_row_stride, beta1, beta2,
                        BLOCK: tl.constexpr, STACKED: tl.constexpr):
    """da = dh u (sech^2(a/b1) s + g s (1 - s)), dc = dh g s sech^2(c/b2), with g = b1 tanh(a/b1),
    s = sigmoid(a), u = b2 tanh(c/b2) recomputed from a and c (h is not kept)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = _source(offs, hidden, row_stride, STACKED)
    av = tl.load(a + src, mask=mask, other=0.0).to(tl.float32)
    cv = tl.load(c + src, mask=mask, other=0.0).to(tl.float32)
    g_out = tl.load(dh + offs, mask=mask, other=0.0).to(tl.float32)
    t1, sech1 = _tanh_sech2(av * (1.0 / beta1))
    t2, sech2 = _tanh_sech2(cv * (1.0 / beta2))
    s, one_minus_s = sigmoid_pair(av)
    g = beta1 * t1
    up = beta2 * t2
    d_a = g_out * up * (sech1 * s + g * s * one_minus_s)
    d_c = g_out * (g * s) * sech2
    dst = _source(offs, hidden, grad_row_stride, STACKED)
    tl.store(da + dst, d_a.to(da.dtype.element_ty), mask=mask)
    tl.store(dc + dst, d_c.to(dc.dtype.element_ty), mask=mask)
