"""Training metrics: FLOP/s and MFU, memory, device timing, the console progress line and the
metric sinks (JSONL, TensorBoard, wandb)."""

from moe_lc.metrics.flops import PEAK_FLOPS, device_peak_flops, measured_matmul_peak, mfu
from moe_lc.metrics.memory import device_memory_bytes, peak_memory_bytes, reset_peak_memory
from moe_lc.metrics.progress import Progress
from moe_lc.metrics.sinks import JsonlWriter, MetricSinks, read_jsonl
from moe_lc.metrics.timing import DeviceTimer

__all__ = [
    "DeviceTimer",
    "JsonlWriter",
    "MetricSinks",
    "PEAK_FLOPS",
    "Progress",
    "device_memory_bytes",
    "device_peak_flops",
    "measured_matmul_peak",
    "mfu",
    "peak_memory_bytes",
    "read_jsonl",
    "reset_peak_memory",
]
