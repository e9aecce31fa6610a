"""Python's garbage collector on a step schedule (``gc.every``), instead of whenever it decides.

Left to itself, the collector runs a full collection when enough objects have survived earlier
ones. After ``torch.compile`` a training process tracks hundreds of thousands of objects, and such a
collection then holds the host for 17-253 ms (measured on an H100 host, docs/performance.md
§12.15). One rank's pause stalls every other rank at the next collective, and ranks pause at
different steps. With a schedule every rank collects at the same steps, between two steps, and
the automatic collector stays off in between.

The first scheduled collection freezes what survives it (``gc.freeze``): the model, the compiled
graphs and the caches built in the first steps are never scanned again, so the later collections
cost only what the steps since have allocated. Leaving the schedule (the stage's end, an error, a
closed iterator) unfreezes them, collects once and restores the collector as it was: a stage that
drops its model (a new layout) frees it with the automatic collector back on.
"""

from __future__ import annotations

import gc
from types import TracebackType
from typing import Optional


class StepScheduledCollection:
    """Inside ``with``: the automatic collector off, a full collection after every ``every``-th step
    (``after_step``), the survivors of the first one frozen. ``every`` = 0 changes nothing."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"every={every}: steps between collections must be >= 0 (0: Python's own schedule)")
        self.every = every
        self.collections = 0
        self._was_enabled = True
        self._frozen = False

    def __enter__(self) -> "StepScheduledCollection":
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def after_step(self, steps_done: int) -> None:
        """Collect when ``steps_done`` (steps taken inside this schedule) is a multiple of ``every``."""
        if not self.every or steps_done % self.every:
            return
        gc.collect()
        self.collections += 1
        if not self._frozen:
            gc.freeze()
            self._frozen = True

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if not self.every:
            return
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        if self._was_enabled:
            gc.enable()
        gc.collect()
