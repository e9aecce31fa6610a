"""Checkpoints are portable across batch splits and stages: a checkpoint loads under another
micro-batch size, and starts another curriculum stage (init_from). In-process runs of the
smoke recipe shrunk to ctx256 (steps 1-4) then ctx1k (steps 5-7), in float64 on CPU whatever the
machine: runs that differ only in summation order then agree to rounding (~1e-16; in fp32 Adam's
first steps grow the rounding differences by orders of magnitude, in bf16 on a GPU by far more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_lc.train.main import run_train_cli

FAST = [
    "device=cpu",
    "precision=fp64",
    "curriculum.run=[ctx256,ctx1k]",
    "curriculum.stages.ctx256.steps=4",
    "curriculum.stages.ctx256.global_batch_tokens=1024",
    "curriculum.stages.ctx256.micro_batch=2",
    "curriculum.stages.ctx1k.steps=3",
    "curriculum.stages.ctx1k.global_batch_tokens=2048",
    "curriculum.stages.ctx1k.micro_batch=1",
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "checkpoint.keep_last=10",
    "logging.progress=none",
    "logging.tensorboard=false",
    "report.at_end=false",
]


pytestmark = pytest.mark.usefixtures("shared_corpus_cache")

RTOL = 1e-10  # float64 runs that differ only in summation order (~1e-16 apart)


def _train(*overrides: str) -> None:
    assert run_train_cli([*FAST, *overrides]) == 0


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    _train(f"run_dir={run_dir}", "checkpoint.every=2")
    return run_dir, _losses(run_dir)


def test_checkpoint_loads_with_another_micro_batch_size(reference, tmp_path):
    ref_dir, ref = reference
    # the same global batch, as 4 micro-batches of 1 sequence instead of 2 of 2
    _train(f"run_dir={tmp_path}", f"resume={ref_dir / 'checkpoints' / 'step_00000002'}",
           "curriculum.stages.ctx256.micro_batch=1")
    got = _losses(tmp_path)
    assert sorted(got) == list(range(3, 8))
    for step, loss in got.items():  # only the order of summation differs
        assert loss == pytest.approx(ref[step], rel=RTOL)


def test_checkpoint_starts_another_stage(reference, tmp_path, capsys):
    ref_dir, ref = reference
    _train(f"run_dir={tmp_path}", f"init_from={ref_dir / 'checkpoints' / 'step_00000004'}",
           "curriculum.run=[ctx1k]", "curriculum.stages.ctx1k.micro_batch=2", "logging.progress=lines")
    assert "initialised the model from" in capsys.readouterr().out
    got = _losses(tmp_path)
    assert sorted(got) == [5, 6, 7]
    # Step 5's loss comes before any update: the same weights and QB biases on the same ctx1k data.
    assert got[5] == pytest.approx(ref[5], rel=RTOL)
    # A fresh optimizer from there on: the run continues and learns, but is a different run.
    assert got[7] < got[5]
