"""Two precisions of one recipe, same seed, same batches: loss curves side by side, tokens/s, and a
resume across the two (a checkpoint written in one precision, continued in the other).

    python benchmarks/compare_precisions.py --recipe proxy-8k --steps 200 --a precision=bf16 \\
        --b precision=fp8 --out results/precisions [--resume-at 100] [key=value ...]

Runs `moe-lc train` (as ``python -m moe_lc.cli train``) into ``--out``:

- ``a/`` and ``b/``: ``--steps`` steps each from the recipe's seed. The batches depend on the seed
  and the stage only, so both see the same tokens and their losses differ by precision alone.
- with ``--resume-at K``: each run is launched twice, to step K (saving there) and on to the end,
  and ``a_then_b/`` and ``b_then_a/`` resume the other run's checkpoint of step K in their own
  precision for ``--resume-steps`` steps. Their first loss is the same weights on the same batch
  in the other precision: it must equal the run's own next loss within that precision's noise.

No other checkpoint is written (``checkpoint.at_end=false``): a k3-small checkpoint is 52 GB, and
the ones of step K are removed at the end unless ``--keep-checkpoints``.

Prints the curves and writes ``summary.json`` and ``curves.png`` (matplotlib). The verdict is on
the curves' level, not on single steps (two trajectories that round differently differ step by
step by more than their trend does, most where a step is one row): the mean loss of each run over
the later half of the steps, whose relative difference is printed with its standard error (of the
paired step-by-step differences). Exit code 1 when that difference exceeds ``--tolerance`` or a
resumed loss differs from the continued one by more than ``--resume-tolerance``. The means over
windows of ``--window`` steps are printed and plotted too, to show where the curves part.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from moe_lc.report import load_run

QUIET = ["logging.progress=lines", "logging.tensorboard=false", "report.at_end=false", "eval.sequences=0",
         "eval.passkey_documents=0", "checkpoint.at_stage_end=false"]


def train(run_dir: Path, overrides: list[str], log: Path) -> None:
    """One ``moe-lc train`` launch; its console goes to ``log`` (appended), a failure is one line."""
    cmd = [sys.executable, "-m", "moe_lc.cli", "train", *overrides, f"run_dir={run_dir}"]
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"compare_precisions: `moe-lc train` exited {rc} for {run_dir.name}; see {log}")


def losses(run_dir: Path) -> dict[int, dict]:
    """Each step's record as trained (``load_run``: a relaunch's redone steps replace the earlier ones)."""
    return {r["step"]: r for r in load_run(run_dir).steps}


def run_pair_member(out: Path, name: str, precision: list[str], common: list[str], steps: int,
                    resume_at: Optional[int]) -> dict[int, dict]:
    run_dir = out / name
    log = out / f"{name}.log"
    if resume_at is None:
        train(run_dir, [*common, *precision, f"max_steps={steps}", "checkpoint.at_end=false"], log)
    else:  # saves at resume_at only, then continues from that checkpoint (exact resume)
        train(run_dir, [*common, *precision, f"max_steps={resume_at}"], log)
        train(run_dir, [*common, *precision, f"max_steps={steps}", "checkpoint.at_end=false", "resume=auto"], log)
    return losses(run_dir)


def window_means(curve: list[float], window: int) -> list[float]:
    return [statistics.fmean(curve[i:i + window]) for i in range(0, len(curve) - window + 1, window)]


def later_half_difference(curve_a: list[float], curve_b: list[float]) -> tuple[float, float]:
    """(mean of b - mean of a over the later half of the steps, relative to a's, and its standard
    error from the paired differences; 0 for a single step)."""
    start = len(curve_a) // 2
    later_a, diffs = curve_a[start:], [y - x for x, y in zip(curve_a[start:], curve_b[start:])]
    scale = abs(statistics.fmean(later_a)) or 1e-30
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return statistics.fmean(diffs) / scale, se / scale


def relative(x: float, ref: float) -> float:
    return abs(x - ref) / max(abs(ref), 1e-30)


def median_after(records: dict[int, dict], key: str, skip: int) -> Optional[float]:
    values = [r[key] for s, r in sorted(records.items()) if s > skip and r.get(key) is not None]
    return statistics.median(values) if values else None


def plot(path: Path, a: dict, b: dict, resumed: dict[str, dict], names: tuple[str, str], rel: list[float],
         windows: list[float], window: int) -> None:
    """The two curves (and the resumed losses) above; below, the relative difference per step and of
    the ``window``-step means, which is what the tolerance checks."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = sorted(set(a) & set(b))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[3, 1.4])
    top.plot(steps, [a[s]["loss"] for s in steps], label=names[0], lw=1.2)
    top.plot(steps, [b[s]["loss"] for s in steps], label=names[1], lw=1.2, alpha=0.85)
    for label, records in resumed.items():
        top.plot(sorted(records), [records[s]["loss"] for s in sorted(records)], "x", ms=7, label=label)
    top.set_ylabel("training loss")
    top.set_title(f"{names[1]} against {names[0]}, same seed and batches")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, rel, lw=0.8, color="gray", label="per step")
    bottom.plot([steps[i * window + window - 1] for i in range(len(windows))], windows, "o-", ms=3,
                label=f"of the {window}-step means")
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("step")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--a", default="precision=bf16", help="overrides of run a, space-separated")
    parser.add_argument("--b", default="precision=fp8", help="overrides of run b, space-separated")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume-at", type=int, default=None)
    parser.add_argument("--resume-steps", type=int, default=1)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the tokens/s median (compiles)")
    parser.add_argument("--tolerance", type=float, default=2e-2)
    parser.add_argument("--resume-tolerance", type=float, default=1e-2)
    parser.add_argument("--keep-checkpoints", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    if args.resume_at is not None and not 0 < args.resume_at < args.steps:
        parser.error(f"--resume-at {args.resume_at} must lie between 0 and --steps {args.steps}")
    names = (args.a, args.b)
    common = [f"recipe={args.recipe}", *QUIET, *overrides]
    args.out.mkdir(parents=True, exist_ok=True)

    a = run_pair_member(args.out, "a", args.a.split(), common, args.steps, args.resume_at)
    b = run_pair_member(args.out, "b", args.b.split(), common, args.steps, args.resume_at)
    resumed: dict[str, dict] = {}
    resume_rows = []
    if args.resume_at is not None:
        end = min(args.steps, args.resume_at + args.resume_steps)
        for name, source, precision, own in (("a_then_b", "a", args.b, a), ("b_then_a", "b", args.a, b)):
            ckpt = args.out / source / "checkpoints" / f"step_{args.resume_at:08d}"
            train(args.out / name, [*common, *precision.split(), f"max_steps={end}", "checkpoint.at_end=false",
                                    f"resume={ckpt}"], args.out / f"{name}.log")
            resumed[f"{source}'s step {args.resume_at} in {precision}"] = records = losses(args.out / name)
            first = args.resume_at + 1
            resume_rows.append(dict(run=name, step=first, resumed_loss=records[first]["loss"],
                                    continued_loss=own[first]["loss"],
                                    rel_diff=relative(records[first]["loss"], own[first]["loss"])))
        if not args.keep_checkpoints:
            for source in ("a", "b"):
                shutil.rmtree(args.out / source / "checkpoints", ignore_errors=True)

    steps = sorted(set(a) & set(b))
    curve_a, curve_b = [a[s]["loss"] for s in steps], [b[s]["loss"] for s in steps]
    rel = [relative(y, x) for x, y in zip(curve_a, curve_b)]
    window = min(args.window, len(steps))
    windows = [relative(y, x) for x, y in zip(window_means(curve_a, window), window_means(curve_b, window))]
    later, later_se = later_half_difference(curve_a, curve_b)
    tok_a, tok_b = (median_after(r, "tokens_per_s", args.skip) for r in (a, b))
    summary = dict(
        recipe=args.recipe, overrides=overrides, a=args.a, b=args.b, steps=steps,
        loss_a=curve_a, loss_b=curve_b,
        max_rel_diff_per_step=max(rel), window=window, max_rel_diff_of_window_means=max(windows),
        rel_diff_of_later_half_means=later, rel_diff_of_later_half_means_se=later_se,
        tokens_per_s_a=tok_a, tokens_per_s_b=tok_b,
        speedup_b_over_a=(tok_b / tok_a) if tok_a and tok_b else None,
        peak_memory_gib_a=max((r.get("peak_memory_gib") or 0.0) for r in a.values()),
        peak_memory_gib_b=max((r.get("peak_memory_gib") or 0.0) for r in b.values()),
        resume=resume_rows, tolerance=args.tolerance, resume_tolerance=args.resume_tolerance,
    )
    plot(args.out / "curves.png", a, b, resumed, names, rel, windows, window)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    print(f"{'step':>5} {'loss ' + names[0]:>24} {'loss ' + names[1]:>24} {'rel diff':>9}")
    for s, r in zip(steps, rel):
        print(f"{s:>5} {a[s]['loss']:>24.5f} {b[s]['loss']:>24.5f} {r:>9.2e}")
    speed = f" ({summary['speedup_b_over_a']:.2f}x)" if summary["speedup_b_over_a"] else ""
    print(f"tokens/s (median after step {args.skip}): {names[0]} {tok_a or 0:,.0f}, {names[1]} {tok_b or 0:,.0f}{speed}")
    print(f"loss: mean over steps {steps[len(steps) // 2]}-{steps[-1]} differs by {later:+.2e} relative "
          f"(standard error {later_se:.1e}; tolerance {args.tolerance:g}); max rel diff {max(rel):.2e} per step, "
          f"{max(windows):.2e} of {window}-step means")
    for row in resume_rows:
        print(f"resume {row['run']}: step {row['step']} loss {row['resumed_loss']:.5f} against "
              f"{row['continued_loss']:.5f} continued, rel diff {row['rel_diff']:.2e} "
              f"(tolerance {args.resume_tolerance:g})")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'curves.png'}")
    ok = abs(later) <= args.tolerance and all(r["rel_diff"] <= args.resume_tolerance for r in resume_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
