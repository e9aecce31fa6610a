"""`moe-lc plan RECIPE`: what a recipe would do, without building anything.

Two questions:

- `plan_text(cfg, world_size)`: the recipe's own layouts for ``world_size`` ranks. Per stage: tokens
  and sequences per step, gradient accumulation, steps, FLOPs, the memory per GPU of the heaviest
  pipeline stage (`moe_lc.plan.memory`) and the step time on H200s (`moe_lc.plan.step_time`).
- `recommend_text(cfg, cluster)`: for ``cluster`` (`moe-lc plan RECIPE --gpus N --gpu-memory G`),
  the fastest layout and checkpointing policy of every stage that fits the GPUs' memory, and the
  runners-up (`moe_lc.plan.search`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from moe_lc.model.accounting import count_parameters, training_flops_per_token
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.activation_memory import gpu_execution_path
from moe_lc.parallel.pipeline_split import describe_split, pipeline_split
from moe_lc.plan.hardware import Cluster, default_cluster
from moe_lc.plan.memory import GiB, MemoryBreakdown, MemoryModel, StageShape
from moe_lc.plan.model_facts import ModelFacts, model_facts
from moe_lc.plan.report import assumptions, recommendation_lines
from moe_lc.plan.search import HOST_BOUND_SHARE, recommend
from moe_lc.plan.step_time import StepTime, TimeModel
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, check_batch_shape, plan_curriculum, stage_steps, total_steps

__all__ = ["StageEstimate", "estimate_stage", "gpu_execution_path", "plan_text", "recommend_text"]


@dataclass
class StageEstimate:
    stage: StagePlan
    flops_per_token: float
    memory: MemoryBreakdown  # under the stage's policy
    by_policy_gib: dict[str, float]  # the peak's activations under each policy (none, selective, full)
    time: StepTime  # on `cluster`
    cluster: Cluster  # H200s, or the bench's GPUs (`moe_lc.plan.hardware.default_cluster`)

    @property
    def activations_gib(self) -> float:
        return self.memory.activations / GiB

    @property
    def state_gib(self) -> float:
        """Weights, gradients and optimizer state."""
        return (self.memory.weights + self.memory.gradients + self.memory.optimizer) / GiB

    @property
    def total_gib(self) -> float:
        """The estimated peak."""
        return self.memory.total / GiB


def facts_of(cfg: TrainConfig) -> ModelFacts:
    return model_facts(cfg.model, cfg.optim.muon_per_head, cfg.optim.muon_ns_steps)


def stage_shape(stage: StagePlan) -> StageShape:
    return StageShape(stage.seq_len, stage.micro_batch, stage.sequences_per_step)


def estimate_stage(cfg: TrainConfig, stage: StagePlan, keys_per_token: Optional[float] = None,
                   device_name: Optional[str] = None) -> StageEstimate:
    """Memory and time of one stage under its own (resolved) layout and policy (``keys_per_token``: the
    data's mean attention keys per query where known, else one document per row), on H200s or on the
    GPUs ``device_name`` names (`moe_lc.plan.hardware.default_cluster`)."""
    facts, shape = facts_of(cfg), stage_shape(stage)
    memory = MemoryModel(facts, shape, cfg.optim.name, cfg.compile)
    policies = [replace(stage.checkpointing, mode=mode) for mode in CheckpointMode]
    by_policy = {str(p.mode): m.activations / GiB for p, m in zip(policies, memory.price(stage.layout, policies))}
    cluster = default_cluster(stage.layout.world_size, stage.layout.gpus_per_node, device_name)
    time = TimeModel(facts, shape, cluster, cfg.optim.name, cfg.compile, keys_per_token)(stage.layout,
                                                                                        stage.checkpointing)
    return StageEstimate(stage, training_flops_per_token(cfg.model, stage.seq_len),
                         memory(stage.layout, stage.checkpointing), by_policy, time, cluster)


def _pipeline_splits(cfg: TrainConfig, plans: list[StagePlan]) -> list[str]:
    """The stage split of each pipelined layout, as the trainer builds it: once per run of curriculum
    stages with the same layout, balanced for the first one's sequence length and policy."""
    lines, built = [], None
    for i, p in enumerate(plans):
        if p.layout.pp == 1 or p.layout == built:
            built = p.layout if p.layout.pp > 1 else None
            continue
        built = p.layout
        users = [q.name for q in plans[i:] if q.layout == p.layout]
        ranges = pipeline_split(cfg.model, p.layout, p.seq_len, p.checkpointing)
        how = "as listed" if p.layout.pp_stage_layers is not None else f"balanced for seq_len {p.seq_len}"
        lines += ["", f"pipeline stages for {', '.join(users)} ({how}): "
                      + describe_split(cfg.model, p.layout, ranges, p.seq_len, p.checkpointing)]
    return lines


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _header(cfg: TrainConfig, stages: int, steps: int) -> list[str]:
    rep = count_parameters(cfg.model)
    return [
        f"recipe {cfg.recipe}: model {cfg.model.name} ({_human(rep.total)} params, {_human(rep.active)} active), "
        f"curriculum {cfg.curriculum.name} ({stages} stages, {steps} steps, one {cfg.optim.name} cosine schedule)",
        f"run_dir {cfg.run_dir}   data: " + ", ".join(f"{s.prefix} (w={s.weight:g})" for s in cfg.data.sources),
    ]


def _host_note(est: StageEstimate) -> str:
    """Where the GPU would wait for the host a tenth of the step or more: how much, and the key that hides it."""
    share = est.time.host / est.time.step
    if share < HOST_BOUND_SHARE:
        return ""
    return (f"; the GPU waits for the host {share:.0%} of it: more rows a micro-batch "
            f"(curriculum.stages.{est.stage.name}.micro_batch) hide that")


def plan_text(cfg: TrainConfig, world_size: int) -> str:
    """The human-readable plan of a recipe for `world_size` ranks (every stage checked, run or not)."""
    plans = plan_curriculum(cfg, world_size, every_stage=True)
    lines = [*_header(cfg, len(plans), total_steps(plans)), "",
             f"{'stage':<10}{'run':<5}{'seq_len':>9}{'tok/step':>10}{'seq/step':>9}{'accum':>7}{'steps':>9}"
             f"{'start':>9}{'tokens':>9}{'FLOP/tok':>10}  layout"]
    estimates = []
    for p in plans:
        est = estimate_stage(cfg, p)
        estimates.append(est)
        lines.append(
            f"{p.name:<10}{'yes' if p.run else '-':<5}{p.seq_len:>9}{_human(p.global_batch_tokens):>10}"
            f"{p.sequences_per_step:>9}{p.grad_accum:>7}{p.steps:>9}{p.start_step:>9}{_human(p.tokens):>9}"
            f"{est.flops_per_token:>10.3g}  {p.layout.describe()}"
        )
    lines += ["", "memory per GPU (GiB, estimate, heaviest pipeline stage): weights + gradients + optimizer state + "
                  "FSDP's gradient accumulation + activations kept for backward under the stage's checkpointing + "
                  "backward working memory + logits + communication buffers => peak (activations under none | "
                  "selective | full); step time on H200s (moe-lc plan --gpus N to search layouts)"]
    for est in estimates:
        p, m = est.stage, est.memory
        alternatives = " | ".join(f"{v:.1f}" for v in est.by_policy_gib.values())
        hours = p.steps * est.time.step / 3600
        lines.append(
            f"  {p.name:<10} weights {m.weights / GiB:.2f}  grads {m.gradients / GiB:.2f}  opt {m.optimizer / GiB:.2f}"
            f"  accum {m.accumulation / GiB:.2f}  act {m.activations / GiB:.2f} ({p.checkpointing.describe()})"
            f"  bwd {m.backward / GiB:.2f}  logits {m.logits / GiB:.2f}  buffers {sum(m.buffers.values()) / GiB:.2f}"
            f"  => {m.total / GiB:.2f}  ({alternatives})   {est.time.step:.1f} s/step (MFU "
            f"{est.time.mfu(est.cluster):.0%}), ~{hours:,.1f} h on {p.layout.world_size} H200"
            + _host_note(est)
        )
    lines += _pipeline_splits(cfg, plans)
    lowered = {p.name: p.layout.lowered_from(p.requested) for p in plans}
    fitted = "; ".join(f"{name} {', '.join(changes)}" for name, changes in lowered.items() if changes)
    if fitted:
        lines += ["", f"fitted to {world_size} rank(s): {fitted} (layout.world_size=N plans for N ranks)"]
    return "\n".join(lines)


def recommend_text(cfg: TrainConfig, cluster: Cluster, runners_up: int = 3) -> str:
    """The recommended layout of every stage of the recipe on ``cluster`` (the recipe's own layout is not used,
    except for its sequence_parallel and param_dtype)."""
    facts = facts_of(cfg)
    stages = cfg.curriculum.stages
    steps = {name: stage_steps(name, st) for name, st in stages.items()}
    lines = [*_header(cfg, len(stages), sum(steps.values())), *assumptions(cluster)]
    hours: Optional[float] = 0.0  # None once a stage has no layout that fits
    for name, st in stages.items():
        check_batch_shape(name, st, 1)
        shape = StageShape(st.seq_len, st.micro_batch, st.global_batch_tokens // st.seq_len)
        rec = recommend(facts, cfg.optim.name, name, shape, steps[name], cluster, cfg.layout, cfg.compile)
        lines += ["", *recommendation_lines(rec, cluster, runners_up)]
        if rec.best is None or hours is None:
            hours = None
        else:
            hours += steps[name] * rec.best.time.step / 3600
    if hours is not None:
        lines += ["", f"curriculum: {hours:,.1f} h ({hours / 24:,.1f} days) on {cluster.gpus} GPUs with the "
                      "recommended layouts"]
    return "\n".join(lines)
