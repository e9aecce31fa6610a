"""Timing device work without a device-wide synchronize.

On a GPU kernels run after the host has queued them, so a host clock around a step measures the
queueing unless something waits for the device. `DeviceTimer` records CUDA events on the
current stream instead; `stop` waits for the end event only, i.e. for the work queued since
`start`. After a training step, whose end-of-step read has already waited for its work, that
wait is over at once. On a CPU the work is done when the calls return: the host clock measures it.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class DeviceTimer:
    """`start()`, queue work, `stop()`: the seconds that work took, as the device ran it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: Optional[torch.cuda.Event] = None
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._t0
        if self._start is None:
            raise RuntimeError("DeviceTimer.stop() without start()")
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        elapsed = self._start.elapsed_time(end) / 1e3
        self._start = None
        return elapsed
