"""The curriculum as a schedule of optimizer steps.

Stage k covers global steps [start_k, end_k); one LR schedule runs over all of them
(`total_steps` = the sum over every stage of the curriculum, whichever stages a launch runs).
Per step a stage consumes `sequences_per_step` = global_batch_tokens / seq_len sequences of
its own data stream; each data-parallel rank runs `grad_accum` micro-batches of
`micro_batch` sequences:

    grad_accum = global_batch_tokens / (micro_batch x seq_len x dp)

Where a run stands is (global step, sequences consumed per stage): both layout-independent.

Each stage also has its activation checkpointing policy: the run's, with the stage's
`activation_checkpointing:` block merged over it. A change of policy between stages does not
rebuild the model: the trainer re-applies the policy in place (it changes no parameter).

A launch checks the layouts of the stages it will train (`curriculum.run`, up to
`max_steps`) against its world size; the others only get their step counts, so a recipe
whose later stages need more ranks still trains its early ones on a small machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from moe_lc.config import ConfigError
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.train.config import SourceConfig, StageConfig, TrainConfig
from moe_lc.train.recipes import stage_checkpointing, stage_layout


@dataclass(frozen=True)
class StagePlan:
    index: int
    name: str
    seq_len: int
    global_batch_tokens: int
    micro_batch: int
    steps: int
    start_step: int  # first global step of the stage
    layout: Optional[ParallelLayout]  # resolved for the world; None for a stage that was not checked
    sources: tuple[SourceConfig, ...]
    run: bool  # trained by this launch (in curriculum.run and starting before max_steps)
    requested: Optional[ParallelLayout] = None  # the layout as the recipe wrote it, before fitting to the world
    checkpointing: ActivationCheckpointing = field(default_factory=ActivationCheckpointing)  # the stage's policy

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps

    @property
    def sequences_per_step(self) -> int:
        return self.global_batch_tokens // self.seq_len

    @property
    def grad_accum(self) -> int:
        return self.sequences_per_step // (self.micro_batch * self.layout.dp)

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch_tokens

    def contains(self, step: int) -> bool:
        return self.start_step <= step < self.end_step


def stage_steps(name: str, stage: StageConfig) -> int:
    if stage.steps is not None:
        return stage.steps
    return math.ceil(stage.tokens / stage.global_batch_tokens)


def check_batch_shape(name: str, stage: StageConfig, dp: int) -> None:
    """global_batch_tokens must split exactly into sequences, ranks and micro-batches."""
    where = f"curriculum.stages.{name}"
    if stage.global_batch_tokens % stage.seq_len:
        raise ConfigError(
            f"{where}: global_batch_tokens={stage.global_batch_tokens} is not a multiple of seq_len={stage.seq_len}; "
            f"use e.g. {max(1, stage.global_batch_tokens // stage.seq_len) * stage.seq_len}"
        )
    seqs = stage.global_batch_tokens // stage.seq_len
    per_micro_round = stage.micro_batch * dp
    if seqs % per_micro_round:
        raise ConfigError(
            f"{where}: {seqs} sequences per step do not split into micro_batch={stage.micro_batch} x dp={dp}; "
            f"make global_batch_tokens a multiple of micro_batch*seq_len*dp = {per_micro_round * stage.seq_len} "
            "or change micro_batch"
        )


def check_pipeline_micro_batches(name: str, stage: StageConfig, layout: ParallelLayout) -> None:
    """A pipeline's micro-batches are the stage's accumulation steps: its schedule must be able to order them."""
    from moe_lc.parallel.pipeline_schedule import check_microbatches, schedule_available

    if layout.pp == 1 or not schedule_available(layout.pp_schedule):  # (a missing schedule: validate says so)
        return

    grad_accum = stage.global_batch_tokens // stage.seq_len // (stage.micro_batch * layout.dp)
    try:
        check_microbatches(layout.pp_schedule, layout.pp, layout.stages_per_rank, grad_accum)
    except ConfigError as err:
        raise ConfigError(f"curriculum.stages.{name} ({grad_accum} micro-batches per rank and step): {err}") from None


def plan_curriculum(cfg: TrainConfig, world_size: int, every_stage: bool = False) -> list[StagePlan]:
    """Every stage of the curriculum with its steps and data; the layouts of the stages this launch
    runs (every stage with every_stage=True, for planning) resolved and checked for `world_size` ranks.

    What the engine does not implement yet (pp, cp > 1) passes here: `moe-lc plan` reports it
    and building the model refuses it.
    """
    plans: list[StagePlan] = []
    start = 0
    selected = set(cfg.curriculum.run) if cfg.curriculum.run is not None else None
    for index, (name, stage) in enumerate(cfg.curriculum.stages.items()):
        steps = stage_steps(name, stage)
        run = (selected is None or name in selected) and (cfg.max_steps is None or start < cfg.max_steps)
        requested = stage_layout(cfg.layout, name, stage.layout)
        layout = None
        if run or every_stage:
            try:
                layout = requested.resolve(world_size).validate(cfg.model, stage.seq_len, runnable=False)
            except ConfigError as err:
                raise ConfigError(f"stage {name}: {err}") from err
            check_batch_shape(name, stage, layout.dp)
            check_pipeline_micro_batches(name, stage, layout)
        sources = tuple(stage.data if stage.data is not None else cfg.data.sources)
        plans.append(StagePlan(
            index, name, stage.seq_len, stage.global_batch_tokens, stage.micro_batch, steps, start, layout, sources,
            run, requested, stage_checkpointing(cfg.activation_checkpointing, name, stage.activation_checkpointing),
        ))
        start += steps
    return plans


def total_steps(plans: list[StagePlan]) -> int:
    return plans[-1].end_step


def stage_at(plans: list[StagePlan], step: int) -> Optional[StagePlan]:
    """The stage that global step `step` belongs to (None past the end)."""
    for p in plans:
        if p.contains(step):
            return p
    return None


def next_step_to_run(plans: list[StagePlan], step: int) -> Optional[int]:
    """The first global step >= `step` that lies in a stage this launch runs (None: nothing left)."""
    for p in plans:
        if p.run and step < p.end_step:
            return max(step, p.start_step)
    return None
