"""The README's main command end to end: `moe-lc train` (the smoke recipe, here with fewer and
shorter steps) on CPU, on the embedded default corpus, printing progress and writing
checkpoints, metrics, evals, TensorBoard events and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_lc.model.accounting import training_flops_per_token
from moe_lc.presets import get_preset

SHORTER = [
    "curriculum.stages.ctx256.steps=2", "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2",
    "curriculum.stages.ctx1k.steps=1", "curriculum.stages.ctx1k.global_batch_tokens=1024",
    "curriculum.stages.ctx1k.micro_batch=1",
    "curriculum.stages.ctx4k.steps=1", "curriculum.stages.ctx4k.global_batch_tokens=4096",
    "curriculum.stages.ctx16k.seq_len=8192", "curriculum.stages.ctx16k.global_batch_tokens=8192",
    "curriculum.stages.ctx16k.steps=1",
    "eval.sequences=1", "eval.passkey_documents=1", "checkpoint.every=2", "threads=1",
]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "MOE_LC_CACHE": str(tmp_path_factory.getbasetemp() / "moe_lc_cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "moe_lc.cli", "train", *SHORTER, f"run_dir={run_dir}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc.stdout


def test_smoke_recipe_runs_all_stages_and_prints_progress(smoke_run):
    run_dir, out = smoke_run
    for stage in ("ctx256", "ctx1k", "ctx4k", "ctx16k"):
        assert f"stage {stage}:" in out and f"stage {stage} end" in out
    assert "tok/s" in out and "ETA" in out and "done: step 5/5" in out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["seq_len"] for r in records] == [256, 256, 1024, 4096, 8192]
    for r in records:
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_memory_gib", "maxvio"):
            assert isinstance(r[key], float), key
        assert len(r["maxvio_per_layer"]) == 4 and len(r["expert_loads"]) == 4  # tiny: 4 MoE layers
        assert all(sum(layer) == 2 * r["tokens"] for layer in r["expert_loads"])  # top-2 of every token
        # MFU's FLOPs count attention within the step's documents (never more keys than one document per row)
        assert 0 < r["keys_per_token"] <= (r["seq_len"] + 1) / 2
        assert r["flops_per_token"] == pytest.approx(
            training_flops_per_token(get_preset("tiny"), r["seq_len"], r["keys_per_token"]), rel=1e-12)
    assert records[-1]["loss"] < records[0]["loss"]
    lrs = [r["lr"] for r in records]  # one schedule: warmup to the peak, then cosine down to min_lr
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(3e-4) and lrs == sorted(lrs, reverse=True)


def test_smoke_writes_checkpoints_evals_tensorboard_and_report(smoke_run):
    run_dir, _ = smoke_run
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1] == "step_00000005" and len(ckpts) == 2  # keep_last=2
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in evals] == ["ctx256", "ctx1k", "ctx4k", "ctx16k"]
    assert all(0.0 <= e["passkey_accuracy"] <= 1.0 and e["buckets"][0]["lo"] == 0 for e in evals)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for png in ("loss.png", "throughput.png", "expert_load.png", "loss_by_position.png"):
        assert (run_dir / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ctx16k" in (run_dir / "report" / "summary.md").read_text()


def test_rerun_with_resume_auto_has_nothing_left_to_do(smoke_run, tmp_path_factory, monkeypatch, capsys):
    from moe_lc.train.main import run_train_cli

    run_dir, _ = smoke_run
    monkeypatch.setenv("MOE_LC_CACHE", str(tmp_path_factory.getbasetemp() / "moe_lc_cache"))
    assert run_train_cli([*SHORTER, f"run_dir={run_dir}", "report.at_end=false"]) == 0
    assert "nothing to train" in capsys.readouterr().out
