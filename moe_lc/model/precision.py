"""Dtype helper: compute sensitive pieces (norms, gates, router) in at least fp32.

`.float()` would silently *down*cast a float64 reference run; `upcast` never lowers precision.
"""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
