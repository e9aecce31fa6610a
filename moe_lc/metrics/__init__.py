"""Training metrics: FLOP/s and MFU, memory, the console progress line and the metric sinks
(JSONL, TensorBoard, wandb)."""

from moe_lc.metrics.flops import PEAK_FLOPS, device_peak_flops, mfu
from moe_lc.metrics.memory import peak_memory_bytes, reset_peak_memory
from moe_lc.metrics.progress import Progress
from moe_lc.metrics.sinks import JsonlWriter, MetricSinks, read_jsonl

__all__ = [
    "JsonlWriter",
    "MetricSinks",
    "PEAK_FLOPS",
    "Progress",
    "device_peak_flops",
    "mfu",
    "peak_memory_bytes",
    "read_jsonl",
    "reset_peak_memory",
]
