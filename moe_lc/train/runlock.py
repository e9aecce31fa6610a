"""One trainer per run directory: a lock file that rank 0 holds for the whole launch.

    run_dir/run.lock    {"host", "pid", "pid_start", "started", "command", "token"}

Two trainers writing one run (a job submitted twice, a requeue while the first copy still
runs) would interleave records and race each other's checkpoints, so rank 0 takes the lock
before anything is written into run_dir and removes it when the launch ends. The record is
written to a file of its own and hard-linked into place, which fails when a lock exists, so
no reader ever sees half a lock. While the lock is held a daemon thread touches it every
`refresh_s` seconds: its age says whether a holder on another host is still there.

A lock that is held already is taken over, with a warning, when its holder is gone:

- same host: the pid no longer runs, or now belongs to a process that started later (pid reuse);
- another host: the lock has not been touched for `stale_after_s` seconds;
- `force`: whatever holds it (the operator knows the holder is gone).

Otherwise `RunLockHeld` (a ConfigError, exit code 2) names the holder and the ways out.
A takeover renames the stale lock aside before checking that it is still the one judged
stale, so two launches that both find the same stale lock cannot both take it. A holder
whose lock was taken over (`force` from another launch) learns it at its next `check()`.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from moe_lc.config import ConfigError
from moe_lc.storage import RUN_DIR_FIX, check_path, reported

LOCK_FILE = "run.lock"
TAKEOVER_ATTEMPTS = 5


class RunLockHeld(ConfigError):
    """Another live trainer holds the run directory."""


class RunLockLost(RuntimeError):
    """This launch's lock was removed or taken over while it trained."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory: what the lock file records."""

    host: str
    pid: int
    pid_start: Optional[int]  # the process's start time in clock ticks since boot (Linux), against pid reuse
    started: float  # time.time() when the lock was taken
    command: str
    token: str  # unique per acquisition: tells this launch's lock from a later one

    @classmethod
    def of_this_process(cls) -> "LockHolder":
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()), time.time(),
                   shlex.join(sys.argv), uuid.uuid4().hex)

    def describe(self, age_s: float) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"pid {self.pid} on {self.host}, started {when}, last seen {age_s:.0f}s ago, "
                f"command: {self.command}")


def process_start_ticks(pid: int) -> Optional[int]:
    """Field 22 of /proc/PID/stat (start time since boot); None where there is no /proc or no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the command name (field 2) may hold spaces


def process_is_running(pid: int, start_ticks: Optional[int]) -> bool:
    """Whether `pid` runs on this host and is the process that was recorded (not a reuse of its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    if start_ticks is None:
        return True
    now = process_start_ticks(pid)
    return now is None or now == start_ticks


def _read_holder(path: Path) -> Optional[tuple[LockHolder, float]]:
    """The holder recorded in `path` and the lock's age in seconds; None when there is no lock."""
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        return LockHolder(**json.loads(text)), max(age, 0.0)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"the run lock {path} is unreadable ({err}); if no trainer uses this run_dir, "
                          "delete the file or pass run_lock.force=true") from err


class RunLock:
    """The lock of one run directory while this launch holds it; see the module docstring."""

    def __init__(self, path: Path, holder: LockHolder, refresh_s: float) -> None:
        self.path = path
        self.holder = holder
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._lost: Optional[str] = None
        self._thread = threading.Thread(target=self._refresh, name="moe-lc-run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(
        cls,
        run_dir: Path,
        stale_after_s: float,
        force: bool = False,
        warn: Callable[[str], None] = lambda text: None,
    ) -> "RunLock":
        """Take the lock of `run_dir` (created if needed); `warn` hears about a lock taken over.

        RunLockHeld when a live trainer holds it.
        """
        run_dir = check_path(run_dir, "run_dir")
        with reported(run_dir, "create the run directory", RUN_DIR_FIX):
            run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        me = LockHolder.of_this_process()
        for _ in range(TAKEOVER_ATTEMPTS):
            if _link_new(path, me):
                return cls(path, me, refresh_s=min(60.0, stale_after_s / 4))
            found = _read_holder(path)
            if found is None:  # released in between
                continue
            holder, age = found
            why = _stale_because(holder, age, stale_after_s, force)
            if why is None:
                gone = ("if that trainer is gone (its host died), pass run_lock.force=true or wait until the lock "
                        f"is {stale_after_s:.0f}s old (run_lock.stale_after_s)" if holder.host != socket.gethostname()
                        else "if that process is not a trainer of this run, pass run_lock.force=true")
                raise RunLockHeld(
                    f"run_dir {run_dir} is in use by another trainer ({holder.describe(age)}); wait for it "
                    f"to finish or stop it, or train into another run_dir=...; {gone}"
                )
            if _set_aside(path, holder, me):
                warn(f"took over the run lock of {run_dir} from {holder.describe(age)}: {why}")
        raise RunLockHeld(f"could not take the run lock {path}: other launches keep taking it; "
                          "start one trainer per run_dir")

    def check(self) -> None:
        """RunLockLost when another launch has taken or removed this lock (a forced takeover)."""
        if self._lost is not None:
            raise RunLockLost(f"the run lock {self.path} {self._lost}; this launch stops so that two trainers do "
                              "not write one run (its newest checkpoint is complete)")

    def release(self) -> None:
        """Remove the lock if it is still this launch's; stop refreshing it."""
        self._stop.set()
        self._thread.join(timeout=5)
        found = _read_holder(self.path)
        if found is not None and found[0].token == self.holder.token:
            self.path.unlink(missing_ok=True)

    def _refresh(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                found = _read_holder(self.path)
            except ConfigError:
                found = None
            if found is None or found[0].token != self.holder.token:
                taker = found[0].describe(found[1]) if found is not None else None
                self._lost = f"was taken over by {taker}" if taker else "was removed"
                return
            os.utime(self.path)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _stale_because(holder: LockHolder, age_s: float, stale_after_s: float, force: bool) -> Optional[str]:
    """Why `holder` no longer holds the run (None: it does)."""
    if force:
        return "run_lock.force=true"
    if holder.host == socket.gethostname():
        return None if process_is_running(holder.pid, holder.pid_start) else f"pid {holder.pid} is no longer running"
    if age_s > stale_after_s:
        return f"not refreshed for {age_s:.0f}s > run_lock.stale_after_s={stale_after_s:.0f}"
    return None


def _link_new(path: Path, holder: LockHolder) -> bool:
    """Create `path` holding `holder`'s record, atomically; False when a lock exists."""
    own = path.with_name(f"{path.name}.{holder.token}")
    own.write_text(json.dumps(asdict(holder)) + "\n")
    try:
        os.link(own, path)
        return True
    except FileExistsError:
        return False
    finally:
        own.unlink(missing_ok=True)


def _set_aside(path: Path, stale: LockHolder, me: LockHolder) -> bool:
    """Move the stale lock out of the way; True when it was the one judged stale (else it is put back)."""
    aside = path.with_name(f"{path.name}.stale-{me.token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another launch moved it first
        return False
    try:
        moved = _read_holder(aside)
        if moved is not None and moved[0].token == stale.token:
            return True
        try:  # a launch took the lock in between: give it back
            os.link(aside, path)
        except FileExistsError:
            pass
        return False
    finally:
        aside.unlink(missing_ok=True)
