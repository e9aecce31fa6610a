"""Triton kernel of ``dst += src`` over rows (launched from accumulate.py): program (r, b) adds
BLOCK consecutive elements of row r; ``dst`` is contiguous fp32, ``src``'s rows are
``src_row_stride`` elements apart. Offsets are int64 (a stacked expert weight exceeds 2^31 bytes)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def accumulate_rows_kernel(dst, src, cols, src_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    d = dst + row * cols + offs
    s = tl.load(src + row * src_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(d, tl.load(d, mask=mask, other=0.0) + s, mask=mask)
