"""moe_lc_kernels: Triton kernels for moe-lc (importable without a GPU and without Triton).

Everything that needs Triton is imported on first use, so ``import moe_lc_kernels`` works on any
machine; :func:`triton_available` says whether the kernels can run here. The package imports
nothing from the moe-lc framework (its ops call these kernels, never the reverse): everything a
kernel needs, document boundaries on the host and the gate's floor included, is an argument.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["triton_available", "chunk_kda_fused", "chunk_kda_triton"]

# Looked up once: the ops ask on every call, some from inside compiled regions, where torch 2.11's
# Dynamo will not trace importlib's find_spec and breaks the graph at each call.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available(device_type: str = "cuda") -> bool:
    """True when Triton is installed and can run on ``device_type`` (CPU only under TRITON_INTERPRET=1)."""
    if not _TRITON_INSTALLED:
        return False
    if device_type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return True


def __getattr__(name: str) -> Any:
    if name in ("chunk_kda_fused", "chunk_kda_triton"):
        from moe_lc_kernels import kda

        return getattr(kda, name)
    raise AttributeError(f"module 'moe_lc_kernels' has no attribute {name!r}")
