"""Elastic restarts and the launchers' exit codes.

- Kill loop (scripts/kill_loop.py, 2 kills here; `--count 10` is the full check): a 2-rank run
  under `torchrun --max-restarts` loses a random rank to SIGKILL, once between saves and once
  during a save; torchrun restarts the job, which resumes from the newest complete checkpoint
  (taking over the run lock of a killed rank 0), and the losses and gradient norms of every
  step equal an uninterrupted 2-rank run's bitwise.
- The launch scripts return the trainer's exit code, which torchrun alone would turn into 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path_factory) -> dict[str, str]:
    return {**os.environ, "MOE_LC_CACHE": str(tmp_path_factory.getbasetemp() / "moe_lc_cache"),
            "OMP_NUM_THREADS": "1"}


def test_random_sigkills_under_torchrun_restarts_resume_bitwise(tmp_path, tmp_path_factory):
    out = tmp_path / "kill_loop.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "kill_loop.py"), "--count", "2", "--workdir", str(tmp_path),
         "--json", str(out)],
        env=_env(tmp_path_factory), capture_output=True, text=True, timeout=280,
    )
    log = tmp_path / "torchrun.log"
    why = proc.stdout[-2000:] + proc.stderr[-2000:] + (log.read_text()[-4000:] if log.exists() else "")
    assert out.exists(), f"kill_loop.py exited {proc.returncode} without its result:\n{why}"
    result = json.loads(out.read_text())
    assert proc.returncode == 0, why
    assert result["bitwise_equal"] and result["torchrun_rc"] == 0
    assert len(result["kills"]) == 2 and result["steps"] == result["reference_steps"]
    for kill in result["kills"]:  # a checkpoint every step: a kill costs at most the step it hit
        assert kill["resumed_from"] is not None and 0 <= kill["steps_lost"] <= 1, kill


def test_the_launch_script_exits_with_the_trainers_code(tmp_path, tmp_path_factory):
    env = {**_env(tmp_path_factory), "NPROC": "1", "MAX_RESTARTS": "0"}
    proc = subprocess.run(["bash", str(REPO / "launch" / "train_single_node.sh"), "curriculum.run=[ctx99]",
                           f"run_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]  # bad input; torchrun says 1
    assert "unknown stage 'ctx99'" in proc.stderr
