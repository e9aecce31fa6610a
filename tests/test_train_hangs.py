"""A rank that stops responding is an error on the others within the collective timeout, and a
long run reports that it is alive and which rank holds the others back.

Two `python -m moe_lc.train` ranks (gloo, CPU) started by hand, as torchrun would, so that the
test owns their pids: rank 1 prepares its batches slowly (the straggler report names it), then
is stopped with SIGSTOP, as a hung GPU or NIC looks from outside. Rank 0 must end with exit
code 4 and one line naming itself, what it was doing and the timed-out wait, within the
configured 20 s (plus what it takes to reach the next collective and exit); the stopped rank
is resumed and killed by the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lc.train.health import Heartbeat, StragglerWatch

TIMEOUT_S = 20
SLOW_DATA_ON_RANK_1 = """
import sys, time
import moe_lc.train.data as data
real = data.StageData.micro_batches
def slow(self, consumed, dp_rank, pin_memory=False):
    if dp_rank == 1:
        time.sleep(1.5)
    return real(self, consumed, dp_rank, pin_memory)
data.StageData.micro_batches = slow
from moe_lc.train.main import run_train_cli
sys.exit(run_train_cli(sys.argv[1:]))
"""
TRAIN = [
    "device=cpu", "layout=dp2", "curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=500",
    "curriculum.stages.ctx256.global_batch_tokens=512", "curriculum.stages.ctx256.micro_batch=1",
    "eval.sequences=0", "eval.passkey_documents=0", "logging.progress=none", "logging.tensorboard=false",
    "report.at_end=false", "threads=1", f"distributed.collective_timeout_s={TIMEOUT_S}",
    "distributed.heartbeat_every_s=1", "distributed.straggler_every=3",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, what: str, procs, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank ended (rc {[p.poll() for p in procs]}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_stopped_rank_is_an_error_on_the_other_within_the_timeout(tmp_path, tmp_path_factory):
    run_dir = tmp_path / "run"
    env = {**os.environ, "MOE_LC_CACHE": str(tmp_path_factory.getbasetemp() / "moe_lc_cache"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    errs = [tmp_path / f"rank{r}.err" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", SLOW_DATA_ON_RANK_1, *TRAIN, f"run_dir={run_dir}"],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                         stderr=errs[r].open("w"))
        for r in range(2)
    ]
    log = run_dir / "train.log"
    try:
        _wait(lambda: log.exists() and "straggler: rank 1" in log.read_text(), "the straggler report", procs)
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        rc = procs[0].wait(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - stopped
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)
    err = errs[0].read_text()
    assert rc == 4, err[-3000:]
    assert TIMEOUT_S - 1 <= took <= TIMEOUT_S + 30, took
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    for needle in ("rank 0 of 2: a collective failed during step", f"Timed out waiting {TIMEOUT_S * 1000}ms",
                   f"distributed.collective_timeout_s={TIMEOUT_S}", "resume=auto"):
        assert needle in lines[0], (needle, lines[0])
    text = log.read_text()
    assert "heartbeat: step" in text
    straggler = next(line for line in text.splitlines() if "straggler:" in line)
    assert "rank 1 spent" in straggler and "of the other 1 ranks" in straggler
    assert not (run_dir / "run.lock").exists()  # released on the way out


def test_a_heartbeat_is_due_every_interval_and_reports_the_pace():
    now = [0.0]
    beat = Heartbeat(every_s=10.0, clock=lambda: now[0])
    lines = []
    for step in range(1, 8):
        now[0] += 3.0
        lines.append(beat.beat(step, 100, "ctx8k", 2.5, tokens=1000))
    assert [i + 1 for i, line in enumerate(lines) if line] == [4]  # 12 s after the start; then 9 s so far
    assert "step 4/100 (stage ctx8k), 4 steps in the last 12s (3.00s/step, 333 tokens/s)" in lines[3]
    assert Heartbeat(every_s=0.0).beat(1, 2, "s", 1.0, 1) is None


@pytest.mark.parametrize("times, named", [
    ([0.01, 0.01, 0.50, 0.01], 2),  # one rank's own work is 50x the others' median
    ([0.01, 0.012, 0.011, 0.01], None),  # within the ratio
    ([0.001, 0.002, 0.001, 0.001], None),  # 2x, but 1 ms: noise
    ([0.50, 0.50, 0.50, 0.60], None),  # every rank slow alike: nobody is singled out
])
def test_the_straggler_is_the_rank_far_above_the_median(times, named):
    watch = StragglerWatch(every=3, ratio=1.5, world_size=4)
    assert watch.add(1, [0.0] * 4) is None  # a launch's first step carries no times
    reports = [watch.add(step, times) for step in (2, 3, 4)]
    assert reports[:2] == [None, None]
    if named is None:
        assert reports[2] is None
    else:
        assert reports[2].startswith(f"straggler: rank {named} spent 0.500s per step")
        assert "50.0x the median 0.010s of the other 3 ranks" in reports[2]
