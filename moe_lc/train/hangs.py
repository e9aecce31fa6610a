"""A rank that stops responding becomes an error on the others, in bounded time, in one line.

A hung GPU, NIC or process looks to its peers like a collective that never completes; torch's
default is to wait 30 minutes, and only in the default group. `collective_timeouts` sets one
timeout for every process group of the launch (the default group and each group created
afterwards: the device mesh's, the checkpoint's), and on NCCL turns on its asynchronous error
handling (a timed-out collective aborts the communicator and the process instead of waiting)
and the flight recorder (the last collectives of each rank, dumped into a directory on a
timeout: which operation every rank was in).

gloo raises the timeout (or a peer's closed connection) in the waiting call itself;
`CollectiveFailure.of` turns it into one line naming the rank, what the launch was doing
(`Activity`), the collective and the code that called it, and the way out.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Messages of a collective whose peer is gone or late, as gloo and NCCL word them.
FAILURE_MARKERS = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                   "Watchdog caught collective operation timeout", "gloo/transport")
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # "[.../unbound_buffer.cc:78] "
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")


def collective_timeouts(timeout_s: float, flight_recorder_entries: int, dump_dir: Optional[Path]) -> timedelta:
    """Set the timeout of every process group created from now on, and NCCL's error handling and
    flight recorder (environment defaults: a variable already set wins); returns the timeout."""
    timeout = timedelta(seconds=timeout_s)
    # new_group() without a timeout (DeviceMesh, checkpoint groups) takes these module defaults
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # abort the communicator and the process
    if flight_recorder_entries > 0:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(flight_recorder_entries))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(dump_dir / "rank_"))  # + the rank
    return timeout


class Activity:
    """What the launch is doing, in words ("step 12 of stage ctx64k", "checkpoint save at step 10"),
    for the message of a collective that fails."""

    def __init__(self) -> None:
        self.now = "setting up"
        self.when_failed: Optional[str] = None  # `now` when an error first left a `doing` block

    @contextmanager
    def doing(self, what: str) -> Iterator[None]:
        before, self.now = self.now, what
        try:
            yield
        except BaseException:
            self.when_failed = self.when_failed or self.now
            raise
        finally:
            self.now = before

    def describe(self) -> str:
        """What the launch was doing when it failed (or is doing now)."""
        return self.when_failed or self.now


def is_collective_failure(err: BaseException) -> bool:
    """Whether `err` is a collective that timed out or lost its peer (not a bug of the caller)."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in FAILURE_MARKERS)


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a rank; the message is one line. Exit code 4."""

    @classmethod
    def of(cls, err: BaseException, rank: int, world_size: int, activity: Activity, timeout_s: float) -> "CollectiveFailure":
        op, caller = _where(err)
        called = f"{op} called from {caller}" if op and caller else (op or (f"in {caller}" if caller else ""))
        first = _SOURCE_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
        return cls(
            f"rank {rank} of {world_size}: a collective failed during {activity.describe()}"
            f"{f' ({called})' if called else ''}: {first}. Another rank stopped responding or died (a hung GPU, "
            f"network or process; the timeout is distributed.collective_timeout_s={timeout_s:g}): see its log; "
            "restarting the job resumes from the newest complete checkpoint (resume=auto)"
        )


def _where(err: BaseException) -> tuple[Optional[str], Optional[str]]:
    """The torch.distributed function that failed and the moe_lc function that called it, from the traceback."""
    op = caller = None
    for frame in traceback.extract_tb(err.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if path.endswith(_COLLECTIVE_FILES):
            op = op or frame.name  # the outermost collective call (inner frames are its helpers)
        elif "/moe_lc/" in path and op is None:
            module = path.rsplit("/moe_lc/", 1)[1].removesuffix(".py").replace("/", ".")
            caller = f"moe_lc.{module}.{frame.name}"
    return op, caller
