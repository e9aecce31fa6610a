"""How the launchers describe a tensor's memory to a kernel that takes raw pointers and strides."""

from __future__ import annotations

from torch import Tensor


def row_stride(t: Tensor) -> int:
    """Elements between the rows of a 2-D ``t`` whose last dim is contiguous: its stride, or its width
    for a single row (whose stride says nothing: a one-row slice of a wider tensor may report anything)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]
