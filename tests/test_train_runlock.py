"""One trainer per run directory: a second trainer on a run_dir that a live trainer holds is
refused before it writes anything; a lock whose holder is gone (dead pid on this host, an old
lock from another host, run_lock.force) is taken over with a warning; a launch whose lock was
taken over stops at its next check."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import pytest

import moe_lc.train.trainer as trainer_module
from moe_lc.train.main import run_train_cli
from moe_lc.train.runlock import LOCK_FILE, LockHolder, RunLock, RunLockHeld, RunLockLost, process_start_ticks

pytestmark = pytest.mark.usefixtures("shared_corpus_cache")

ONE_STEP = [
    "curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=1", "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2", "eval.sequences=0", "eval.passkey_documents=0", "logging.progress=none",
    "logging.tensorboard=false", "report.at_end=false", "threads=1",
]


def _write_lock(run_dir: Path, holder: LockHolder, age_s: float = 0.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(asdict(holder)))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def _holder(pid: int, host: Optional[str] = None) -> LockHolder:
    return LockHolder(host or socket.gethostname(), pid, process_start_ticks(pid), time.time() - 5,
                      "moe-lc train run_dir=x", "f" * 32)


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_trainer_on_a_held_run_dir_refuses_at_start_and_writes_nothing(tmp_path, capsys, live_pid):
    run_dir = tmp_path / "run"
    lock = _write_lock(run_dir, _holder(live_pid))
    before = lock.read_text()
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in (f"run_dir {run_dir} is in use by another trainer", f"pid {live_pid} on {socket.gethostname()}",
                   "moe-lc train run_dir=x", "run_lock.force=true"):
        assert needle in err, (needle, err)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # no log, metrics, config or checkpoint
    assert lock.read_text() == before


def test_a_running_trainer_holds_the_lock_and_releases_it(tmp_path, capsys, monkeypatch):
    run_dir, seen = tmp_path / "run", {}
    real_run = trainer_module.Trainer.run

    def run(self, wall_start):
        seen["holder"] = json.loads((run_dir / LOCK_FILE).read_text())
        seen["second"] = run_train_cli([*ONE_STEP, f"run_dir={run_dir}"])  # a second trainer, meanwhile
        return real_run(self, wall_start)

    monkeypatch.setattr(trainer_module.Trainer, "run", run)
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}"]) == 0
    assert seen["second"] == 2 and "is in use by another trainer" in capsys.readouterr().err
    assert seen["holder"]["pid"] == os.getpid() and seen["holder"]["host"] == socket.gethostname()
    assert not (run_dir / LOCK_FILE).exists()  # released at exit


def test_a_stale_lock_of_a_dead_pid_is_taken_over_with_a_warning(tmp_path, dead_pid):
    run_dir = tmp_path / "run"
    _write_lock(run_dir, _holder(dead_pid))
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}"]) == 0
    log = (run_dir / "train.log").read_text()
    assert f"warning: took over the run lock of {run_dir} from pid {dead_pid}" in log
    assert f"pid {dead_pid} is no longer running" in log
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / LOCK_FILE).exists()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path, live_pid):
    holder = replace(_holder(live_pid), pid_start=process_start_ticks(live_pid) - 1)  # "started earlier"
    _write_lock(tmp_path, holder)
    notes: list[str] = []
    RunLock.acquire(tmp_path, stale_after_s=600, warn=notes.append).release()
    assert notes and "is no longer running" in notes[0]


def test_another_hosts_lock_is_stale_only_when_old_or_forced(tmp_path):
    _write_lock(tmp_path, _holder(1, host="elsewhere"), age_s=60)
    with pytest.raises(RunLockHeld, match="pid 1 on elsewhere"):
        RunLock.acquire(tmp_path, stale_after_s=600)
    notes: list[str] = []
    RunLock.acquire(tmp_path, stale_after_s=600, force=True, warn=notes.append).release()
    assert "run_lock.force=true" in notes[0]
    _write_lock(tmp_path, _holder(1, host="elsewhere"), age_s=700)
    RunLock.acquire(tmp_path, stale_after_s=600, warn=notes.append).release()
    assert "not refreshed for 700s > run_lock.stale_after_s=600" in notes[1]


def test_a_holder_whose_lock_was_taken_over_stops_at_its_next_check(tmp_path):
    first = RunLock.acquire(tmp_path, stale_after_s=0.2)  # refreshed every 0.05 s
    first.check()
    second = RunLock.acquire(tmp_path, stale_after_s=0.2, force=True)
    time.sleep(0.3)
    with pytest.raises(RunLockLost, match="was taken over by pid"):
        first.check()
    first.release()  # leaves the other launch's lock alone
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == second.holder.token
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_holder_refreshes_its_lock(tmp_path):
    lock = RunLock.acquire(tmp_path, stale_after_s=0.2)
    path = tmp_path / LOCK_FILE
    os.utime(path, (time.time() - 100, time.time() - 100))
    time.sleep(0.2)
    assert time.time() - path.stat().st_mtime < 1.0
    lock.release()
