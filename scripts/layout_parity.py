"""How far 2-rank layouts drift from one process: the smoke recipe's first stage (10 steps of 4K
tokens, the tiny model, fp32 on CPU, gloo) trained by one process and by 2 ranks under each
layout, and the relative difference of every step's loss and gradient norm.

    python scripts/layout_parity.py                       # dp2, dp2 + zero1, tp2, dp2-ep2
    python scripts/layout_parity.py --layouts tp2 --json parity.json

The same global batches in every run (docs/training.md, "Data"); only the order of floating-point
sums differs (over ranks, over shards), and Adam's division by sqrt(v) amplifies it step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

STAGE = ["curriculum.run=[ctx256]", "eval.sequences=0", "eval.passkey_documents=0", "logging.progress=none",
         "logging.tensorboard=false", "report.at_end=false", "threads=1"]
LAYOUTS = {
    "dp2": ["layout=dp2"],
    "dp2 zero1": ["layout=dp2", "layout.dp_mode=zero1"],
    "tp2": ["layout=tp2"],
    "dp2-ep2": ["layout=dp2-ep2"],
}


def records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def train(run_dir: Path, overrides: list[str], ranks: int, env: dict[str, str]) -> dict[int, dict]:
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else [])
    subprocess.run([sys.executable, *launcher, "-m", "moe_lc.train", *STAGE, *overrides, f"run_dir={run_dir}"],
                   env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return records(run_dir)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="moe_lc_parity_") as tmp:
        one = train(Path(tmp) / "one", [], 1, env)
        for name in args.layouts:
            two = train(Path(tmp) / name.replace(" ", "_"), LAYOUTS[name], 2, env)
            out[name] = {key: {step: relative(two[step][key], one[step][key]) for step in sorted(one)}
                         for key in ("loss", "grad_norm")}
    print("relative difference to one process, per step (loss / grad norm):")
    for name, diffs in out.items():
        cells = "  ".join(f"{s}: {diffs['loss'][s]:.1e}/{diffs['grad_norm'][s]:.1e}" for s in diffs["loss"])
        print(f"  {name:10s} {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
