"""Where a launch starts, and what a trainer checkpoint records about its run.

    resume=auto    the newest valid checkpoint under run_dir/checkpoint.dir; a fresh start only
                   in a run dir without history (no checkpoints, no run records)
    resume=none    a fresh start; refused if the run dir has history
    resume=fresh   a fresh start even so: its checkpoints are moved to checkpoint.dir/set-aside/
                   and the new launch's records are appended after the old ones
    resume=PATH    that checkpoint (or the newest valid one under that directory)
    init_from=PATH a fresh start (step 0, fresh optimizer) from that checkpoint's weights

Nothing in the run dir is deleted by a restart, and a run dir whose checkpoints all fail
their check is never restarted from step 0 unasked: the launch stops with one error listing
each checkpoint and why it was rejected. Checkpoints a launch must not build on (newer than
the one it resumes, rejected ones, all of them for resume=fresh) are moved aside, not deleted.

A checkpoint is checked before any tensor is read: every file against its checksum, then
against this run: the trainer-state format, the model config (field by field) and the tokenizer. The trainer state
(`trainer.json`, `TrainerState`) is what a checkpoint knows about its run: the position
(step, sequences consumed per stage, tokens seen, train time) plus the stage, curriculum,
layout, model, tokenizer and the whole config that wrote it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from moe_lc.checkpoint import CheckpointCorruptError, CheckpointManager, no_valid_checkpoint_message
from moe_lc.checkpoint.ondisk import POINTER, TRAINER_FILE, step_dirs
from moe_lc.config import ConfigError
from moe_lc.metrics.sinks import EVAL_FILE, METRICS_FILE
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, total_steps
from moe_lc.train.recipes import config_to_dict

# 2: each expert balancer's extra state is saved as its dict of tensors (1 packed it into one tensor)
CHECKPOINT_FORMAT = 2
# Model fields that may change between a checkpoint and the run that loads it: how the same weights
# compute (backends, projections stacked into one GEMM), never what they are. A checkpoint written
# before such a field existed lacks it, and resumes too.
# mla.fp32_output: a removed option that changed no weights (checkpoints written before its removal carry it)
MODEL_FIELDS_FREE_TO_CHANGE = {
    "name", "kda.backend", "kda.fused_projections", "mla.fused_projections", "mla.fp32_output", "mla.keys_backend",
    "mla.gate_backend", "kda.gate_backend", "attn_res.backend",
    "attn_res.fused_norm",
    "moe.fused_projections", "moe.dispatch_backend", "moe.router_backend", "moe.wgrad_backend", "fused_loss", "loss_backend",
}


@dataclass
class RunPosition:
    """Where a run stands; layout-independent, so a checkpoint resumes under any layout."""

    step: int = 0  # optimizer steps completed
    consumed: dict[str, int] = field(default_factory=dict)  # sequences consumed per stage name
    tokens_seen: int = 0
    train_time_s: float = 0.0  # accumulated step time over all launches

    def advance(self, plan: StagePlan, consumed: int, step_time_s: float) -> None:
        """Account for one finished optimizer step of `plan` that started at `consumed` sequences."""
        self.step += 1
        self.consumed[plan.name] = consumed + plan.sequences_per_step
        self.tokens_seen += plan.global_batch_tokens
        self.train_time_s += step_time_s

    def copy(self) -> "RunPosition":
        return replace(self, consumed=dict(self.consumed))


@dataclass
class TrainerState:
    """What a checkpoint's trainer.json holds (the position's fields at its top level)."""

    position: RunPosition
    stage: str  # the stage of the last step taken
    stage_step: int  # steps into that stage
    total_steps: int  # of the whole curriculum
    recipe: str
    curriculum: dict[str, dict[str, int]]  # stage -> seq_len, global_batch_tokens, start_step, steps
    layout: dict[str, Any]
    model: dict[str, Any]
    tokenizer: str
    config: dict[str, Any]
    format: int = CHECKPOINT_FORMAT

    @classmethod
    def of_run(
        cls, cfg: TrainConfig, plans: list[StagePlan], plan: StagePlan, position: RunPosition, layout: dict[str, Any]
    ) -> "TrainerState":
        """The state of a run of `cfg` at `position`, whose last step was in `plan`, under `layout`."""
        return cls(
            position=position.copy(),
            stage=plan.name,
            stage_step=position.step - plan.start_step,
            total_steps=total_steps(plans),
            recipe=cfg.recipe,
            curriculum={p.name: {"seq_len": p.seq_len, "global_batch_tokens": p.global_batch_tokens,
                                 "start_step": p.start_step, "steps": p.steps} for p in plans},
            layout=layout,
            model=cfg.model.to_dict(),
            tokenizer=str(cfg.data.tokenizer),
            config=config_to_dict(cfg),
        )

    def to_dict(self) -> dict[str, Any]:
        p = self.position
        return {
            "format": self.format,
            "step": p.step,
            "stage": self.stage,
            "stage_step": self.stage_step,
            "consumed": dict(p.consumed),
            "tokens_seen": p.tokens_seen,
            "train_time_s": p.train_time_s,
            "total_steps": self.total_steps,
            "recipe": self.recipe,
            "curriculum": self.curriculum,
            "layout": self.layout,
            "model": self.model,
            "tokenizer": self.tokenizer,
            "config": self.config,
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "TrainerState":
        """The inverse of `to_dict`; KeyError names a missing field."""
        position = RunPosition(
            int(saved["step"]), {k: int(v) for k, v in saved["consumed"].items()}, int(saved["tokens_seen"]),
            float(saved["train_time_s"]),
        )
        return cls(
            position, saved["stage"], int(saved["stage_step"]), int(saved["total_steps"]), saved["recipe"],
            saved["curriculum"], saved["layout"], saved["model"], saved["tokenizer"], saved["config"],
            int(saved["format"]),
        )


@dataclass(frozen=True)
class Start:
    """Where this launch begins."""

    position: RunPosition  # where the run stands (step 0 unless resumed)
    resume: Optional[Path] = None  # checkpoint to continue: weights, optimizer, RNG and position
    init: Optional[Path] = None  # checkpoint whose weights start a fresh run
    warning: Optional[str] = None  # for the run's log: checkpoints rejected or moved aside, a start over

    @property
    def resume_step(self) -> int:
        """The step this launch continues from: 0 for a fresh start."""
        return self.position.step if self.resume is not None else 0


def find_start(cfg: TrainConfig, checkpoints: CheckpointManager) -> Start:
    """Pick the checkpoint to resume or initialise from (see the module docstring), check it fits
    this run and move aside what the launch must not build on; collective. ConfigError (or
    CheckpointError) with the fix otherwise, before anything in the run dir is changed."""
    mode = str(cfg.resume)
    history = checkpoints.rank0_decides(lambda: run_history(Path(cfg.run_dir), checkpoints.root))
    if mode == "none" and history:
        raise ConfigError(
            f"{cfg.run_dir} already holds {' and '.join(history)}; continue that run with resume=auto, start it "
            "over with resume=fresh (nothing is deleted), or start a new one in another run_dir=..."
        )
    if mode in ("none", "fresh"):
        init = _init_checkpoint(cfg, checkpoints)
        notes = []
        if mode == "fresh" and history:
            notes = [f"resume=fresh: starting over at step 0 in {cfg.run_dir}, which holds {' and '.join(history)}"]
            notes += _moved_note(checkpoints.set_aside(None, "fresh"))
        return Start(RunPosition(), init=init, warning="; ".join(notes) or None)
    with warnings.catch_warnings(record=True) as caught:  # a bad `latest`, an old manifest: for the run's log
        found = checkpoints.select(None if mode == "auto" else mode)
    if found.path is None:
        if found.rejected:
            raise CheckpointCorruptError(no_valid_checkpoint_message(found.rejected[0].path.parent, found.rejected))
        if history:
            raise ConfigError(
                f"{cfg.run_dir} holds {' and '.join(history)} but no checkpoint to resume; start the run over "
                "there with resume=fresh (the old records are kept, the new launch's appended), or use another "
                "run_dir=..."
            )
        return Start(RunPosition(), init=_init_checkpoint(cfg, checkpoints))
    saved = read_trainer_state(found.path)
    check_compatible(saved, cfg, found.path)
    notes = [str(w.message) for w in caught]
    notes += [f"checkpoint {r.path.name} rejected ({r.reason}); resuming from {found.path}" for r in found.rejected]
    notes += _moved_note(checkpoints.set_aside(found.path, "superseded", [r.path for r in found.rejected]))
    return Start(saved.position, resume=found.path, warning="; ".join(notes) or None)


def _init_checkpoint(cfg: TrainConfig, checkpoints: CheckpointManager) -> Optional[Path]:
    """The checkpoint named by init_from, checked like a resume (by the launch's manager, which
    then loads it without hashing it again), or None."""
    if cfg.init_from is None:
        return None
    found = checkpoints.select(cfg.init_from)
    if found.path is None:
        reasons = "; ".join(f"{r.path.name}: {r.reason}" for r in found.rejected)
        raise ConfigError(f"init_from={cfg.init_from} holds no valid checkpoint ({reasons}); pass a good checkpoint")
    init = found.path
    check_compatible(read_trainer_state(init), cfg, init)
    return init


def run_history(run_dir: Path, checkpoint_root: Path) -> list[str]:
    """What `run_dir` already holds of earlier launches (checkpoints, a `latest` pointer, run
    records), in words; empty for a new run dir."""
    held = []
    steps = step_dirs(checkpoint_root)
    if steps:
        held.append(f"{len(steps)} checkpoint(s) in {checkpoint_root} (newest {steps[-1][1].name})")
    elif (checkpoint_root / POINTER).exists():
        held.append(f"a checkpoint pointer {checkpoint_root / POINTER}")
    records = [name for name in (METRICS_FILE, EVAL_FILE) if _non_empty(run_dir / name)]
    if records:
        held.append(f"run records ({', '.join(records)})")
    return held


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _moved_note(moved: Optional[Path]) -> list[str]:
    return [f"checkpoints this launch must not build on were moved to {moved} (not deleted)"] if moved else []


def read_trainer_state(path: Path) -> TrainerState:
    """The trainer state of checkpoint directory `path` (no tensors read); ConfigError if it has
    none of this format."""
    f = Path(path) / TRAINER_FILE
    saved = json.loads(f.read_text()) if f.is_file() else {}
    found = saved.get("format")
    if isinstance(found, int) and found < CHECKPOINT_FORMAT:
        raise ConfigError(
            f"{path} is a trainer checkpoint of format {found}; this moe-lc reads format {CHECKPOINT_FORMAT} "
            "(expert balancer state is now stored tensor by tensor). Finish that run with the moe-lc version "
            "that wrote it, or start a new run in another run_dir"
        )
    if found != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"{path} was not written by the moe-lc trainer (no trainer state of format {CHECKPOINT_FORMAT}); "
            "pass a checkpoint directory written by `moe-lc train`"
        )
    try:
        return TrainerState.from_dict(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"the trainer state in {f} is incomplete or damaged ({type(err).__name__}: {err}); "
            "pass a checkpoint directory written by `moe-lc train`"
        ) from err


def check_compatible(saved: TrainerState, cfg: TrainConfig, path: Path) -> None:
    """Clear errors for a checkpoint of another model or tokenizer (before any tensor is read)."""
    diffs = [
        f"{key}: checkpoint {theirs!r} vs now {mine!r}"
        for key, theirs, mine in _flat_diff(saved.model, cfg.model.to_dict())
        if key not in MODEL_FIELDS_FREE_TO_CHANGE
    ]
    if diffs:
        raise ConfigError(
            f"checkpoint {path} is for a different model ({'; '.join(diffs[:6])}); use the same model "
            "settings as the run that wrote it, or another run_dir"
        )
    if saved.tokenizer != str(cfg.data.tokenizer):
        raise ConfigError(
            f"tokenizer/vocab mismatch: checkpoint {path} was trained with data.tokenizer={saved.tokenizer!r} but "
            f"this run uses {cfg.data.tokenizer!r}; token ids would mean different things. Use the same tokenizer"
        )


def _flat_diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) wherever the nested dicts differ (tuples equal lists)."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        name = f"{prefix}{key}"
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _flat_diff(va, vb, prefix=f"{name}.")
        elif _normalise(va) != _normalise(vb):
            out.append((name, va, vb))
    return out


def _normalise(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
