"""Kill loop: random SIGKILLs of one rank of a 2-rank run under `torchrun --max-restarts`, which
restarts the job each time; the job resumes from its newest complete checkpoint (resume=auto)
and must end with bitwise the losses of an uninterrupted run.

    python scripts/kill_loop.py --count 10            # the full check (several minutes on a CPU)
    python scripts/kill_loop.py --count 2 --json out.json

CPU, gloo, the tiny model on 4 + 3 x count short ctx256 steps, a checkpoint after every step. Each kill waits
until the (re)started job has logged a step and then a random 0-4 s, and hits a random rank
then or (every other kill) at the next moment a checkpoint is being written (a save's temp
directory exists).
Prints, per kill, the step logged before it, the step the next launch resumed from and the
steps lost (redone); exit code 0 when every step's loss and gradient norm equal the
uninterrupted run's bitwise, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

TRAIN = [
    "device=cpu",  # the gloo CPU check also on a machine with GPUs
    "layout=dp2",
    "curriculum.run=[ctx256]",
    "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=1",
    "checkpoint.every=1",
    "checkpoint.keep_last=3",
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "logging.progress=lines",
    "logging.tensorboard=false",
    "report.at_end=false",
    "threads=1",
    "distributed.collective_timeout_s=60",
]
LAUNCH_TIMEOUT_S = 900


def steps_for(count: int) -> int:
    """Enough steps that every kill finds the job still training (a kill costs a step or so)."""
    return 4 + 3 * count


def torchrun(run_dir: Path, max_restarts: int, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "-m", "moe_lc.train", *TRAIN,
            f"curriculum.stages.ctx256.steps={steps}", f"run_dir={run_dir}"]


def environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "MOE_LC_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def last_records(run_dir: Path) -> dict[int, dict]:
    """The last record of each step in metrics.jsonl (a torn last line is skipped)."""
    out: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[record["step"]] = record
    return out


def workers(parent: int) -> list[int]:
    """Pids of `parent`'s children (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return sorted(found)


def metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def launches(run_dir: Path) -> list[str]:
    """The banner line of every launch so far, in order (train.log)."""
    log = run_dir / "train.log"
    return [line for line in log.read_text().splitlines() if "moe-lc train: recipe" in line] if log.exists() else []


def saving(run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(".tmp-" in p.name for p in ckpts.iterdir())


def wait_for(condition, proc: subprocess.Popen, deadline: float, poll: float = 0.01) -> bool:
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def kill_loop(count: int, seed: int, workdir: Path, cache: Path) -> dict:
    rng = random.Random(seed)
    env = environment(cache)
    reference_dir, killed_dir = workdir / "reference", workdir / "killed"
    t0 = time.monotonic()
    subprocess.run(torchrun(reference_dir, 0, steps_for(count)), env=env, check=True, timeout=LAUNCH_TIMEOUT_S,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reference_s = time.monotonic() - t0
    reference = last_records(reference_dir)

    killed_dir.mkdir(parents=True, exist_ok=True)
    output = (workdir / "torchrun.log").open("w")  # every launch's console and torchrun's own lines
    proc = subprocess.Popen(torchrun(killed_dir, count + 2, steps_for(count)), env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    kills: list[dict] = []
    try:
        for i in range(count):
            # the (re)started job is up and training: its banner is logged, then a step after it
            if not wait_for(lambda: len(launches(killed_dir)) > len(kills), proc, deadline):
                break
            logged = metric_lines(killed_dir)
            if not wait_for(lambda: metric_lines(killed_dir) > logged, proc, deadline):
                break
            time.sleep(rng.uniform(0.0, 4.0))
            if i % 2 == 1 and not wait_for(lambda: saving(killed_dir), proc, deadline, poll=0.002):
                break
            pids = workers(proc.pid)
            if not pids or proc.poll() is not None:
                break
            rank = rng.randrange(len(pids))
            step = max(last_records(killed_dir), default=0)
            in_save = saving(killed_dir)
            os.kill(pids[rank], signal.SIGKILL)
            kills.append({"rank": rank, "step_logged": step, "during_save": in_save, "at_s": time.monotonic() - t0})
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        output.close()
    got = last_records(killed_dir)
    resumed = [_resumed_step(line) for line in launches(killed_dir)[1:]]
    for kill, step in zip(kills, resumed):
        kill["resumed_from"] = step
        kill["steps_lost"] = None if step is None else kill["step_logged"] - step
    mismatched = [s for s in reference if s not in got or (got[s]["loss"], got[s]["grad_norm"])
                  != (reference[s]["loss"], reference[s]["grad_norm"])]
    return {"count": count, "kills": kills, "torchrun_rc": rc, "steps": sorted(got), "reference_steps": sorted(reference),
            "mismatched_steps": mismatched, "bitwise_equal": rc == 0 and not mismatched and sorted(got) == sorted(reference),
            "reference_s": reference_s, "total_s": time.monotonic() - t0}


def _resumed_step(banner: str) -> Optional[int]:
    if "resuming at step" not in banner:
        return 0 if "fresh start" in banner else None
    return int(banner.split("resuming at step", 1)[1].split(",")[0])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10, help="SIGKILLs (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the two runs go (default: a temp dir, removed)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moe_lc_kill_loop_") as tmp:
        workdir = Path(args.workdir or tmp)
        cache = Path(os.environ.get("MOE_LC_CACHE", workdir / "cache"))
        result = kill_loop(args.count, args.seed, workdir, cache)
    for i, kill in enumerate(result["kills"], 1):
        where = "during a save" if kill["during_save"] else "between saves"
        print(f"kill {i}: rank {kill['rank']} at step {kill['step_logged']} ({where}); resumed from step "
              f"{kill.get('resumed_from')}, {kill.get('steps_lost')} steps lost")
    verdict = "bitwise equal to" if result["bitwise_equal"] else "DIFFERENT from"
    print(f"{len(result['kills'])} kills, torchrun exit {result['torchrun_rc']}: losses {verdict} the "
          f"uninterrupted run (steps {result['steps']}; mismatched {result['mismatched_steps']}); "
          f"{result['total_s']:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["bitwise_equal"] and len(result["kills"]) == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
