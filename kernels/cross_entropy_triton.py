"""Triton kernel of the LM loss's elementwise part (launched from cross_entropy.py).

One program per token row of logits [n, V]: a first pass over the row's column blocks keeps, per
lane, a running maximum and the sum of exp(z - max) rescaled whenever the maximum rises (one read
of the row, where logsumexp's max-then-sum takes two); the lanes combine into lse. The loss is lse -
z[label]. With WRITE_GRAD a second pass, over the blocks in reverse (the last ones read are the
likeliest still in L2), writes softmax(z) - onehot(label) in fp32 rounded to the output's dtype, in
place of the logits when the launcher passes one buffer for both. Rows labelled IGNORE get loss 0
and a zero gradient; a label outside [0, V) that is not IGNORE gives a NaN loss (the kernel cannot
raise; the trainer stops on a non-finite loss).
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOWEST = tl.constexpr(-3.4028234663852886e38)  # the lowest finite fp32: a lane that saw only masked columns stays finite


@triton.jit
def cross_entropy_rows_kernel(logits, labels, loss, grad, V, LOGITS_ROW, GRAD_ROW, IGNORE,
                              BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = logits + row * LOGITS_ROW
    cols = tl.arange(0, BLOCK)
    label = tl.load(labels + row)
    ignored = label == IGNORE
    in_range = (label >= 0) & (label < V)
    m = tl.full([BLOCK], _LOWEST, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    picked = tl.load(z_row + tl.where(in_range, label, 0)).to(tl.float32)
    row_loss = tl.where(ignored, 0.0, tl.where(in_range, lse - picked, float("nan")))
    tl.store(loss + row, row_loss)
    if WRITE_GRAD:
        g_row = grad + row * GRAD_ROW
        blocks = tl.cdiv(V, BLOCK)
        for i in range(0, blocks):
            start = (blocks - 1 - i) * BLOCK
            c = start + cols
            z = tl.load(z_row + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)
            g = tl.where(ignored, 0.0, g)
            tl.store(g_row + c, g.to(grad.dtype.element_ty), mask=c < V)
