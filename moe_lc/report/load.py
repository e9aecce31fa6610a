"""A run's records, and the per-stage numbers the report prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Optional, Union

from moe_lc.metrics.sinks import read_jsonl


@dataclass
class RunRecords:
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, sorted by step, last record wins
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl
    config: Optional[dict[str, Any]] = None

    def stages(self) -> list[str]:
        """Stage names in the order they were trained."""
        seen: list[str] = []
        for r in self.steps:
            if r["stage"] not in seen:
                seen.append(r["stage"])
        return seen

    def stage_starts(self) -> list[tuple[int, str]]:
        """(first step, stage name) for each stage, for boundary markers."""
        out, last = [], None
        for r in self.steps:
            if r["stage"] != last:
                out.append((r["step"], r["stage"]))
                last = r["stage"]
        return out


def load_run(run_dir: Union[str, Path]) -> RunRecords:
    """Records of `run_dir`; a clear error when it holds no metrics."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{metrics} not found: RUN_DIR must be the run_dir of a `moe-lc train` run (it holds metrics.jsonl)"
        )
    by_step: dict[int, dict[str, Any]] = {}
    for r in read_jsonl(metrics):
        if "step" in r and "loss" in r:
            by_step[int(r["step"])] = r
    config = None
    if (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text())
    return RunRecords(run_dir, [by_step[s] for s in sorted(by_step)], read_jsonl(run_dir / "eval.jsonl"), config)


def stage_summary(run: RunRecords) -> list[dict[str, Any]]:
    """Per stage: steps, tokens, median tokens/s and MFU (first step of a stage excluded when possible), losses."""
    out = []
    for name in run.stages():
        recs = [r for r in run.steps if r["stage"] == name]
        timed = recs[1:] if len(recs) > 1 else recs  # the first step pays for warm-up
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        ev = [e for e in run.evals if e.get("stage") == name]
        out.append({
            "stage": name,
            "seq_len": recs[0]["seq_len"],
            "steps": len(recs),
            "first_step": recs[0]["step"],
            "last_step": recs[-1]["step"],
            "tokens": sum(r["tokens"] for r in recs),
            "tokens_per_s": median(r["tokens_per_s"] for r in timed),
            "mfu": median(mfus) if mfus else None,
            "first_loss": recs[0]["loss"],
            "last_loss": recs[-1]["loss"],
            "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in recs),
            "max_maxvio": max(r.get("maxvio", 0.0) for r in recs),
            "eval_loss": ev[-1].get("loss") if ev else None,
            "passkey_accuracy": ev[-1].get("passkey_accuracy") if ev else None,
        })
    return out
