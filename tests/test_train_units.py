"""Pieces of the trainer checked against direct computations: data split over ranks and
micro-batches, position buckets, loss weighting, progress, sinks, MFU, the trainer state a
checkpoint records and where a launch starts."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

from moe_lc.checkpoint import CheckpointCorruptError, CheckpointManager
from moe_lc.config import ConfigError
from moe_lc.metrics import Progress, mfu, read_jsonl
from moe_lc.metrics.sinks import JsonlWriter, wandb_mode
from moe_lc.train.curriculum import plan_curriculum
from moe_lc.train.data import StageData
from moe_lc.train.evaluation import bucket_losses, merge_buckets, position_buckets, positions_in_documents, token_losses
from moe_lc.train.recipes import compose_recipe
from moe_lc.train.resume import CHECKPOINT_FORMAT, RunPosition, Start, TrainerState, find_start, read_trainer_state


def test_micro_batches_cover_each_global_batch_once_for_any_split():
    for layout, world in (("single", 1), ("dp2", 2)):
        cfg = compose_recipe("smoke", [f"layout={layout}", "curriculum.stages.ctx16k.global_batch_tokens=32768"])
        for plan in plan_curriculum(cfg, world):
            data = StageData(plan, dataset=None, prefixes=())
            consumed = 3 * plan.sequences_per_step
            seen = [i for r in range(plan.layout.dp) for mb in data.micro_batch_indices(consumed, r) for i in mb]
            assert sorted(seen) == list(range(consumed, consumed + plan.sequences_per_step))
            assert all(len(mb) == plan.micro_batch for mb in data.micro_batch_indices(consumed, 0))


def test_position_buckets_double_and_cover_the_sequence():
    assert position_buckets(256) == [(0, 64), (64, 128), (128, 256)]
    b = position_buckets(16384)
    assert b[0] == (0, 64) and b[-1] == (8192, 16384)
    assert all(lo2 == hi1 for (_, hi1), (lo2, _) in zip(b, b[1:]))
    assert position_buckets(40) == [(0, 40)]


def test_positions_in_documents_restart_at_each_boundary():
    cu = torch.tensor([0, 3, 7, 8, 12], dtype=torch.int32)
    expected = [0, 1, 2, 0, 1, 2, 3, 0, 0, 1, 2, 3]
    assert positions_in_documents(cu, 12).tolist() == expected


def test_bucket_losses_equal_a_direct_average():
    torch.manual_seed(0)
    n, vocab, seq_len = 300, 11, 300
    logits = torch.randn(1, n, vocab)
    labels = torch.randint(0, vocab, (1, n))
    labels[0, ::7] = -100
    cu = torch.tensor([0, 100, 250, 300])
    losses = token_losses(logits, labels)
    ref = F.cross_entropy(logits[0], labels[0].clamp_min(0), reduction="none")
    assert torch.allclose(losses[labels[0] != -100], ref[labels[0] != -100], atol=1e-6)
    pos = positions_in_documents(cu, n)
    merged = merge_buckets([bucket_losses(losses, labels, pos, seq_len)])
    for b in merged:
        sel = [i for i in range(n) if b["lo"] <= pos[i] < b["hi"] and labels[0, i] != -100]
        assert b["tokens"] == len(sel)
        if sel:
            assert math.isclose(b["loss"], float(ref[sel].double().mean()), rel_tol=1e-6)


def test_progress_prints_lines_off_a_terminal_and_one_live_line_on_it():
    out = io.StringIO()
    p = Progress(10, mode="auto", every=5, stream=out)
    for step in range(1, 11):
        p.update(step, "s", 2.0, 1000.0, 3.0)
    p.message("done")
    lines = out.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines[:2]] == ["5/10", "10/10"] and lines[-1] == "done"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress(3, stream=tty)
    p.update(1, "s", 2.0, 1500.0, 61.0)
    p.update(2, "s", 1.5, 1500.0, 30.0)
    p.close()
    text = tty.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and "1.5K tok/s" in text and "ETA 30s" in text


def test_jsonl_appends_and_a_torn_line_cannot_swallow_the_next_record(tmp_path):
    path = tmp_path / "m.jsonl"
    w = JsonlWriter(path)
    for s in range(1, 6):
        w.write({"step": s, "loss": float(s)})
    w.close()
    with open(path, "a") as fh:
        fh.write('{"step": 6, "lo')  # a writer killed mid-line
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    w = JsonlWriter(path)  # the next launch appends after the earlier records
    w.write({"step": 4, "loss": 40.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)][-2:] == [(5, 5.0), (4, 40.0)]
    assert path.read_text().splitlines()[5] == '{"step": 6, "lo'  # kept as it was, on a line of its own


def test_wandb_is_offline_without_credentials(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_mode(None) == "online"
    assert wandb_mode("disabled") == "disabled"


def test_mfu_is_model_flops_over_peak():
    assert mfu(1000.0, 6e9, 1e15, 2) == 1000.0 * 6e9 / 2e15
    assert mfu(1000.0, 6e9, None, 1) is None


def test_trainer_state_records_the_run_and_round_trips_through_json():
    cfg = compose_recipe("smoke", [])
    plans = plan_curriculum(cfg, 1)
    ctx1k = plans[1]
    position = RunPosition(ctx1k.start_step + 2, {"ctx256": 160, "ctx1k": 8}, 49152, 3.5)
    state = TrainerState.of_run(cfg, plans, ctx1k, position, ctx1k.layout.as_dict())
    position.advance(ctx1k, 8, 1.0)  # the state is a snapshot, not a view of the live position
    saved = json.loads(json.dumps(state.to_dict()))
    assert set(saved) == {"format", "step", "stage", "stage_step", "consumed", "tokens_seen", "train_time_s",
                          "total_steps", "recipe", "curriculum", "layout", "model", "tokenizer", "config"}
    assert saved["format"] == CHECKPOINT_FORMAT
    assert (saved["step"], saved["stage"], saved["stage_step"], saved["total_steps"]) == (12, "ctx1k", 2, 22)
    assert (saved["consumed"], saved["tokens_seen"], saved["train_time_s"]) == ({"ctx256": 160, "ctx1k": 8}, 49152, 3.5)
    assert saved["curriculum"]["ctx1k"] == {"seq_len": 1024, "global_batch_tokens": 4096, "start_step": 10, "steps": 6}
    assert saved["model"]["d_model"] == cfg.model.d_model and saved["tokenizer"] == "byte"
    back = TrainerState.from_dict(saved)
    assert back.position == RunPosition(12, {"ctx256": 160, "ctx1k": 8}, 49152, 3.5)
    assert json.loads(json.dumps(back.to_dict())) == saved


def test_trainer_state_of_another_format_or_writer_is_refused_with_the_fix(tmp_path):
    (tmp_path / "trainer.json").write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(ConfigError, match=f"format 1; this moe-lc reads format {CHECKPOINT_FORMAT}"):
        read_trainer_state(tmp_path)
    (tmp_path / "trainer.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(ConfigError, match="not written by the moe-lc trainer"):
        read_trainer_state(tmp_path)
    (tmp_path / "trainer.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 3}))
    with pytest.raises(ConfigError, match="incomplete or damaged .*'consumed'"):
        read_trainer_state(tmp_path)


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process note
def test_a_run_dir_with_history_never_starts_over_unasked(tmp_path):
    root = tmp_path / "checkpoints"
    path = CheckpointManager(root).save(3, {"model": torch.nn.Linear(2, 2), "rng": None})
    victim = max(path.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated: the manifest no longer matches
    cfg = compose_recipe("smoke", [f"run_dir={tmp_path}"])
    with pytest.raises(CheckpointCorruptError, match=r"no valid checkpoint in .*step_00000003: file .*__0_0\.distcp "
                                                     r"has \d+ bytes.*resume=PATH.*run_dir.*resume=fresh"):
        find_start(cfg, CheckpointManager(root))
    assert path.is_dir()  # nothing moved by a refusal
    with pytest.raises(ConfigError, match="already holds 1 checkpoint.*resume=auto.*resume=fresh"):
        find_start(compose_recipe("smoke", [f"run_dir={tmp_path}", "resume=none"]), CheckpointManager(root))
    start = find_start(compose_recipe("smoke", [f"run_dir={tmp_path}", "resume=fresh"]), CheckpointManager(root))
    assert (start.resume, start.init, start.position, start.resume_step) == (None, None, RunPosition(), 0)
    moved = next((root / "set-aside").iterdir())
    assert moved.name.endswith("-fresh") and (moved / "step_00000003").is_dir() and not path.exists()
    assert str(moved) in start.warning
    # run records without any checkpoint are history too
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ConfigError, match=r"holds run records \(metrics.jsonl\) but no checkpoint.*resume=fresh"):
        find_start(cfg, CheckpointManager(root))
    assert find_start(compose_recipe("smoke", [f"run_dir={tmp_path / 'new'}"]), CheckpointManager(tmp_path / "c")) \
        == Start(RunPosition())