"""The recommended layout of a stage: every layout the model allows on the cluster, priced, the fastest that fits.

Searched: pp, dp_replicate, dp_shard, cp, tp and ep over the divisors of the GPU count, dp_mode
(fsdp, zero1; fsdp also reducing every micro-batch where a step accumulates) and the checkpointing policy (none, selective, full; every layer). Rules beyond
`ParallelLayout.validate(model, seq_len, runnable=False)` and the stage's batch split:

- tp within a node (it is on every layer's critical path);
- an ep group within ``EP_MAX_NODES`` nodes (the all-to-all runs twice per MoE layer and pass);
- cp only for rows of at least ``MIN_CP_TOKENS`` tokens per cp rank: cp grows with the context
  (it buys activation memory with the latents' all-gather, worth it only for long rows).

A layout fits when its peak is at most the usable memory (the GPU's less the margin).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from moe_lc.config import ConfigError
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.compile import RegionalCompile
from moe_lc.parallel.layout import DPMode, ParallelLayout
from moe_lc.plan.hardware import Cluster
from moe_lc.plan.memory import GiB, MemoryBreakdown, MemoryModel, StageShape
from moe_lc.plan.model_facts import ModelFacts
from moe_lc.plan.step_time import StepTime, TimeModel

EP_MAX_NODES = 8
MIN_CP_TOKENS = 8192
# the share of a step the GPU waits for its host from which the step is called bound by it (plan and bench),
# and the best layout is priced with more rows a micro-batch
HOST_BOUND_SHARE = 0.10
POLICIES = tuple(ActivationCheckpointing(mode) for mode in CheckpointMode)


@dataclass
class Candidate:
    layout: ParallelLayout
    policy: ActivationCheckpointing
    memory: MemoryBreakdown
    time: StepTime

    def fits(self, cluster: Cluster) -> bool:
        return self.memory.total <= cluster.usable_gib * GiB


@dataclass
class Recommendation:
    """What the search found for one stage."""

    stage: str
    shape: StageShape
    steps: int
    considered: int  # layout x policy pairs priced
    fitting: list[Candidate] = field(default_factory=list)  # the best policy of each fitting layout, fastest first
    faster_rejected: list[Candidate] = field(default_factory=list)  # faster than the best, over the memory
    smallest: Optional[Candidate] = None  # the least memory of all (what comes closest when nothing fits)
    # the best layout and policy at twice the rows a micro-batch, where the best waits for its host and
    # that still fits and divides the step (what doubling the recipe's micro_batch would gain)
    more_rows: Optional[Candidate] = None

    @property
    def best(self) -> Optional[Candidate]:
        return self.fitting[0] if self.fitting else None

    def runners_up(self, count: int) -> list[Candidate]:
        return self.fitting[1:1 + count]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(facts: ModelFacts, shape: StageShape, cluster: Cluster,
                      template: Optional[ParallelLayout] = None) -> list[ParallelLayout]:
    """Every layout of ``cluster.gpus`` ranks that the model, the stage's batch and the rules above allow,
    with ``template``'s sequence_parallel and param_dtype (the recipe's)."""
    template = template or ParallelLayout()
    cfg, world, gpn = facts.cfg, cluster.gpus, cluster.gpus_per_node
    layouts = []
    for tp in _divisors(min(world, gpn)):
        if world % tp:
            continue
        for cp in _divisors(world // tp):
            if cp > 1 and shape.seq_len < cp * MIN_CP_TOKENS:
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > cfg.num_layers:
                    continue
                dp = world // (tp * cp * pp)
                if shape.sequences_per_step % (shape.micro_batch * dp):
                    continue
                for dp_replicate in _divisors(dp):
                    dp_shard = dp // dp_replicate
                    for ep in _divisors(min(facts.expert_count, dp_shard * cp * tp, EP_MAX_NODES * gpn)):
                        modes = [(mode, False) for mode in (DPMode if dp_replicate == 1 else (DPMode.fsdp,))]
                        if shape.sequences_per_step // (shape.micro_batch * dp) > 1:  # accumulation
                            modes.append((DPMode.fsdp, True))  # FSDP reducing every micro-batch
                        for mode, every in modes:  # (ZeRO-1 replicates over dp_replicate anyway)
                            layout = ParallelLayout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp,
                                                    tp=tp, ep=ep, dp_mode=mode, fsdp_reduce_every_micro_batch=every,
                                                    sequence_parallel=template.sequence_parallel,
                                                    param_dtype=template.param_dtype, world_size=world,
                                                    gpus_per_node=gpn)
                            try:
                                layout.validate(cfg, shape.seq_len, runnable=False)
                            except ConfigError:
                                continue
                            layouts.append(layout)
    return layouts


def recommend(facts: ModelFacts, optimizer: str, stage: str, shape: StageShape, steps: int, cluster: Cluster,
              template: Optional[ParallelLayout] = None, compile: Optional[RegionalCompile] = None) -> Recommendation:
    """Price every candidate layout and policy for one stage; the fastest that fits first (``compile``:
    the run's regional-compile policy, decided per layout)."""
    memory = MemoryModel(facts, shape, optimizer, compile)
    timing = TimeModel(facts, shape, cluster, optimizer, compile)
    best_per_layout: list[Candidate] = []
    fastest_overall: list[Candidate] = []
    smallest: Optional[Candidate] = None
    considered = 0
    for layout in candidate_layouts(facts, shape, cluster, template):
        priced = [Candidate(layout, policy, mem, time) for policy, mem, time
                  in zip(POLICIES, memory.price(layout, POLICIES), timing.price(layout, POLICIES))]
        considered += len(priced)
        fitting = [c for c in priced if c.fits(cluster)]
        if fitting:
            best_per_layout.append(min(fitting, key=lambda c: c.time.step))
        fastest_overall.append(min(priced, key=lambda c: c.time.step))
        smallest = min([*priced, *([smallest] if smallest else [])], key=lambda c: c.memory.total)
    best_per_layout.sort(key=lambda c: c.time.step)
    limit = best_per_layout[0].time.step if best_per_layout else float("inf")
    faster = sorted((c for c in fastest_overall if c.time.step < limit and not c.fits(cluster)),
                    key=lambda c: c.time.step)
    rec = Recommendation(stage, shape, steps, considered, best_per_layout, faster, smallest)
    if rec.best is not None and rec.best.time.host >= HOST_BOUND_SHARE * rec.best.time.step:
        rec.more_rows = _with_more_rows(facts, optimizer, shape, cluster, rec.best, compile)
    return rec


def _with_more_rows(facts: ModelFacts, optimizer: str, shape: StageShape, cluster: Cluster, best: Candidate,
                    compile: Optional[RegionalCompile]) -> Optional[Candidate]:
    """``best``'s layout and policy at twice the rows a micro-batch, or None where the step's rows do not
    divide into such micro-batches or they do not fit."""
    wider = replace(shape, micro_batch=2 * shape.micro_batch)
    if shape.sequences_per_step % (wider.micro_batch * best.layout.dp):
        return None
    memory = MemoryModel(facts, wider, optimizer, compile)(best.layout, best.policy)
    candidate = Candidate(best.layout, best.policy, memory,
                          TimeModel(facts, wider, cluster, optimizer, compile)(best.layout, best.policy))
    return candidate if candidate.fits(cluster) else None
