"""Activation checkpointing in a training run: the run's policy, a stage's block over it, applied in
place between stages, and the same losses and gradient norms bit for bit as without it (CPU, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

from moe_lc.train.main import run_train_cli

FAST = [
    "curriculum.run=[ctx256,ctx1k]",
    "curriculum.stages.ctx256.steps=2",
    "curriculum.stages.ctx256.global_batch_tokens=1024",
    "curriculum.stages.ctx256.micro_batch=2",
    "curriculum.stages.ctx1k.steps=2",
    "curriculum.stages.ctx1k.global_batch_tokens=2048",
    "curriculum.stages.ctx1k.micro_batch=1",
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "checkpoint.at_stage_end=false",
    "logging.progress=none",
    "logging.tensorboard=false",
    "report.at_end=false",
    "threads=1",
]


def records(run_dir: Path) -> list[tuple[float, float]]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["loss"], r["grad_norm"]) for r in rows]


def test_stage_policies_train_the_same_steps(tmp_path, shared_corpus_cache):
    plain, checkpointed = tmp_path / "plain", tmp_path / "checkpointed"
    assert run_train_cli([*FAST, f"run_dir={plain}"]) == 0
    assert run_train_cli([
        *FAST, f"run_dir={checkpointed}", "activation_checkpointing.mode=selective",
        "+curriculum.stages.ctx1k.activation_checkpointing={mode: full, every: 2}",
    ]) == 0
    assert records(checkpointed) == records(plain) and len(records(plain)) == 4
    log = (checkpointed / "train.log").read_text()
    assert "activation checkpointing for stage ctx1k: full every 2" in log
    assert "reloading" not in log  # a policy change keeps the model
