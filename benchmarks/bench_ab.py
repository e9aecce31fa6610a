"""Interleaved A/B runs of `moe-lc bench`: does a change of overrides make a whole step faster?

A step-level change worth ~1% is smaller than the spread between two bench calls (the first timed
step of a call runs 0.3-0.45 s slow on an H200, docs/performance.md §12.9), so one call per variant
cannot tell it. This runs the variants in turn, A B A B ..., each in a process of its own (a fresh
CUDA context and allocator, the same seed and batches), drops each run's first timed step, and
prints per variant the steady step times, their mean and spread, and the change against the first
variant with the run-to-run spread beside it; and the median of all its steady steps with its change,
which a one-off stall inside the timed steps (cuDNN building a plan for an attention length seen
for the first time: 1.2 s once in a run of 0.55 s steps on an H100) does not move:

    python benchmarks/bench_ab.py k3-small-8k --variant base= \\
        --variant router=model.moe.router_backend=triton --rounds 2 --steps 5 --warmup 3 [--out ab.json]

A variant is NAME=OVERRIDES (space-separated Hydra overrides, empty for the recipe as it is); a word
VAR=VALUE whose VAR is upper case is set in that variant's environment instead, which is how a
kernel's launch choices are tried in the whole step:

    python benchmarks/bench_ab.py k3-small-8k --variant base= \
        --variant conv64=MOE_LC_SHORT_CONV_TUNING=bwd_bt=64 --rounds 2 --steps 5 --warmup 3

A word @TREE runs that variant's `moe-lc` from the directory TREE (another checkout, with its
moe_lc/, kernels/ and recipes/), so a code change is timed against its own baseline in one call:

    git worktree add .base HEAD~1     # then carry .base to the GPU machine
    python benchmarks/bench_ab.py k3-small-8k --variant before=@.base --variant after= --rounds 2

`--profile` profiles each run after its timed steps and adds the share of a whole step in which the
GPU waits for the host: a change that removes kernels from a step bound by its host shows there,
not in the step (docs/performance.md §12.13).

The positional arguments are the recipe and overrides shared by all. Needs the devices the recipe
runs on; `python -m moe_lc.cli` must be importable (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=OVERRIDES (NAME= for none)")
    return name, overrides.split()


ENVIRONMENT_WORD = re.compile(r"[A-Z][A-Z0-9_]*=")  # Hydra's keys are the config's lower-case fields
PACKAGES = {"moe_lc": "moe_lc", "moe_lc_kernels": "kernels", "moe_lc_recipes": "recipes"}  # import name: folder


def variant_environment(words: list[str], scratch: Path) -> tuple[list[str], dict[str, str]]:
    """A variant's words as (Hydra overrides, environment of its run): VAR=VALUE with VAR upper case is
    set there; @TREE puts a shim in ``scratch`` first on PYTHONPATH, importing moe-lc's packages from TREE."""
    env, overrides = {}, []
    for word in words:
        if ENVIRONMENT_WORD.match(word):
            name, value = word.split("=", 1)
            env[name] = value
        elif word.startswith("@"):
            tree = Path(word[1:]).resolve()
            missing = [folder for folder in PACKAGES.values() if not (tree / folder).is_dir()]
            if missing:
                raise SystemExit(f"bench_ab: {word}: {tree} is not a moe-lc tree (no {', '.join(missing)}/)")
            shim = scratch / "tree"
            shim.mkdir()
            for name, folder in PACKAGES.items():
                (shim / name).symlink_to(tree / folder)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
            # and nothing before it: `python -m` puts the working directory first on sys.path, where the
            # repository root's own moe_lc/ would shadow the shim's (Python 3.11+)
            env["PYTHONSAFEPATH"] = "1"
        else:
            overrides.append(word)
    return overrides, env


def run_once(shared: list[str], words: list[str], steps: int, warmup: int, timeout: float,
             profile: bool = False) -> dict:
    """One `moe-lc bench` call in its own process, with the variant's overrides, environment and tree;
    its JSON report. ``profile``: with `--profile` (after the timed steps, which it does not change)."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides, env = variant_environment(words, Path(tmp))
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "moe_lc.cli", "bench", *shared, *overrides, "--steps", str(steps),
               "--warmup", str(warmup), "--json", str(out), *(["--profile"] if profile else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def steady_steps(report: dict) -> list[float]:
    """The timed steps after the first (which carries the run-order warm-up)."""
    steps = report["step_times_s"]
    return steps[1:] if len(steps) > 1 else steps


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    rows, base = [], None
    for name, reports in runs.items():
        means = [statistics.fmean(steady_steps(r)) for r in reports]
        mean = statistics.fmean(means)
        median = statistics.median(t for r in reports for t in steady_steps(r))
        row = dict(variant=name, run_means_s=means, mean_s=mean, spread_s=max(means) - min(means), median_s=median,
                   mfu=statistics.fmean(r["mfu"] or 0.0 for r in reports),
                   peak_memory_gib=max(r["peak_memory_gib"] for r in reports))
        idle = [r["profile"]["full_step_idle_share"] for r in reports
                if (r.get("profile") or {}).get("full_step_idle_share") is not None]
        if idle:  # --profile on a GPU: how much of a whole step waits for the host
            row["gpu_idle"] = statistics.fmean(idle)
        if base is None:
            base = row
        row["change"] = mean / base["mean_s"] - 1.0
        row["median_change"] = median / base["median_s"] - 1.0
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    idle = any("gpu_idle" in r for r in rows)
    lines = ["| variant | steady step means per run (s) | mean | spread | change vs first | median step | median's "
             "change | MFU | peak GiB |" + (" GPU idle |" if idle else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if idle else "")]
    for r in rows:
        runs = ", ".join(f"{m:.3f}" for m in r["run_means_s"])
        gpu_idle = (f" {100 * r['gpu_idle']:.1f}% |" if "gpu_idle" in r else " - |") if idle else ""
        lines.append(f"| {r['variant']} | {runs} | {r['mean_s']:.3f} | {r['spread_s']:.3f} | {100 * r['change']:+.2f}% "
                     f"| {r['median_s']:.3f} | {100 * r['median_change']:+.2f}% | {100 * r['mfu']:.1f}% "
                     f"| {r['peak_memory_gib']:.2f} |" + gpu_idle)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shared", nargs="+", help="the recipe and overrides every variant runs with")
    parser.add_argument("--variant", action="append", type=parse_variant, required=True,
                        help="NAME=OVERRIDES; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every variant, interleaved (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps a run (the first is dropped)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--out", default=None, help="write the reports and the table's numbers as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="profile each run after its timed steps (`moe-lc bench --profile`): on a GPU the "
                             "table adds the share of a whole step the GPU waits for the host")
    args = parser.parse_args(argv)
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"variant names must differ, got {names}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name, overrides in args.variant:
            print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            report = run_once(args.shared, overrides, args.steps, args.warmup, args.timeout, args.profile)
            runs[name].append(report)
            print(f"  steps {', '.join(f'{s:.3f}' for s in report['step_times_s'])}", file=sys.stderr, flush=True)
    rows = summarise(runs)
    print(format_rows(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, reports=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
