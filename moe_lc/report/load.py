"""A run's records as trained, and the per-stage numbers the report prints.

metrics.jsonl and eval.jsonl are only appended to: a launch that resumes from step s adds its
records after those of the launches before it, including the steps after s that it redoes.
The run as trained keeps a record only if no later launch started before its step, and of a
step's records the latest launch's; launches.jsonl lists the launches in order with the step
each started from (a launch missing there started just before its first logged step).
Records without a launch id (files written before launches were recorded) count as one
launch before all others, the last record of a step winning.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Optional, Union

from moe_lc.metrics.sinks import EVAL_FILE, LAUNCHES_FILE, METRICS_FILE, read_jsonl


@dataclass
class RunRecords:
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl as trained, by step
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl as trained, by step
    config: Optional[dict[str, Any]] = None
    launches: list[str] = field(default_factory=list)  # launch ids, in launch order
    redone: list[dict[str, Any]] = field(default_factory=list)  # step records a later launch replaced

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


def as_trained(
    records: list[dict[str, Any]], launches: list[tuple[str, int]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the records of the run as trained, sorted by step; the records later launches replaced).

    `launches`: (launch id, start step) in launch order. A record of a launch survives if no
    later launch started before its step; of the survivors of one step, the latest launch's
    last record wins. Records without a known launch id count as one launch before all others.
    """
    order = {launch: i for i, (launch, _) in enumerate(launches)}
    # cut[i + 1]: the earliest start of any launch after launch i (cut[0]: after the unknown one)
    cut = [math.inf] * (len(launches) + 1)
    for i in range(len(launches) - 1, -1, -1):
        cut[i] = min(cut[i + 1], launches[i][1])
    best: dict[int, tuple[int, int]] = {}  # step -> (launch index + 1, position in `records`)
    for position, record in enumerate(records):
        rank, step = order.get(record.get("launch"), -1) + 1, int(record["step"])
        if step <= cut[rank] and (rank, position) > best.get(step, (-1, -1)):
            best[step] = (rank, position)
    chosen = {position for _, position in best.values()}
    kept = [records[best[step][1]] for step in sorted(best)]
    return kept, [r for position, r in enumerate(records) if position not in chosen]


def load_run(run_dir: Union[str, Path]) -> RunRecords:
    """Records of `run_dir` as trained (see the module docstring); a clear error when it holds no metrics."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{metrics} not found: RUN_DIR must be the run_dir of a `moe-lc train` run (it holds {METRICS_FILE})"
        )
    step_records = [r for r in read_jsonl(metrics) if "step" in r and "loss" in r]
    starts = {r["launch"]: int(r["start_step"]) for r in read_jsonl(run_dir / LAUNCHES_FILE) if "launch" in r}
    for r in step_records:  # a launch missing from launches.jsonl started just before its first step
        if r.get("launch") is not None:
            starts.setdefault(r["launch"], int(r["step"]) - 1)
    launches = list(starts.items())
    steps, redone = as_trained(step_records, launches)
    evals, _ = as_trained([r for r in read_jsonl(run_dir / EVAL_FILE) if "step" in r], launches)
    config = None
    if (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text())
    return RunRecords(run_dir, steps, evals, config, [launch for launch, _ in launches], redone)


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
