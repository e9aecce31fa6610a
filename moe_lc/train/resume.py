"""Where a launch starts, and what a trainer checkpoint records about its run.

    resume=auto    the newest valid checkpoint under run_dir/checkpoint.dir, else a fresh start
    resume=none    a fresh start; refused if the run directory already holds checkpoints
    resume=PATH    that checkpoint (or the newest valid one under that directory)
    init_from=PATH a fresh start (step 0, fresh optimizer) from that checkpoint's weights

A checkpoint is checked against this run before any tensor is read: the trainer-state
format, the model config (field by field) and the tokenizer. The trainer state
(`trainer.json`, `TrainerState`) is what a checkpoint knows about its run: the position
(step, sequences consumed per stage, tokens seen, train time) plus the stage, curriculum,
layout, model, tokenizer and the whole config that wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from moe_lc.checkpoint import CheckpointManager
from moe_lc.checkpoint.ondisk import TRAINER_FILE
from moe_lc.config import ConfigError
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, total_steps
from moe_lc.train.recipes import config_to_dict

# 2: each expert balancer's extra state is saved as its dict of tensors (1 packed it into one tensor)
CHECKPOINT_FORMAT = 2
# Model fields that may change between a checkpoint and the run that loads it.
# mla.fp32_output: a removed option that changed no weights (checkpoints written before its removal carry it)
MODEL_FIELDS_FREE_TO_CHANGE = {"name", "kda.backend", "mla.fp32_output"}


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
    warning: Optional[str] = None  # for the run's log: why a run with checkpoints starts fresh

    @property
    def resume_step(self) -> int:
        """The step this launch continues from: 0 for a fresh start."""
        return self.position.step if self.resume is not None else 0


def find_start(cfg: TrainConfig, checkpoints: CheckpointManager) -> Start:
    """Pick the checkpoint to resume or initialise from (see the module docstring) and check it
    fits this run; ConfigError (or CheckpointError) with the fix otherwise."""
    existing, resume, warning = checkpoints.checkpoints(), str(cfg.resume), None
    if resume == "none":
        if existing:
            raise ConfigError(
                f"{checkpoints.root} already holds checkpoints (newest {existing[-1].name}); continue that run with "
                "resume=auto, or start a new one in another run_dir=..."
            )
        path = None
    elif resume == "auto":
        path = checkpoints.latest()
        if path is None and existing:
            warning = f"no valid checkpoint among {len(existing)} in {checkpoints.root}; starting fresh"
    else:
        path = checkpoints.resolve(resume)
    if path is not None:
        saved = read_trainer_state(path)
        check_compatible(saved, cfg, path)
        return Start(saved.position, resume=path, warning=warning)
    if cfg.init_from is None:
        return Start(RunPosition(), warning=warning)
    init_root = Path(cfg.init_from)
    init = CheckpointManager(init_root.parent if init_root.name.startswith("step_") else init_root).resolve(
        cfg.init_from
    )
    check_compatible(read_trainer_state(init), cfg, init)
    return Start(RunPosition(), init=init, warning=warning)


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
