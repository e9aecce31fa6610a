"""`moe-lc plan RECIPE`: what a recipe would do, without building anything.

Per stage: tokens and sequences per step, gradient accumulation, steps, FLOPs, and a memory
estimate per GPU. The memory model is for sizing layouts and checkpointing policies:

- training state, sharded over every rank except data-parallel replicas (FSDP2/ZeRO over
  dp_shard x cp x tp x pp, experts over ep inside that): fp32 weights 4 B + fp32 gradients
  4 B + optimizer state (AdamW 8 B; Muon 4 B for its matrices, 8 B for the rest) per parameter;
- activations one micro-batch keeps for backward under the stage's activation checkpointing
  policy (`moe_lc.parallel.activation_memory`: an analytic count per layer and component of the
  tensors the GPU path saves, tokens split over cp and, with sequence parallelism, tp), for the
  heaviest layers of a pipeline stage; 1F1B keeps up to `pp` micro-batches in flight on the first
  stage;
- the backward's working memory: the recompute of one checkpointed layer, the KDA backward's
  buffers and gradients in flight, and the loss's logits (one recomputed chunk, vocabulary split
  over tp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lc.model.accounting import count_parameters, training_flops_per_token
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.activation_memory import (
    backward_working_bytes_per_token,
    estimate_activations,
    gpu_execution_path,
    layer_activations,
)
from moe_lc.parallel.pipeline_split import describe_split, pipeline_split
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, plan_curriculum, total_steps

GiB = 1024**3
H200_BF16_PEAK = 989e12
PLAN_MFU = 0.4  # assumed model FLOP utilisation for the time estimate
LOSS_CHUNK_ELEMENTS = 1 << 28  # MoELCModel.loss_chunk_elements: logits computed (and recomputed) per chunk
LOSS_BYTES_PER_LOGIT = 2 + 4 + 4  # bf16 logits, their fp32 log-probabilities and gradient, one chunk at a time


@dataclass
class StageEstimate:
    stage: StagePlan
    flops_per_token: float
    tokens_per_gpu_micro: int
    layers_per_pp_stage: int
    state_gib: float
    activations_gib: float  # kept for backward under the stage's policy
    by_policy_gib: dict[str, float]  # the same under each policy (none, selective, full)
    backward_gib: float  # working memory of the backward
    logits_gib: float  # the loss's working memory

    @property
    def total_gib(self) -> float:
        """The estimated peak: state, what is kept for backward, and the backward's working memory."""
        return self.state_gib + self.activations_gib + self.backward_gib + self.logits_gib


def training_state_bytes_per_param(optimizer: str) -> float:
    return 4 + 4 + (6 if optimizer == "muon" else 8)  # Muon: ~ half the params keep one fp32 buffer


def estimate_stage(cfg: TrainConfig, stage: StagePlan) -> StageEstimate:
    m, L = cfg.model, stage.layout
    params = count_parameters(m).total
    state = params * training_state_bytes_per_param(cfg.optim.name) / (L.state_shards)
    tokens = stage.micro_batch * stage.seq_len // (L.cp * L.tp)
    layers = math.ceil(m.num_layers / L.pp)
    in_flight = min(L.pp, max(1, stage.grad_accum))
    path = gpu_execution_path(L)
    per_layer = layer_activations(m, path)

    def kept(policy: ActivationCheckpointing) -> float:
        est = estimate_activations(m, policy, tokens * L.tp, path, per_layer)  # the loss sees T / cp tokens
        trunk = sorted((v for k, v in est.by_layer.items() if k.startswith("layer")), reverse=True)[:layers]
        # embedding, output mixture, loss and MTP (on the first or last pp stage); the loss gathers the
        # sequence but splits the vocabulary, so its log-probabilities per sequence-shard token stay the same
        extra = est.by_layer["other"] + est.by_layer.get("mtp", 0.0)
        return tokens * (sum(trunk) + extra) * in_flight

    by_policy = {mode.value: kept(ActivationCheckpointing(mode, stage.checkpointing.every)) / GiB
                 for mode in CheckpointMode}
    backward = tokens * backward_working_bytes_per_token(m, stage.checkpointing, path, per_layer)
    loss_tokens = stage.micro_batch * stage.seq_len // L.cp
    logits = min(loss_tokens * (m.padded_vocab_size // L.tp), LOSS_CHUNK_ELEMENTS) * LOSS_BYTES_PER_LOGIT
    return StageEstimate(
        stage,
        training_flops_per_token(m, stage.seq_len),
        tokens,
        layers,
        state / GiB,
        kept(stage.checkpointing) / GiB,
        by_policy,
        backward / GiB,
        logits / GiB,
    )


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


def plan_text(cfg: TrainConfig, world_size: int) -> str:
    """The human-readable plan of a recipe for `world_size` ranks (every stage checked, run or not)."""
    plans = plan_curriculum(cfg, world_size, every_stage=True)
    rep = count_parameters(cfg.model)
    n_total = total_steps(plans)
    lines = [
        f"recipe {cfg.recipe}: model {cfg.model.name} ({_human(rep.total)} params, {_human(rep.active)} active), "
        f"curriculum {cfg.curriculum.name} ({len(plans)} stages, {n_total} steps, one {cfg.optim.name} cosine schedule)",
        f"run_dir {cfg.run_dir}   data: " + ", ".join(f"{s.prefix} (w={s.weight:g})" for s in cfg.data.sources),
        "",
        f"{'stage':<10}{'run':<5}{'seq_len':>9}{'tok/step':>10}{'seq/step':>9}{'accum':>7}{'steps':>9}"
        f"{'start':>9}{'tokens':>9}{'FLOP/tok':>10}  layout",
    ]
    estimates = []
    for p in plans:
        est = estimate_stage(cfg, p)
        estimates.append(est)
        lines.append(
            f"{p.name:<10}{'yes' if p.run else '-':<5}{p.seq_len:>9}{_human(p.global_batch_tokens):>10}"
            f"{p.sequences_per_step:>9}{p.grad_accum:>7}{p.steps:>9}{p.start_step:>9}{_human(p.tokens):>9}"
            f"{est.flops_per_token:>10.3g}  {p.layout.describe()}"
        )
    lines += ["", "memory per GPU (GiB, estimate): state + activations kept for backward under the stage's "
                  "checkpointing + backward working memory + logits => peak (activations under none | selective | full)"]
    for est in estimates:
        p = est.stage
        hours = p.tokens * est.flops_per_token / (H200_BF16_PEAK * PLAN_MFU * p.layout.world_size) / 3600
        alternatives = " | ".join(f"{v:.1f}" for v in est.by_policy_gib.values())
        lines.append(
            f"  {p.name:<10} state {est.state_gib:7.2f}  act {est.activations_gib:8.2f} ({p.checkpointing.describe()})"
            f"  bwd {est.backward_gib:6.2f}  logits {est.logits_gib:5.2f}  => {est.total_gib:8.2f}"
            f"  ({alternatives})   ~{hours:,.1f} h on {p.layout.world_size} H200 at {PLAN_MFU:.0%} MFU"
        )
    lines += _pipeline_splits(cfg, plans)
    lowered = {p.name: p.layout.lowered_from(p.requested) for p in plans}
    fitted = "; ".join(f"{name} {', '.join(changes)}" for name, changes in lowered.items() if changes)
    if fitted:
        lines += ["", f"fitted to {world_size} rank(s): {fitted} (layout.world_size=N plans for N ranks)"]
    missing = [f"{p.name}: {', '.join(p.layout.not_implemented())}" for p in plans if p.layout.not_implemented()]
    if missing:
        lines += ["", "not implemented yet in moe_lc.parallel (planned, cannot train): " + "; ".join(missing)]
    return "\n".join(lines)
