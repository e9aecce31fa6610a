"""``grad += part``: a weight gradient accumulated over a step's micro-batches, one dispatch point.

The definition is ``dst.add_(src)``. On CUDA, for an fp32 ``dst`` and a ``src`` whose trailing
dims are contiguous (the routed experts' bf16 weight gradients, or one half of the stacked
gate/input gradient), the Triton kernel of ``moe_lc_kernels.accumulate`` does the same add with
vector loads (torch's add of two dtypes runs unvectorised). Bitwise the same sums either way.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc_kernels import triton_available

__all__ = ["accumulate_"]


def _rows(src: Tensor) -> Optional[tuple[int, int, int]]:
    """(rows, cols, row stride) of ``src`` seen as rows of contiguous elements along dim 0, or None."""
    if src.dim() == 0:
        return None
    cols, expected = 1, 1
    for size, stride in zip(reversed(src.shape[1:]), reversed(src.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
        cols *= size
    return src.shape[0], cols, (src.stride(0) if src.shape[0] > 1 else cols)


def accumulate_(dst: Tensor, src: Tensor) -> Tensor:
    """dst += src in dst's dtype, in place; returns dst."""
    if dst.shape != src.shape:
        raise ValueError(f"accumulate_: shapes differ, {tuple(dst.shape)} and {tuple(src.shape)}")
    layout = _rows(src)
    if (dst.is_cuda and src.device == dst.device and dst.dtype == torch.float32 and dst.is_contiguous()
            and src.dtype in (torch.bfloat16, torch.float16, torch.float32) and layout is not None
            and dst.numel() > 0 and triton_available(dst.device.type)):
        from moe_lc_kernels.accumulate import accumulate_rows_triton

        accumulate_rows_triton(dst, src, *layout)
        return dst
    return dst.add_(src)
