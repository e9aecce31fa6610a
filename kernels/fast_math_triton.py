"""Exponentials, reciprocals and sigmoids in the fewest sm_90 instructions that keep fp32 precision.

For elementwise kernels whose instruction issue, not memory, sets the time (SiTU-GLU, the short
convolution's SiLU). What the plain forms compile to on sm_90 (``benchmarks/sass_audit.py``):
``tl.exp`` is ex2 plus a fix-up for results below 2^-126, five instructions; ``/`` eight (a range
test, operand scaling and the reciprocal); ``tl.sigmoid`` eleven. Here:

- exp(-x) for x >= 0 is one multiply and one ex2 (``tl.exp2``), whose results below 2^-126 flush to
  0: the uses here are tanh and sigmoid, which are then already 1 or 0 in fp32;
- 1 / y for y in [1, 2] (every divisor here is 1 + exp(-x)) is rsqrt(y)^2: two instructions, within
  a few ulps, where no range test is needed;
- sigmoid(x) and 1 - sigmoid(x) come from e = exp(-|x|) as 1 / (1 + e) and e / (1 + e): no
  overflow and no cancellation at either end.

Triton's CPU interpreter computes rsqrt and exp2 exactly, so the tests run there check the
formulas; the tests run on a GPU check the approximations against the same float64 bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_LOG2E = tl.constexpr(-1.4426950408889634)  # exp(-x) = exp2(-x log2(e))


@triton.jit
def exp_neg(x, scale: tl.constexpr = 1.0):
    """exp(-scale x) for scale x >= 0 (0 below 2^-126)."""
    return tl.exp2(x * (scale * NEG_LOG2E))


@triton.jit
def reciprocal_1_to_2(y):
    """1 / y for y in [1, 2]."""
    r = tl.math.rsqrt(y)
    return r * r


@triton.jit
def sigmoid_pair(x):
    """sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x)."""
    e = exp_neg(tl.abs(x))
    r = reciprocal_1_to_2(1.0 + e)
    q = e * r
    pos = x >= 0.0
    return tl.where(pos, r, q), tl.where(pos, q, r)
