"""``dst += src`` for fp32 gradient sums and lower-precision gradients, at the speed of a copy.

The routed experts' weights are most of k3-small's parameters (3.4B of 4.3B), and each micro-batch
after a step's first adds its bf16 weight gradients into their fp32 ``.grad``. torch's add of two
dtypes runs its unvectorised loop (2.4-2.8 TB/s on an H200: 0.70 ms a layer, 13 ms a micro-batch at
k3-small's shapes, docs/performance.md §12.3); this kernel reads and writes with
vector loads. The source may be rows of a wider tensor (a half of the stacked gate/input gradient):
[R, C] with its own row stride, the destination contiguous [R, C]. Exact: the upcast of a bf16 or
fp16 value to fp32 is exact, and the one fp32 add rounds as torch's does.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Elements per program and warps (memory-bound: 16 bytes a lane at 4 warps and 2048 bf16 elements).
TUNING = dict(block=2048, warps=4)


def accumulate_rows_triton(dst: Tensor, src: Tensor, rows: int, cols: int, src_row_stride: int) -> None:
    """dst[r, c] += src[r * src_row_stride + c] for a contiguous fp32 ``dst`` of rows x cols elements."""
    import triton

    from moe_lc_kernels import accumulate_triton as kt

    block = TUNING["block"]
    kt.accumulate_rows_kernel[(rows, triton.cdiv(cols, block))](dst, src, cols, src_row_stride, BLOCK=block,
                                                                num_warps=TUNING["warps"])
