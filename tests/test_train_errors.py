"""Bad input stops the trainer with exit code 2 and a message that names the problem and the fix:
missing data, unknown recipe/stage, a bad layout, corrupt checkpoint, tokenizer/vocab mismatch,
and a checkpoint of another model or tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed

from moe_lc.config import ConfigError
from moe_lc.report import load_run
from moe_lc.train.recipes import compose_recipe
from moe_lc.train.resume import check_compatible, read_trainer_state
from moe_lc.train.main import run_train_cli

ONE_STEP = [
    "curriculum.run=[ctx256]",
    "curriculum.stages.ctx256.steps=2",
    "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2",
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "logging.progress=none",
    "logging.tensorboard=false",
    "report.at_end=false",
]


pytestmark = pytest.mark.usefixtures("shared_corpus_cache")


def _fails(capsys, *args: str) -> str:
    assert run_train_cli(list(args)) == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}", "checkpoint.every=1"]) == 0
    return run_dir


def test_missing_data_path_names_it_and_prepare_data(capsys, tmp_path):
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path}", "data=custom",
                 "data.sources=[{prefix: /no/such/corpus, weight: 1.0}]")
    assert "/no/such/corpus" in err and "moe-lc prepare-data" in err


def test_unknown_recipe_and_stage_list_the_choices(capsys):
    err = _fails(capsys, "recipe=smokey")
    assert "unknown recipe 'smokey'" in err and "proxy-curriculum" in err
    err = _fails(capsys, "curriculum.run=[ctx99]")
    assert "unknown stage 'ctx99'" in err and "ctx256, ctx1k, ctx4k, ctx16k" in err


@pytest.mark.parametrize(
    "override, needle",
    [
        ("layout.dp_mode=fsd", "layout.dp_mode='fsd': use one of fsdp, zero1"),
        ("layout.ep=0", "layout.ep=0 must be a positive integer"),
        ("curriculum.stages.ctx256.layout={tpp: 2}", "curriculum.stages.ctx256.layout.tpp: no such field"),
        ("layout=dp2", "stage ctx256: layout.world_size=2 but the world has 1 rank(s)"),
    ],
)
def test_a_bad_layout_stops_before_any_process_group_or_file(capsys, tmp_path, monkeypatch, override, needle):
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started for a layout that cannot run")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path / 'run'}", override)
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.moe.router_backend=triton", "moe.router_backend=triton: Triton cannot run on cpu here"),
        ("model.moe.dispatch_backend=triton", "moe.dispatch_backend=triton: Triton cannot run on cpu here"),
        ("model.attn_res.backend=triton", "attn_res.backend=triton: Triton cannot run on cpu here"),
        ("model.kda.backend=triton", "kda.backend=triton: the triton KDA kernels need a CUDA device"),
        ("model.kda.backend=fla", "kda.backend=fla: the fla KDA kernels need a CUDA device"),
    ],
)
def test_a_kernel_backend_that_cannot_run_here_is_one_line_before_any_file(capsys, tmp_path, monkeypatch,
                                                                           override, needle):
    """Asked for by name on a CPU (without Triton's interpreter), each fast backend would raise inside the
    first forward; the run refuses it up front, naming the setting and what to set instead."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path / 'run'}", override)
    assert needle in err and "set it to auto" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_an_unknown_kernel_launch_choice_in_the_environment_is_one_line(capsys, tmp_path, monkeypatch):
    """MOE_LC_SHORT_CONV_TUNING with a key the kernels do not have: refused up front (its module reads it
    when it first loads, which on a GPU is inside the first forward)."""
    import sys

    monkeypatch.setenv("MOE_LC_SHORT_CONV_TUNING", "bwd_tile=64")
    monkeypatch.delitem(sys.modules, "moe_lc_kernels.short_conv", raising=False)
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path / 'run'}")
    assert err.startswith("error: MOE_LC_SHORT_CONV_TUNING='bwd_tile=64': short conv tuning item 'bwd_tile=64'"), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_model_whose_state_alone_exceeds_the_memory_is_refused_before_it_is_built(capsys, tmp_path, monkeypatch):
    """The proxy's fp32 weights, gradients and AdamW moments are ~8.1 GiB on one rank: with 4 GiB to fill
    the run stops in one line (on a CPU it would otherwise end in an allocation error or the OOM killer),
    before the model or the run directory exists; with 16 GiB the check passes."""
    import moe_lc.train.fits as fits
    from moe_lc.model import init

    monkeypatch.setattr(fits, "rank_memory_bytes", lambda device: 4 * 2**30)
    monkeypatch.setattr(init, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    err = _fails(capsys, "recipe=proxy-8k", f"run_dir={tmp_path / 'run'}")
    assert err.startswith("error: stage ctx8k: model proxy's weights, gradients and adamw state"), err
    assert "more than the 4.0 GiB" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_state_check_counts_weights_gradients_and_both_adamw_moments():
    """16 bytes a parameter on one rank (fp32 weights and gradients, two fp32 moments): within the
    planner's own count, which the check uses, and refused just below it."""
    from moe_lc.model.accounting import count_parameters
    from moe_lc.train.curriculum import plan_curriculum
    from moe_lc.train.fits import check_state_fits
    from moe_lc.train.recipes import compose_recipe

    cfg = compose_recipe("proxy-8k", [])
    plans = [p for p in plan_curriculum(cfg, 1) if p.run][:1]
    state = 16 * count_parameters(cfg.model).total
    check_state_fits(cfg, plans, torch.device("cpu"), memory=1.01 * state)
    with pytest.raises(ConfigError, match="before any activation"):
        check_state_fits(cfg, plans, torch.device("cpu"), memory=0.99 * state)


def test_more_processes_than_gpus_on_a_node_is_one_line(capsys, tmp_path, monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU machine: both ranks would take cuda:0, and NCCL
    would stop at the first collective ("Duplicate GPU detected"); the trainer says so first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started on a GPU that another rank holds")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(WORLD_SIZE=2, RANK=1, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2).items():
        monkeypatch.setenv(name, str(value))
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path / 'run'}", "layout=dp2")
    assert err.strip() == ("error: 2 processes on this node but 1 GPU is visible: launch at most 1 per node "
                           "(torchrun --nproc-per-node 1, NPROC=1 for launch/), or device=cpu"), err
    assert not (tmp_path / "run").exists()


def test_vocab_too_small_for_the_data_is_a_tokenizer_mismatch(capsys, tmp_path):
    # byte-level data has 258 ids; a model with 200 cannot embed them
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path}", "model.vocab_size=200")
    assert "vocab" in err and "258" in err


def test_corrupt_checkpoint_is_refused_with_the_previous_one_suggested(capsys, trained, tmp_path):
    ckpt = trained / "checkpoints" / "step_00000002"
    victim = max(ckpt.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    copy = tmp_path / "copy"
    shutil.copytree(trained / "checkpoints", copy)
    bad = copy / "step_00000002" / victim.relative_to(ckpt)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated tensor file
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path / 'run'}", f"resume={copy / 'step_00000002'}")
    assert "corrupt" in err and "step_00000001" in err
    # resume=auto skips the corrupt newest checkpoint and continues from the valid one
    assert run_train_cli([*ONE_STEP, f"run_dir={tmp_path / 'auto'}", "checkpoint.dir=" + str(copy),
                          "resume=auto"]) == 0
    assert "resuming at step 1" in (tmp_path / "auto" / "train.log").read_text()


def test_resume_refuses_another_model_or_tokenizer(capsys, trained):
    err = _fails(capsys, *ONE_STEP, f"run_dir={trained}", "model.d_model=96", "resume=auto")
    assert "different model" in err and "d_model" in err
    err = _fails(capsys, *ONE_STEP, f"run_dir={trained}", "data.tokenizer=/models/other/tokenizer.json", "resume=auto")
    assert "tokenizer/vocab mismatch" in err


def test_resume_takes_other_backends_and_checkpoints_from_before_an_execution_field(trained, tmp_path):
    """Fields that change how the same weights compute (backends, stacked projections) may differ on
    resume, and a checkpoint written before one of them existed (its trainer.json lacks it) passes the
    model check; a field that changes the weights does not."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}", "curriculum.stages.ctx256.steps=3", "resume=auto",
                          "model.mla.fused_projections=false", "model.moe.dispatch_backend=torch",
                          "model.attn_res.backend=torch"]) == 0
    assert "resuming at step 2" in (run_dir / "train.log").read_text()
    checkpoint = trained / "checkpoints" / "step_00000002"
    saved = read_trainer_state(checkpoint)
    cfg = compose_recipe("smoke", [*ONE_STEP, f"run_dir={run_dir}"])
    del saved.model["mla"]["fused_projections"]
    del saved.model["mla"]["keys_backend"]
    check_compatible(saved, cfg, checkpoint)
    saved.model["mla"]["kv_lora_rank"] += 1
    with pytest.raises(ConfigError, match="different model.*kv_lora_rank"):
        check_compatible(saved, cfg, checkpoint)


def test_every_backend_and_fused_option_of_the_model_may_change_on_resume():
    """A new backend or fused-path option (how the same weights compute) must join
    MODEL_FIELDS_FREE_TO_CHANGE, or every checkpoint written before it existed stops resuming."""
    from moe_lc.presets import get_preset
    from moe_lc.train.resume import MODEL_FIELDS_FREE_TO_CHANGE

    def keys(d: dict, prefix: str = "") -> list[str]:
        return [k for name, v in d.items() for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict)
                                                     else [f"{prefix}{name}"])]

    execution = [k for k in keys(get_preset("tiny").to_dict())
                 if k.rsplit(".", 1)[-1].endswith("backend") or k.rsplit(".", 1)[-1].startswith("fused_")]
    assert execution and set(execution) <= MODEL_FIELDS_FREE_TO_CHANGE, set(execution) - MODEL_FIELDS_FREE_TO_CHANGE


def test_fresh_start_over_existing_checkpoints_is_refused(capsys, trained):
    err = _fails(capsys, *ONE_STEP, f"run_dir={trained}", "resume=none")
    assert "resume=auto" in err and "run_dir" in err and "resume=fresh" in err


def test_resume_fresh_starts_over_and_keeps_everything(capsys, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    old_records = (run_dir / "metrics.jsonl").read_text()
    old_checkpoints = {p.name: (p / "COMPLETE").read_bytes() for p in (run_dir / "checkpoints").glob("step_*")}
    assert run_train_cli([*ONE_STEP, f"run_dir={run_dir}", "resume=fresh", "checkpoint.every=1"]) == 0
    out = capsys.readouterr().out
    assert "warning: resume=fresh: starting over at step 0" in out and "fresh start" in out
    (aside,) = (run_dir / "checkpoints" / "set-aside").iterdir()
    assert {p.name: (p / "COMPLETE").read_bytes() for p in aside.glob("step_*")} == old_checkpoints
    assert (run_dir / "metrics.jsonl").read_text().startswith(old_records)  # appended after the old records
    run = load_run(run_dir)
    assert [r["step"] for r in run.steps] == [1, 2] and len(run.launches) == 2
    assert {r["launch"] for r in run.steps} == {run.launches[-1]} and len(run.redone) == 2


def test_missing_resume_path(capsys, tmp_path):
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path}", f"resume={tmp_path / 'nowhere'}")
    assert "no checkpoint" in err


def test_out_of_memory_in_a_step_names_the_stage_the_peak_and_the_fixes(capsys, tmp_path, monkeypatch):
    from moe_lc.model.transformer import MoELCModel

    real_forward, calls = MoELCModel.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second step's first micro-batch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(MoELCModel, "forward", forward)
    err = _fails(capsys, *ONE_STEP, f"run_dir={tmp_path}")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in ("stage ctx256 ran out of memory", "at step 2", "seq_len 256", "micro_batch 2", "GiB",
                   "++curriculum.stages.ctx256.activation_checkpointing.mode=full",
                   "curriculum.stages.ctx256.micro_batch=1", "++curriculum.stages.ctx256.layout.cp=2",
                   "++curriculum.stages.ctx256.layout.dp_shard=2"):
        assert needle in err, (needle, err)
