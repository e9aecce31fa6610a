"""Exact resume: a run killed with SIGKILL (mid-training, and mid-save) and resumed with
resume=auto logs bitwise the same losses as an uninterrupted run, across a curriculum stage
boundary.

Every run is a separate `python -m moe_lc.cli train` process (fp32, CPU, one thread) on the
smoke recipe shrunk to two short stages: ctx256 (steps 1-4) then ctx1k (steps 5-7).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_lc.report import load_run

FAST = [
    "device=cpu",  # bitwise-exact resume: CUDA's atomic scatter-adds (the expert combine) are not deterministic
    "curriculum.run=[ctx256,ctx1k]",
    "curriculum.stages.ctx256.steps=4",
    "curriculum.stages.ctx256.global_batch_tokens=1024",
    "curriculum.stages.ctx256.micro_batch=2",
    "curriculum.stages.ctx1k.steps=3",
    "curriculum.stages.ctx1k.global_batch_tokens=2048",
    "curriculum.stages.ctx1k.micro_batch=1",
    "eval.sequences=1",
    "eval.passkey_documents=0",
    "checkpoint.keep_last=10",
    "logging.progress=lines",
    "logging.tensorboard=false",
    "report.at_end=false",
    "threads=1",
]
STEPS = 7
TIMEOUT = 240

# Runs the trainer with the checkpoint's COMPLETE marker write hanging at one step: a save
# whose tensors are all on disk but that never finished, to be killed right there.
HANG_IN_SAVE = """
import os, sys, time
import moe_lc.checkpoint.ondisk as ondisk
real = ondisk.write_marker
def hang(ckpt_dir, manifest):
    if manifest.get("step") == int(os.environ["HANG_AT_STEP"]):
        print("HANGING-IN-SAVE", flush=True)
        time.sleep(600)
    return real(ckpt_dir, manifest)
ondisk.write_marker = hang
from moe_lc.train.main import run_train_cli
sys.exit(run_train_cli(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["MOE_LC_CACHE"] = str(tmp_path_factory.getbasetemp() / "moe_lc_cache")
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "moe_lc.cli", "train", *FAST, *overrides]


def _run(env, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(*overrides), env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(run_dir: Path) -> dict[int, float]:
    """The run's losses as trained; metrics.jsonl itself holds every launch's records, each
    launch's steps strictly increasing from the step it started at."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    launches = (run_dir / "launches.jsonl").read_text().splitlines()
    starts = {r["launch"]: r["start_step"] for r in map(json.loads, launches)}
    for launch, start in starts.items():
        steps = [r["step"] for r in records if r["launch"] == launch]
        assert steps == list(range(start + 1, start + 1 + len(steps))), f"launch {launch} logged steps {steps}"
    return {r["step"]: r["loss"] for r in load_run(run_dir).steps}


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if "tmp" not in p.name)


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    _run(env, f"run_dir={run_dir}", "checkpoint.every=2")
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert _checkpoint_steps(run_dir) == [2, 4, 6, 7]
    return run_dir, losses


def _kill_when(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_training_then_resume_is_bitwise_exact(env, reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(f"run_dir={run_dir}", "checkpoint.every=2"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    _kill_when(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, "step 3 was logged")
    done = _checkpoint_steps(run_dir)
    assert done and max(done) < STEPS  # killed mid-run, after at least one checkpoint
    resumed = _run(env, f"run_dir={run_dir}", "checkpoint.every=2", "resume=auto")
    assert f"resuming at step {max(done)}" in resumed.stdout
    assert _losses(run_dir) == ref  # every step, bitwise, through the ctx256 -> ctx1k boundary


def test_sigkill_mid_save_leaves_the_previous_checkpoint_and_resume_is_exact(env, reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_IN_SAVE, *FAST, f"run_dir={run_dir}", "checkpoint.every=2"],
        env={**env, "HANG_AT_STEP": "4"}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    seen: list[str] = []

    def hanging() -> bool:
        line = proc.stdout.readline()
        seen.append(line)
        return "HANGING-IN-SAVE" in line

    _kill_when(proc, hanging, "the save of step 4 to hang")
    ckpts = run_dir / "checkpoints"
    assert [p for p in ckpts.iterdir() if ".tmp-" in p.name], "the interrupted save left no temp directory"
    assert _checkpoint_steps(run_dir) == [2]
    assert (ckpts / "latest").read_text().strip().endswith("step_00000002")
    resumed = _run(env, f"run_dir={run_dir}", "checkpoint.every=2", "resume=auto")
    assert "resuming at step 2" in resumed.stdout
    assert _losses(run_dir) == ref
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]  # the stale temp dir was cleaned up
