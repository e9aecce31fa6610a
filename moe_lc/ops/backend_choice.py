"""How an op with a reference ("torch") and one fast path picks its backend, the same way for every op.

"auto" takes the fast path only where the op says it pays (typically CUDA), never a silent
fallback for an explicit request: asking for the fast path where it cannot run is an error that
says why and what to ask for instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_lc_kernels import triton_available


def triton_device_reason(device: torch.device) -> Optional[str]:
    """Why no Triton kernel can run on ``device`` here (None when one can): the first thing every op's
    Triton path checks, and what a run that asks for one checks before it builds the model."""
    if device.type not in ("cuda", "cpu") or not triton_available(device.type):
        return (f"Triton cannot run on {device} here (it needs CUDA and the triton package, or a CPU "
                "tensor under TRITON_INTERPRET=1)")
    return None


def choose_backend(op: str, backend: str, fast: str, unsupported: Optional[str], auto_takes_fast: bool) -> str:
    """"torch" or ``fast`` for a request ``backend`` in ("auto", "torch", ``fast``).

    ``unsupported``: why the fast path cannot take these inputs here (None when it can);
    ``auto_takes_fast``: whether "auto" should prefer the fast path for these inputs when it can.
    """
    choices = ("auto", "torch", fast)
    if backend not in choices:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {list(choices)}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return fast if auto_takes_fast and unsupported is None else "torch"
    if unsupported is not None:
        raise RuntimeError(f'{op}: backend "{fast}" unavailable: {unsupported}; use backend="torch" (or "auto")')
    return fast
