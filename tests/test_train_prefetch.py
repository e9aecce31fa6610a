"""The prefetcher prepares the next items while the consumer works, never more than depth + 1
ahead, hands them over in order, re-raises the worker's exception with its traceback, and stops
its thread on close, also when the queue is full."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from moe_lc.train.prefetch import Prefetcher

WAIT_S = 10.0  # generous: the suite shares two cores


def test_items_come_in_order_and_are_prepared_ahead_within_the_bound():
    prepared: list[int] = []
    seen = threading.Condition()

    def prepare(key: int) -> str:
        with seen:
            prepared.append(key)
            seen.notify_all()
        return f"item {key}"

    keys = list(range(0, 50, 10))
    with Prefetcher(prepare, keys, depth=1) as ahead:
        for i, key in enumerate(keys):
            assert ahead.get(key) == f"item {key}"
            wanted = min(i + 2, len(keys))  # the next one waits in the queue, the one after is being made
            with seen:
                assert seen.wait_for(lambda: len(prepared) >= wanted, WAIT_S), prepared
            time.sleep(0.05)  # the consumer "works": the worker must not run further ahead
            assert len(prepared) <= i + 3, prepared
    assert prepared == keys


def test_a_worker_exception_is_raised_by_get_with_its_traceback():
    def prepare(key: int) -> int:
        if key == 2:
            raise ValueError("sequence 2 is unreadable")
        return key

    with Prefetcher(prepare, range(5)) as ahead:
        assert ahead.get(0) == 0 and ahead.get(1) == 1
        with pytest.raises(ValueError, match="sequence 2 is unreadable") as info:
            ahead.get(2)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "prepare" in frames, frames  # the worker's frame, below the consumer's


def test_close_stops_a_worker_blocked_on_a_full_queue():
    with Prefetcher(lambda key: key, range(10**6), depth=1) as ahead:
        assert ahead.get(0) == 0
        worker = ahead._thread
    worker.join(WAIT_S)
    assert not worker.is_alive()


def test_keys_out_of_order_or_past_the_end_are_refused():
    with Prefetcher(lambda key: key, [3, 4]) as ahead:
        with pytest.raises(RuntimeError, match="prepared key 3 but key 4 was asked for"):
            ahead.get(4)
    with Prefetcher(lambda key: key, [3]) as ahead:
        assert ahead.get(3) == 3
        with pytest.raises(RuntimeError, match="no key 4"):
            ahead.get(4)
