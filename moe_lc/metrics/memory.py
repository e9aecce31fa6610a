"""Peak memory: allocator peak on CUDA, the process's peak resident set on CPU."""

from __future__ import annotations

import resource
import sys
from typing import Optional

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (CUDA only: the CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory of the device (None on a CPU, where the process shares the machine's)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None
