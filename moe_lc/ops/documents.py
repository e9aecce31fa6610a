"""Host copies of packed-document boundaries (``cu_seqlens``), kept per tensor, and uploads of
host tables and batches that do not wait for the GPU.

Several layers need the boundaries on the host: the KDA checks and kernel plans, attention split
by documents. Copying a device tensor back waits for all queued GPU work, so one copy per layer
and call stops the host from running ahead of the GPU. The trainer hands over the host copy it
already has (:func:`upload_bounds`, :func:`remember_host_bounds`); otherwise the first call copies and later calls reuse
the copy while the tensor is the same object, unmodified.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

_latest: tuple | None = None  # (weak reference to the tensor, its version counter, the bounds)


def remember_host_bounds(cu_seqlens: Tensor, bounds: list[int]) -> None:
    """Record ``bounds`` (``cu_seqlens`` as a list of ints) as the host copy of ``cu_seqlens``."""
    global _latest
    _latest = (weakref.ref(cu_seqlens), cu_seqlens._version, list(bounds))


def host_bounds(cu_seqlens: Tensor) -> list[int]:
    """``cu_seqlens.tolist()``, without a device copy when the same unmodified tensor was seen last."""
    if _latest is not None:
        ref, version, bounds = _latest
        if ref() is cu_seqlens and cu_seqlens._version == version:
            return list(bounds)
    bounds = cu_seqlens.detach().cpu().tolist()
    remember_host_bounds(cu_seqlens, bounds)
    return bounds


def upload(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``. A CUDA copy from pageable memory waits for all queued GPU work (a
    stream sync: the GPU drains while the host prepares what comes next), so CUDA copies go
    through pinned memory and return without waiting."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_bounds(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """Host ``cu_seqlens`` on ``device`` (:func:`upload`), its host copy remembered so that no layer
    copies it back."""
    on_device = upload(cu_seqlens, device)
    remember_host_bounds(on_device, cu_seqlens.tolist())
    return on_device
