"""Lines that say a long run is alive and whether one rank holds the others back.

Heartbeat: every `heartbeat_every_s` seconds, at a step end, a line with the step, the pace
since the last one and the loss; a log whose heartbeats stop has a launch that stopped.

Stragglers: in a synchronous step every rank waits for the slowest at each collective, so
step times are the same on every rank and cannot single one out. What differs is each rank's
own work, done without waiting for the others: the time it waited for its batches (the data
thread) and its optimizer update (CUDA events on a GPU). Each step's end-of-step all-reduce
carries every rank's own time of the step before (no extra collective); every
`straggler_every` steps the means are compared, and the slowest rank is reported by name when it
is over `straggler_ratio` x the median of the other ranks (and more than MIN_EXCESS_S above it;
the others', so that with two ranks the straggler does not set its own bar).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

MIN_EXCESS_S = 0.01  # below this a rank's extra time is noise, whatever the ratio


class Heartbeat:
    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last = clock()
        self._steps = 0
        self._tokens = 0

    def beat(self, step: int, total: int, stage: str, loss: float, tokens: int) -> Optional[str]:
        """Count a step just taken; the heartbeat line when one is due."""
        self._steps += 1
        self._tokens += tokens
        now = self._clock()
        elapsed = now - self._last
        if self.every_s <= 0 or elapsed < self.every_s:
            return None
        line = (f"heartbeat: step {step}/{total} (stage {stage}), {self._steps} steps in the last {elapsed:.0f}s "
                f"({elapsed / self._steps:.2f}s/step, {self._tokens / elapsed:,.0f} tokens/s), loss {loss:.4f}")
        self._last, self._steps, self._tokens = now, 0, 0
        return line


class StragglerWatch:
    """Sums each rank's own time per step; `add` names a rank far above the others' median."""

    def __init__(self, every: int, ratio: float, world_size: int) -> None:
        self.every = every
        self.ratio = ratio
        self.world_size = world_size
        self._sums = [0.0] * world_size
        self._steps = 0

    def add(self, step: int, own_s_per_rank: list[float]) -> Optional[str]:
        """Add one step's own times (of the step before it); a report line at a check step when a rank straggles."""
        if self.every <= 0 or self.world_size < 2 or not any(own_s_per_rank):
            return None  # the first step of a launch carries no times yet
        self._sums = [a + b for a, b in zip(self._sums, own_s_per_rank)]
        self._steps += 1
        if self._steps < self.every:
            return None
        means = [s / self._steps for s in self._sums]
        self._sums, self._steps = [0.0] * self.world_size, 0
        slowest = max(range(self.world_size), key=lambda r: means[r])
        worst = means[slowest]
        median = statistics.median(m for r, m in enumerate(means) if r != slowest)
        if worst - median < MIN_EXCESS_S or worst < self.ratio * median:
            return None
        return (f"straggler: rank {slowest} spent {worst:.3f}s per step on its own work (waiting for its batches, "
                f"its optimizer update) over the {self.every} steps to step {step}, {worst / max(median, 1e-9):.1f}x "
                f"the median {median:.3f}s of the other {self.world_size - 1} ranks "
                f"(distributed.straggler_ratio={self.ratio:g})")
