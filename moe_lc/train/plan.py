"""`moe-lc plan RECIPE`: what a recipe would do, without building anything.

Per stage: tokens and sequences per step, gradient accumulation, steps, FLOPs, and a memory
estimate per GPU. The memory model is deliberately simple (it is for sizing layouts, not a
promise):

- training state, sharded over every rank except data-parallel replicas (FSDP2/ZeRO over
  dp_shard x cp x tp x pp, experts over ep inside that): fp32 weights 4 B + fp32 gradients
  4 B + optimizer state (AdamW 8 B; Muon 4 B for its matrices, 8 B for the rest) per parameter;
- activations of one micro-batch, bf16, per token per layer of a pipeline stage (tokens split
  over cp and, with sequence parallelism, tp), for two policies: stored for backward
  (`activation_elements_per_token` counts the saved tensors of each sublayer) and full
  recomputation (only each layer's input is kept, plus one layer's working set); 1F1B keeps up
  to `pp` micro-batches in flight on the first stage;
- fp32 logits of one micro-batch for the loss (vocabulary split over tp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lc.config import ModelConfig
from moe_lc.model.accounting import count_parameters, training_flops_per_token
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, plan_curriculum, total_steps

GiB = 1024**3
H200_BF16_PEAK = 989e12
PLAN_MFU = 0.4  # assumed model FLOP utilisation for the time estimate


def activation_elements_per_token(cfg: ModelConfig, kind: str, moe: bool) -> float:
    """Elements one token stores for backward in one decoder layer (both sublayers), roughly."""
    d = cfg.d_model
    norms_and_residual = 4 * d  # two pre-norm inputs and outputs
    if kind == "K":
        inner = cfg.kda.inner_dim
        mixer = 10 * inner + cfg.kda.num_heads  # q,k,v before/after conv, decay, gate, output, normed output; beta
    else:
        m = cfg.mla
        H = m.num_heads
        mixer = (m.q_lora_rank or 0) + m.kv_lora_rank + H * (m.qk_dim + m.qk_dim + 3 * m.v_dim)
    e = cfg.moe
    if moe:
        width = e.latent_dim or d
        routed = e.top_k * (3 * e.expert_hidden + 2 * width)  # gathered input, gate/in/act, output per slot
        shared = 3 * e.num_shared * e.expert_hidden
        ffn = e.num_routed + routed + shared + (2 * width if e.latent_dim else 0)
    else:
        ffn = 3 * e.dense_hidden
    return norms_and_residual + mixer + ffn


@dataclass
class StageEstimate:
    stage: StagePlan
    flops_per_token: float
    tokens_per_gpu_micro: int
    layers_per_pp_stage: int
    state_gib: float
    activations_gib: float  # stored for backward
    activations_recompute_gib: float  # full activation recomputation
    logits_gib: float

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activations_gib + self.logits_gib

    @property
    def total_recompute_gib(self) -> float:
        return self.state_gib + self.activations_recompute_gib + self.logits_gib


def training_state_bytes_per_param(optimizer: str) -> float:
    return 4 + 4 + (6 if optimizer == "muon" else 8)  # Muon: ~ half the params keep one fp32 buffer


def estimate_stage(cfg: TrainConfig, stage: StagePlan) -> StageEstimate:
    m, L = cfg.model, stage.layout
    params = count_parameters(m).total
    state = params * training_state_bytes_per_param(cfg.optim.name) / (L.state_shards)
    tokens = stage.micro_batch * stage.seq_len // (L.cp * L.tp)
    layers = math.ceil(m.num_layers / L.pp)
    per_layer = [
        activation_elements_per_token(m, kind, moe=not m.is_dense_layer(i)) for i, kind in enumerate(m.pattern)
    ]
    heaviest = sorted(per_layer, reverse=True)[:layers]
    in_flight = min(L.pp, max(1, stage.grad_accum))
    bf16 = 2
    stored = tokens * sum(heaviest) * bf16 * in_flight
    recompute = tokens * (layers * m.d_model * bf16 * in_flight + max(per_layer) * bf16)
    logits = stage.micro_batch * stage.seq_len // L.cp * (m.padded_vocab_size // L.tp) * 4
    return StageEstimate(
        stage,
        training_flops_per_token(m, stage.seq_len),
        tokens,
        layers,
        state / GiB,
        stored / GiB,
        recompute / GiB,
        logits / GiB,
    )


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
    lines += ["", "memory per GPU (GiB, estimate): state + activations (stored | full recompute) + logits"]
    for est in estimates:
        p = est.stage
        hours = p.tokens * est.flops_per_token / (H200_BF16_PEAK * PLAN_MFU * p.layout.world_size) / 3600
        lines.append(
            f"  {p.name:<10} state {est.state_gib:8.2f}  act {est.activations_gib:9.2f} | {est.activations_recompute_gib:8.2f}"
            f"  logits {est.logits_gib:6.2f}  => {est.total_gib:9.2f} | {est.total_recompute_gib:8.2f}"
            f"   ~{hours:,.1f} h on {p.layout.world_size} H200 at {PLAN_MFU:.0%} MFU"
        )
    lowered = {p.name: p.layout.lowered_from(p.requested) for p in plans}
    fitted = "; ".join(f"{name} {', '.join(changes)}" for name, changes in lowered.items() if changes)
    if fitted:
        lines += ["", f"fitted to {world_size} rank(s): {fitted} (layout.world_size=N plans for N ranks)"]
    missing = [f"{p.name}: {', '.join(p.layout.not_implemented())}" for p in plans if p.layout.not_implemented()]
    if missing:
        lines += ["", "not implemented yet in moe_lc.parallel (planned, cannot train): " + "; ".join(missing)]
    return "\n".join(lines)
