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


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counters(device: torch.device) -> Optional[dict[str, int]]:
    """The CUDA caching allocator's running counts of retries (a failed allocation that freed the
    cache and tried again: cudaFree, which waits for the whole device), and of cudaMalloc and
    cudaFree calls; None on a CPU. A steady state allocates from the cache: counts that grow every
    step mean fragmentation near the memory limit, and a host that waits for the GPU."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory of the device (None on a CPU, where the process shares the machine's)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None
