"""Cutting the decoder layers into pipeline stages of balanced modelled cost.

A stage is a run of consecutive decoder layers; the first stage also holds the embedding, the last
one the output mixer, final norm, LM head and loss and the MTP module. The cost of each part comes
from the config alone:

- time: training FLOPs per token (`moe_lc.model.accounting`): each layer's matmuls (KDA or MLA,
  dense FFN or LatentMoE with its k routed experts) and its token mixing (MLA's attention grows
  with the sequence length), the LM head (2 V d per token, forward) and MTP (its projection, its
  layer and a second pass through the head); the embedding is a lookup (no FLOPs);
- memory: the bytes per token each part keeps for backward under the activation checkpointing
  policy (`moe_lc.parallel.activation_memory`), times the micro-batches the stage holds at once
  under its schedule (1F1B's first stage holds pp of them, its last one).

`balanced_split` minimises the slowest stage's time (a pipeline runs at the pace of its slowest
stage) and, among the splits that reach that, the largest stage memory. An explicit split
(``layout.pp_stage_layers``) overrides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from moe_lc.config import ModelConfig
from moe_lc.model.accounting import head_training_flops, layer_training_flops, mtp_training_flops
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.activation_memory import (ExecutionPath, embedding_bytes, gpu_execution_path, layer_activations,
                                               outside_layers_bytes)
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.pipeline_schedule import BACKWARD, BACKWARD_INPUT, FORWARD, rank_actions, stage_ranks

DEFAULT_SEQ_LEN = 4096  # the sequence length a split is balanced for when none is given


@dataclass(frozen=True)
class PartCosts:
    """Per token: each decoder layer's training FLOPs and kept bytes, and what the first and the last
    stage hold besides their layers."""

    layer_flops: tuple[float, ...]
    layer_bytes: tuple[float, ...]
    first_flops: float  # the embedding (a lookup)
    first_bytes: float
    last_flops: float  # output mixer, final norm, LM head + loss, MTP
    last_bytes: float

    @property
    def num_layers(self) -> int:
        return len(self.layer_flops)

    def stage_flops(self, layers: range) -> float:
        return (sum(self.layer_flops[i] for i in layers) + (self.first_flops if layers.start == 0 else 0.0)
                + (self.last_flops if layers.stop == self.num_layers else 0.0))

    def stage_bytes(self, layers: range) -> float:
        return (sum(self.layer_bytes[i] for i in layers) + (self.first_bytes if layers.start == 0 else 0.0)
                + (self.last_bytes if layers.stop == self.num_layers else 0.0))


def part_costs(
    cfg: ModelConfig,
    seq_len: int = DEFAULT_SEQ_LEN,
    policy: Optional[ActivationCheckpointing] = None,
    path: Optional[ExecutionPath] = None,
) -> PartCosts:
    """The modelled cost of every part of ``cfg`` at ``seq_len`` under the checkpointing ``policy``."""
    policy = policy or ActivationCheckpointing()
    path = path or gpu_execution_path(ParallelLayout().resolve(1))
    L = cfg.num_layers
    kept = layer_activations(cfg, path)

    def under_policy(i: int) -> float:
        mode = policy.mode if policy.checkpoints(i) else CheckpointMode.none
        return kept[i].under(mode)

    embedding = embedding_bytes(cfg, path) * cfg.d_model  # the first source, kept by every mixer that reads it
    outside = outside_layers_bytes(cfg, seq_len, path)
    mtp_layer = under_policy(L) if cfg.mtp else 0.0
    return PartCosts(
        layer_flops=tuple(layer_training_flops(cfg, i, seq_len) for i in range(L)),
        layer_bytes=tuple(under_policy(i) for i in range(L)),
        first_flops=0.0,
        first_bytes=embedding,
        last_flops=head_training_flops(cfg) + mtp_training_flops(cfg, seq_len),
        last_bytes=outside - embedding + mtp_layer,
    )


def stage_ranges(counts: Sequence[int]) -> list[range]:
    """Consecutive layer ranges from layer counts per stage: [2, 3] -> [range(0, 2), range(2, 5)]."""
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def in_flight_micro_batches(layout: ParallelLayout, microbatches: Optional[int] = None) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once in its rank's order: forwards
    run minus backwards done, at the peak (``microbatches`` None: 2 x stages, where the peak no longer
    grows with more micro-batches)."""
    pp, v = layout.pp, layout.stages_per_rank
    if pp == 1:
        return [1]
    stages = pp * v
    m = microbatches or 2 * stages
    peak = [0] * stages
    for rank in range(pp):
        alive = [0] * stages
        for a in rank_actions(layout.pp_schedule, pp, v, m, rank):
            if a.kind == FORWARD:
                alive[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], alive[a.stage])
            elif a.kind in (BACKWARD, BACKWARD_INPUT):
                alive[a.stage] -= 1
    return peak


def balanced_split(costs: PartCosts, stages: int, in_flight: Optional[Sequence[int]] = None) -> list[int]:
    """Layer counts per stage (each at least 1) that minimise the slowest stage's FLOPs and then, among
    those, the largest ``in_flight[k] x bytes`` of a stage (exact, by dynamic programming over the cut
    points)."""
    L = costs.num_layers
    if not 1 <= stages <= L:
        raise ValueError(f"cannot cut {L} layers into {stages} stages of at least one layer")
    in_flight = list(in_flight) if in_flight is not None else [1] * stages
    flops = _prefix(costs.layer_flops)
    kept = _prefix(costs.layer_bytes)

    def stage_time(a: int, b: int) -> float:
        return flops[b] - flops[a] + (costs.first_flops if a == 0 else 0.0) + (costs.last_flops if b == L else 0.0)

    def stage_memory(k: int, a: int, b: int) -> float:
        extra = (costs.first_bytes if a == 0 else 0.0) + (costs.last_bytes if b == L else 0.0)
        return in_flight[k] * (kept[b] - kept[a] + extra)

    slowest = _min_max_partition(L, stages, lambda k, a, b: stage_time(a, b))
    limit = slowest * (1 + 1e-9)  # the same cuts computed in another order may differ in the last bits

    def memory_within_time(k: int, a: int, b: int) -> float:
        return stage_memory(k, a, b) if stage_time(a, b) <= limit else math.inf

    _, cuts = _min_max_partition(L, stages, memory_within_time, with_cuts=True)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _min_max_partition(n: int, parts: int, cost, with_cuts: bool = False):
    """min over cut points 0 = c_0 < ... < c_parts = n of max_k cost(k, c_k, c_{k+1}) (and the cuts)."""
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = -math.inf
    for k in range(1, parts + 1):
        for b in range(k, n - (parts - k) + 1):
            for a in range(k - 1, b):
                if best[k - 1][a] == math.inf:
                    continue
                value = max(best[k - 1][a], cost(k - 1, a, b))
                if value < best[k][b]:
                    best[k][b], choice[k][b] = value, a
    if not with_cuts:
        return best[parts][n]
    cuts = [n]
    for k in range(parts, 0, -1):
        cuts.append(choice[k][cuts[-1]])
    return best[parts][n], cuts[::-1]


def pipeline_split(
    cfg: ModelConfig,
    layout: ParallelLayout,
    seq_len: Optional[int] = None,
    policy: Optional[ActivationCheckpointing] = None,
) -> list[range]:
    """The decoder layers of each pipeline stage of ``layout`` (a resolved layout): its
    ``pp_stage_layers``, or balanced for ``seq_len`` (None: 4096) and the checkpointing ``policy``."""
    stages = layout.pipeline_stages
    if layout.pp_stage_layers is not None:
        return stage_ranges(layout.pp_stage_layers)
    costs = part_costs(cfg, seq_len or DEFAULT_SEQ_LEN, policy, gpu_execution_path(layout))
    return stage_ranges(balanced_split(costs, stages, in_flight_micro_batches(layout)))


def describe_split(cfg: ModelConfig, layout: ParallelLayout, ranges: Sequence[range], seq_len: Optional[int] = None,
                   policy: Optional[ActivationCheckpointing] = None) -> str:
    """One line per rank: its stages' layers and modelled training FLOPs per token (for plans and logs)."""
    costs = part_costs(cfg, seq_len or DEFAULT_SEQ_LEN, policy, gpu_execution_path(layout))
    ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.stages_per_rank)
    parts = []
    for k, layers in enumerate(ranges):
        extra = "+embed" if k == 0 else ""
        extra += "+head" if k == len(ranges) - 1 else ""
        parts.append(f"s{k}@r{ranks[k]} layers {layers.start}-{layers.stop - 1}{extra} "
                     f"{costs.stage_flops(layers) / 1e9:.3g} GFLOP/tok")
    return "; ".join(parts)
