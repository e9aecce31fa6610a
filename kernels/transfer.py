"""Host-to-device copies that do not wait for the GPU."""

from __future__ import annotations

import torch
from torch import Tensor


def upload(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``. A CUDA copy from pageable memory waits for all queued GPU work (a
    stream sync: the GPU drains while the host prepares what comes next), so CUDA copies go
    through pinned memory and return without waiting."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
