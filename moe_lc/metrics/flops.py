"""Peak FLOP/s per device and model FLOP utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token from
`moe_lc.model.accounting.training_flops_per_token` (forward + backward, no recomputation).

Peaks are dense bf16 tensor-core numbers from the vendors' data sheets (no sparsity). A CPU
has no single peak: `CPU_NOMINAL_PEAK_PER_CORE` (50 GFLOP/s fp32 per core, roughly one AVX2 FMA
pipe at ~3 GHz) is a nominal value so that CPU runs log a comparable number; override it with
`logging.cpu_peak_flops`.

`measured_matmul_peak` times a large matmul on the device itself (bf16 on a GPU, fp32 on a
CPU): what its matrix units deliver under this run's clocks, power limit and libraries, the
realistic ceiling for the model's matmuls. `moe-lc bench` reports MFU against both.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from moe_lc.metrics.timing import DeviceTimer

PEAK_FLOPS = {  # substring of torch.cuda.get_device_name() -> dense bf16 FLOP/s
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}
CPU_NOMINAL_PEAK_PER_CORE = 50e9


def device_peak_flops(device: torch.device, cpu_peak: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one device; None for an unknown GPU (MFU is then not reported)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_FLOPS.items():
            if key in name:
                return peak
        return None
    if cpu_peak is not None:
        return cpu_peak
    return CPU_NOMINAL_PEAK_PER_CORE * torch.get_num_threads()


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: Optional[float], num_devices: int) -> Optional[float]:
    """Fraction of the devices' peak that the model's FLOPs use; None when the peak is unknown."""
    if not peak_flops_per_device or num_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}  # square matmul edge: large enough to reach the device's peak
MATMUL_REPEATS = {"cuda": 20, "cpu": 3}  # matmuls per timed trial


def measured_matmul_peak(device: torch.device, size: Optional[int] = None, trials: int = 3) -> float:
    """FLOP/s of a square `size` matmul on `device`, best of `trials` timed runs (bf16 on a GPU, fp32
    on a CPU)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    n, repeats = size or MATMUL_SIZE[kind], MATMUL_REPEATS[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    timer = DeviceTimer(device)
    torch.mm(a, b, out=out)  # warm-up: library handles and kernel choice
    best = math.inf
    for _ in range(trials):
        timer.start()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        best = min(best, timer.stop() / repeats)
    return 2.0 * n**3 / best
