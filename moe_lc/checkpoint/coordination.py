"""The few collectives a checkpoint needs, and the same code path in a single process.

Rank 0 alone touches the shared directory structure (temp names, renames, pointer,
pruning); every other rank learns the outcome (value or exception) from a broadcast,
so a failure on rank 0 raises on every rank instead of leaving them at a barrier.
The collectives run on a CPU-capable (gloo) group: the default group when it has a
CPU backend, otherwise one created here, so that they also work beside NCCL.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from .errors import CheckpointError

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def has_cpu_backend(group: Any = None) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def new_gloo_group() -> Any:
    """A gloo group over all ranks; collective: every rank must call it at the same point."""
    return dist.new_group(backend="gloo")


def _picklable(err: BaseException) -> BaseException:
    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001 - any unpicklable exception is re-described
        return CheckpointError(f"{type(err).__name__}: {err}")


class Coordinator:
    """Rank-0 decisions shared with all ranks over a CPU-capable group."""

    def __init__(self) -> None:
        self._group: Optional[Any] = None
        self._group_ready = False

    def _cpu_group(self) -> Any:
        if not self._group_ready:
            self._group = None if has_cpu_backend() else new_gloo_group()
            self._group_ready = True
        return self._group

    def barrier(self) -> None:
        if is_distributed():
            dist.barrier(group=self._cpu_group())

    def rank0_decides(self, decide: Callable[[], T]) -> T:
        """Run `decide` on rank 0 and return its value (or raise its exception) on every rank."""
        if not is_distributed():
            return decide()
        outcome: list[Any] = [None]
        if rank() == 0:
            try:
                outcome[0] = ("ok", decide())
            except Exception as err:  # noqa: BLE001 - re-raised on every rank below
                outcome[0] = ("err", _picklable(err))
        dist.broadcast_object_list(outcome, src=0, group=self._cpu_group())
        kind, value = outcome[0]
        if kind == "err":
            raise value
        return value

    def union(self, items: set[str]) -> set[str]:
        """The union of every rank's `items` (the identity in a single process)."""
        if not is_distributed():
            return set(items)
        gathered: list[Any] = [None] * world_size()
        dist.all_gather_object(gathered, sorted(items), group=self._cpu_group())
        return set().union(*map(set, gathered))

    def every_rank_runs(self, work: Callable[[], T]) -> T:
        """Run `work` on every rank; if it fails on any rank, raise the first failure on all of them.

        For checks whose outcome may differ per rank (each rank holds its own shard of the
        state): a rank that raised alone would leave the others waiting in the next collective.
        """
        if not is_distributed():
            return work()
        try:
            outcome: tuple[str, Any] = ("ok", work())
        except Exception as err:  # noqa: BLE001 - shared with every rank below
            outcome = ("err", _picklable(err))
        gathered: list[Any] = [None] * world_size()
        dist.all_gather_object(gathered, outcome[0] == "err" and outcome[1] or None, group=self._cpu_group())
        failures = [err for err in gathered if err is not None]
        if outcome[0] == "err":
            raise outcome[1]
        if failures:
            raise failures[0]
        return outcome[1]
