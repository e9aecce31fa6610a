"""Work prepared ahead on a background thread: the next step's micro-batches while this step runs.

    with Prefetcher(prepare, keys=range(c0, c_end, S)) as ahead:
        for key in keys:
            item = ahead.get(key)      # prepared while the previous step ran

The worker calls `prepare(key)` for the keys in order and hands the results over through a
bounded queue (`depth` items waiting at most, so at most depth + 1 prepared ahead). It holds no
state of its own: after a resume the trainer starts a new one at the resumed position, which
recomputes what the old one had prepared. An exception in the worker is raised by `get` in the
consumer's thread, with the worker's traceback. `close` (also on leaving the `with`, by error or
signal) stops the worker at its next hand-over and waits for it briefly; the thread is a daemon,
so a worker stuck in a slow read never keeps the process alive.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, Optional, TypeVar

T = TypeVar("T")

_DONE = object()  # the worker has prepared every key
HAND_OVER_POLL_S = 0.1  # how often a worker waiting on a full queue looks for close()
JOIN_TIMEOUT_S = 5.0


class Prefetcher(Generic[T]):
    """`prepare(key)` for each of `keys`, in order, on a daemon thread, `depth` results buffered."""

    def __init__(self, prepare: Callable[[int], T], keys: Iterable[int], depth: int = 1,
                 name: str = "moe-lc-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: a prefetcher buffers at least one item")
        self._prepare = prepare
        self._keys = iter(keys)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        try:
            for key in self._keys:
                if self._closed.is_set():
                    return
                if not self._hand_over((key, self._prepare(key), None)):
                    return
        except BaseException as err:  # noqa: BLE001 - every failure goes to the consumer, which re-raises it
            self._hand_over((None, None, err))
            return
        self._hand_over((None, _DONE, None))

    def _hand_over(self, entry: tuple[Optional[int], Any, Optional[BaseException]]) -> bool:
        """Put `entry` into the queue unless closed first; False when closed."""
        while not self._closed.is_set():
            try:
                self._queue.put(entry, timeout=HAND_OVER_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, key: int) -> T:
        """The item of `key`, which must be the next key; a worker's exception is raised here."""
        if self._finished or self._closed.is_set():
            raise RuntimeError("the prefetcher is closed or has prepared every key")
        got, item, err = self._queue.get()
        if err is not None:
            self._finished = True
            raise err  # keeps the worker's traceback (err.__traceback__) below this frame
        if item is _DONE:
            self._finished = True
            raise RuntimeError(f"the prefetcher has no key {key}: it prepared every key it was given")
        if got != key:
            raise RuntimeError(f"the prefetcher prepared key {got} but key {key} was asked for; "
                               "ask for the keys in the order they were given")
        return item

    def close(self) -> None:
        """Stop the worker (at its next hand-over) and drop what it prepared."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
