"""The padded attention's plans built before a stage's first step (moe_lc.train.attention_plans): the
rows it runs meet every length a stage's documents pad to, at the stage's own row shape, through the
padded path, and leave the model's weights and gradients as they were."""

from __future__ import annotations

import pytest
import torch

from moe_lc.model.init import build_model
from moe_lc.ops import attention
from moe_lc.ops.attention import PADDED_MIN_MEAN_LENGTH, padded_length, padded_lengths, resolve_backend
from moe_lc.presets import get_preset
from moe_lc.train.attention_plans import attention_layer, prebuild_attention_plans, prebuild_rows, run_rows
from moe_lc.train.runtime import Runtime


def test_padded_lengths_are_every_length_a_document_pads_to():
    for up_to in (1, 511, 512, 513, 8192, 20000, 65536):
        expected = sorted({padded_length(n) for n in range(1, up_to + 1)})
        assert padded_lengths(up_to) == expected


@pytest.mark.parametrize("max_document,row_tokens", [(8192, 16384), (8192, 8192), (8192, 32768), (65536, 65536),
                                                     (4608, 9216)])
def test_the_rows_meet_every_padded_length_at_the_stage_row_shape(max_document, row_tokens):
    rows = prebuild_rows(max_document, row_tokens)
    # met by a document that is padded (a copy of its own layout), not one exactly that long
    met = {padded_length(n) for docs in rows for n in docs if padded_length(n) > n}
    assert set(padded_lengths(max_document)) <= met
    for docs in rows:
        assert sum(docs) == row_tokens and max(docs) <= max_document and min(docs) > 0
        mean = row_tokens / len(docs)
        assert mean >= PADDED_MIN_MEAN_LENGTH  # what "auto" runs padded (on CUDA)
        assert resolve_backend("auto", torch.device("cpu"), True, mean_document_length=mean) == "torch"


def test_no_row_where_auto_never_pads():
    assert prebuild_rows(2048, 4096) == []  # documents of up to 2,048 tokens never average more


def test_running_the_rows_goes_through_the_padded_loop_and_leaves_the_weights_alone(monkeypatch):
    cfg = get_preset("tiny")
    model = build_model(cfg, device="cpu", seed=0)
    layer = attention_layer(model)
    assert layer is not None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lengths = []

    def padded_sdpa(q, k, v, scale, length, real=attention._causal_sdpa):
        lengths.append(length)
        return real(q, k, v, scale, length)

    # on a CPU "auto" runs the plain loop; ask for the padded one, as a CUDA device would run it
    monkeypatch.setattr(attention, "_causal_sdpa", padded_sdpa)
    monkeypatch.setattr(attention, "_order", lambda device, has_documents: ("padded",))
    runtime = Runtime(0, 1, 0, torch.device("cpu"), torch.float32, False)
    rows = [(511, 3585), (1023, 3073)]  # documents that average 2,048 tokens: "auto" pads them
    run_rows(layer, rows, runtime)
    assert set(lengths) == {512, 1024, 3584, 4096}
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_nothing_runs_on_a_cpu_or_under_context_parallelism():
    model = build_model(get_preset("tiny"), device="cpu", seed=0)
    runtime = Runtime(0, 1, 0, torch.device("cpu"), torch.float32, False)
    assert prebuild_attention_plans(model, 8192, 16384, runtime) == (0, 0.0)
    assert prebuild_attention_plans(model, 8192, 16384, runtime, context_parallel=True) == (0, 0.0)


def test_the_trainer_builds_each_stage_s_plans_before_its_first_step_and_says_so(monkeypatch, tmp_path):
    """Wiring: every stage that trains asks for its plans with its own plan (seq_len, micro-batch), once and
    before its first step, and train.log says what ran right after the stage's line."""
    from moe_lc.train import trainer
    from moe_lc.train.main import run_train_cli

    asked = []

    def fake(model, plan, runtime):
        asked.append((plan.name, plan.seq_len, plan.micro_batch))
        return 16, 1.25

    monkeypatch.setattr(trainer, "prebuild_stage_attention_plans", fake)
    args = ["recipe=smoke", f"run_dir={tmp_path}", "eval.sequences=0", "eval.passkey_documents=0", "logging.progress=none",
            "logging.tensorboard=false", "report.at_end=false", "threads=1", "checkpoint.at_stage_end=false",
            "checkpoint.at_end=false", *(f"curriculum.stages.{name}.steps=1" for name in ("ctx256", "ctx1k", "ctx4k", "ctx16k"))]
    assert run_train_cli(args) == 0
    lines = [line.split(" ", 2)[2] for line in (tmp_path / "train.log").read_text().splitlines()]
    stage_lines = [i for i, line in enumerate(lines) if line.startswith("stage ")]
    assert len(stage_lines) == len(asked) == 4  # the smoke curriculum's stages, each once
    for i, (name, seq_len, micro_batch) in zip(stage_lines, asked):
        assert lines[i].startswith(f"stage {name}: seq_len {seq_len},") and f"micro-batch {micro_batch} x" in lines[i]
        assert lines[i + 1] == "attention: cuDNN plans for 16 padded document lengths built before the first step (1.2s)"
