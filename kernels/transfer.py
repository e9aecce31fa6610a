"""Host-to-device copies that do not wait for the GPU."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def upload(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``. A CUDA copy from pageable memory waits for all queued GPU work (a
    stream sync: the GPU drains while the host prepares what comes next), so CUDA copies go
    through pinned memory and return without waiting."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


TABLE_ALIGN_BYTES = 16  # the pointer alignment Triton specialises a kernel on


def upload_tables(tables: Sequence[Sequence[int] | Tensor], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """Integer ``tables`` on ``device`` in one copy, each starting on a 16-byte boundary.

    Triton compiles a kernel once for each pattern of 16-byte-aligned pointer arguments. Tables
    packed end to end start wherever the lengths before them end, so every batch with new document
    lengths met a new pattern and compiled the kernels that read the tables again (~1 s each on an
    H200, several per training step for the first dozens of steps). Padding each table to the
    boundary keeps one pattern, so each kernel compiles once.
    """
    per = TABLE_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    pieces, starts, offset = [], [], 0
    for table in tables:
        values = torch.as_tensor(table, dtype=dtype)
        padded = -(-values.numel() // per) * per
        pieces += [values, torch.zeros(padded - values.numel(), dtype=dtype)]
        starts.append(offset)
        offset += padded
    packed = upload(torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype), device)
    return [packed[start:start + len(table)] for start, table in zip(starts, tables)]
