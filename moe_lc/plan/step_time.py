"""Time of one training step under a layout: compute by kind of work, communication from bytes and links.

Per pipeline stage s and micro-batch, on one GPU of the stage:

    t_compute(s) = tokens x sum over its layers of (
                       sum over kinds k of FLOPs_k per token / (peak x rate_k)
                       + memory_passes x bytes the layer keeps for backward per token / HBM)

with tokens = micro_batch x seq_len / (cp x tp), the FLOPs of `moe_lc.model.accounting` per decoder
layer split into dense GEMMs, the routed experts' grouped GEMMs, attention (within documents:
``keys_per_token``, else one document per row) and the KDA recurrence, each at the rate measured
for its kernels (`moe_lc.plan.hardware.MEASURED_RATES`), and the memory-bound kernels (norms,
mixtures, activations, casts, copies) priced as ``memory_passes`` reads or writes of what the layer
keeps for backward without checkpointing (`moe_lc.parallel.activation_memory`); the LM head
and the MTP module on the last stage. Full checkpointing adds one forward (a third of a layer's
time) per checkpointed layer; selective adds a third of the memory passes over what it drops (the
elementwise work it recomputes). Communication (bf16 activations,
sizes in bytes per micro-batch):

- tp: each decoder layer's token mixer and dense GLU (dense FFN, shared experts) all-gather their
  input and reduce-scatter their output, N d per collective (N = micro_batch x seq_len / cp): 4 in
  the forward (2 without a dense GLU), as many in the backward and in the recompute of a
  checkpointed layer (either policy: collectives are not outputs the selective policy keeps);
  embedding and LM head 2 each;
- ep: per MoE layer the dispatch and the combine all-to-all (forward, backward, recompute) of
  tokens x top_k x latent values per rank, spread over the ep group (uniform routing);
- cp: per MLA layer the all-gather of the row's latents, N (kv_lora_rank + qk_rope_dim), and its
  reduce-scatter in backward; per KDA layer the all-gather of cp x 2 H/tp K (K + V) fp32 states;
- pp: the residual stream tensors crossing a stage boundary, forward and backward;
- FSDP: each micro-batch all-gathers the stage's parameters (forward and backward), overlapped with
  its compute, only the excess exposed; the last micro-batch's backward hides the gradients'
  reduce-scatter (fp32) and HSDP's all-reduce across dp_replicate up to its own length;
- ZeRO-1: the gradients' all-reduce and the updated parameters' broadcast after the backward, exposed.

Link costs: a ring all-gather or reduce-scatter of S bytes over g ranks takes (g - 1) / g x S / B,
an all-reduce twice that, with B NVLink when the group lies in one node, else the network's
per-GPU bandwidth; an all-to-all of S bytes per rank sends (q - 1) / g x S over NVLink and
(g - q) / g x S over the network at once (q of its ranks in one node); a point-to-point send S / B.
TP, EP, CP and PP communication is exposed (on the critical path).

    step = (m + pp - 1) x max_s t_micro(s) + exposed gradient sync + optimizer

with t_micro = max(t_compute + exposed communication, t_host), m micro-batches per data-parallel rank
(1F1B: (pp - 1) micro-batch slots are the bubble). t_host is what the host needs to issue a
micro-batch: a measured time per decoder layer (`moe_lc.plan.hardware.HOST_LAYER_SECONDS`, whatever
the layer's width), and a measured share more for a checkpointed layer (its recompute). Small micro-batches (one
8K row of a narrow model) are bound by it: the GPU waits, which the ``host`` term counts.

The optimizer step reads and writes its state at the fused optimizer's measured share of the HBM
bandwidth (AdamW 28 B per parameter of the shard, Muon 20 B, and the gradient norm's read of 4 B)
and runs Muon's Newton-Schulz (dense GEMMs) on its
matrices: expert blocks on the shard that holds them whole (every edp rank when the shard splits an
expert), per-head blocks on the shard, other matrices whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from moe_lc.model.accounting import (
    head_training_flops,
    layer_training_flops_by_kind,
    mtp_training_flops_by_kind,
    training_flops_per_token,
)
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.activation_memory import (ExecutionPath, LayerActivations, gpu_execution_path, layer_activations,
                                               sources_before_layer)
from moe_lc.parallel.compile import RegionalCompile
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.plan.hardware import HOST_RECOMPUTE_SHARE, Cluster
from moe_lc.plan.memory import Degrees, StageShape
from moe_lc.plan.model_facts import ModelFacts, PipelineStage, Share

ACT = 2  # bf16 activations on the wire
FP32 = 4  # gradient reduction, ZeRO-1's updated parameters, KDA states
ADAMW_BYTES = 16 + 12  # read weight, gradient, two moments; write weight and moments (fp32)
MUON_BYTES = 12 + 8  # read weight, gradient, momentum; write weight and momentum
NORM_BYTES = 4  # the gradient norm (clipping) reads every fp32 gradient once
TERMS = ("compute", "host", "bubble", "tp", "ep", "cp", "pp", "fsdp", "dp_sync", "optimizer")


@dataclass(frozen=True)
class Group:
    """A communication group: its size and how many of its ranks share a node."""

    size: int
    per_node: int

    @classmethod
    def of(cls, cluster: Cluster, size: int, stride: int) -> "Group":
        return cls(size, cluster.members_per_node(size, stride))


def ring_time(cluster: Cluster, total_bytes: float, group: Group) -> float:
    """One all-gather or reduce-scatter of a ``total_bytes`` tensor over ``group``."""
    if group.size <= 1:
        return 0.0
    bandwidth = cluster.nvlink if group.per_node >= group.size else cluster.inter_node
    return (group.size - 1) / group.size * total_bytes / bandwidth


def all_reduce_time(cluster: Cluster, total_bytes: float, group: Group) -> float:
    return 2 * ring_time(cluster, total_bytes, group)


def all_to_all_time(cluster: Cluster, bytes_per_rank: float, group: Group) -> float:
    """One all-to-all in which every rank spreads ``bytes_per_rank`` evenly over the group."""
    if group.size <= 1:
        return 0.0
    q, g = min(group.per_node, group.size), group.size
    return max((q - 1) / g * bytes_per_rank / cluster.nvlink, (g - q) / g * bytes_per_rank / cluster.inter_node)


@dataclass
class StepTime:
    """Seconds of one step by term (each as it adds to the step: communication only where exposed)."""

    compute: float  # all micro-batches of the critical stage, the recompute included
    recompute: float  # the part of compute that is activation checkpointing's second forward
    host: float  # the GPU waiting for the host, where issuing a micro-batch takes longer than running it
    bubble: float
    tp: float
    ep: float
    cp: float
    pp: float
    fsdp: float  # all-gathers not hidden behind compute
    dp_sync: float  # gradient reduction after the last micro-batch (FSDP: beyond its backward; ZeRO-1: all)
    optimizer: float
    stage: int  # the pipeline stage that sets the pace
    model_flops: float  # per step, for MFU

    @property
    def step(self) -> float:
        return sum(getattr(self, t) for t in TERMS)

    def mfu(self, cluster: Cluster) -> float:
        return self.model_flops / (self.step * cluster.gpus * cluster.gpu.bf16_peak)

    def largest_overhead(self) -> tuple[str, float]:
        """The term besides compute that costs the most, and its share of the step."""
        name = max(TERMS[1:], key=lambda t: getattr(self, t))
        return name, getattr(self, name) / self.step


@dataclass(frozen=True)
class _StageWork:
    """What a pipeline stage does per token and micro-batch under a policy, whatever the degrees."""

    seconds: float  # per token, forward + backward
    recompute: float  # per token, the recompute's extra forward
    tp_collectives: int  # all-gathers and reduce-scatters of N d
    moe_passes: int  # MoE layer passes (each: a dispatch and a combine all-to-all)
    mla_passes: int  # MLA layer passes (each: one latent gather or its reduce-scatter under cp)
    kda_passes: int
    boundary_sources: int  # residual stream tensors sent to the next stage (or back to the previous)
    host_layers: float  # decoder layers the host issues per micro-batch, a recompute's share included


@dataclass
class _Micro:
    compute: float
    recompute: float
    tp: float
    ep: float
    cp: float
    pp: float
    fsdp_gather: float
    sync: float  # exposed gradient reduction at the step's end
    host: float  # the host's time to issue the micro-batch

    @property
    def exposed_fsdp(self) -> float:
        return max(0.0, self.fsdp_gather - self.compute)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.ep + self.cp + self.pp + self.exposed_fsdp

    @property
    def paced(self) -> float:
        """The micro-batch's time: its work, or the host's issuing where that is longer."""
        return max(self.total, self.host)


@dataclass(frozen=True)
class _Rates:
    """Seconds per unit of a stage's work on one GPU under one layout."""

    stage: PipelineStage
    tokens: int  # of one micro-batch on one GPU
    tp_collective: float
    moe_pass: float  # a dispatch and a combine all-to-all
    mla_pass: float  # the latents' all-gather (or its reduce-scatter)
    kda_pass: float  # the states' all-gather
    pp_source: float  # one residual-stream tensor over the stage boundaries
    fsdp_gather: float  # per micro-batch, forward and backward
    fsdp_reduce: float  # one micro-batch's gradient reduction (the last one's, or each one's)
    zero1_sync: float
    optimizer: float
    host_layer: float  # the host's seconds per decoder layer and micro-batch

    def micro(self, w: _StageWork) -> _Micro:
        compute = (w.seconds + w.recompute) * self.tokens
        sync = max(0.0, self.fsdp_reduce - 2 / 3 * compute) + self.zero1_sync
        return _Micro(compute, w.recompute * self.tokens, w.tp_collectives * self.tp_collective,
                      w.moe_passes * self.moe_pass, w.mla_passes * self.mla_pass + w.kda_passes * self.kda_pass,
                      w.boundary_sources * self.pp_source, self.fsdp_gather, sync, w.host_layers * self.host_layer)


class TimeModel:
    """Step time for one model, stage shape and cluster; cheap to evaluate for many layouts (each
    stage's work is summed once per pipeline split, policy and execution path)."""

    def __init__(self, facts: ModelFacts, shape: StageShape, cluster: Cluster, optimizer: str,
                 compile: Optional[RegionalCompile] = None, keys_per_token: Optional[float] = None) -> None:
        """``compile``: the run's regional-compile policy (None: eager layers); ``keys_per_token``: the mean
        keys an attention query sees (`moe_lc.model.accounting.causal_keys_per_token` of the data's
        documents; None: one document per row)."""
        cfg = facts.cfg
        self.facts, self.shape, self.cluster, self.optimizer, self.compile = facts, shape, cluster, optimizer, compile
        seq = shape.seq_len
        self.layer_flops = [layer_training_flops_by_kind(cfg, i, seq, keys_per_token) for i in range(cfg.num_layers)]
        self.mtp_flops = mtp_training_flops_by_kind(cfg, seq, keys_per_token)
        self.head_seconds = head_training_flops(cfg) / cluster.flops("dense_gemm")
        self.model_flops_per_token = training_flops_per_token(cfg, seq, keys_per_token)
        self._work: dict[tuple, _StageWork] = {}
        self._layers: dict[ExecutionPath, list[LayerActivations]] = {}

    def __call__(self, layout: ParallelLayout, policy: ActivationCheckpointing) -> StepTime:
        return self.price(layout, (policy,))[0]

    def price(self, layout: ParallelLayout, policies: Sequence[ActivationCheckpointing]) -> list[StepTime]:
        """The step time under each of ``policies``."""
        shape, L = self.shape, Degrees.of(layout)
        m = shape.grad_accum(L)
        path = gpu_execution_path(layout, self.compile)
        rates = [self._rates(stage, L) for stage in self.facts.pipeline_stages(L.pp)]
        times = []
        for policy in policies:
            micros = [r.micro(self._stage_work(r.stage, policy, path)) for r in rates]
            crit = max(range(len(micros)), key=lambda s: micros[s].paced)
            c = micros[crit]
            times.append(StepTime(
                compute=m * c.compute, recompute=m * c.recompute, host=m * (c.paced - c.total),
                bubble=(L.pp - 1) * c.paced,
                tp=m * c.tp, ep=m * c.ep, cp=m * c.cp, pp=m * c.pp, fsdp=m * c.exposed_fsdp,
                dp_sync=max(u.sync for u in micros) * (m if L.reduce_every_micro_batch else 1), optimizer=max(r.optimizer for r in rates), stage=crit,
                model_flops=shape.sequences_per_step * shape.seq_len * self.model_flops_per_token,
            ))
        return times

    def _seconds(self, flops: dict[str, float]) -> float:
        """Seconds per token of FLOPs by kind, each at its rate."""
        return sum(f / self.cluster.flops(kind) for kind, f in flops.items() if f)

    def _memory_seconds(self, nbytes: float) -> float:
        """Seconds per token of the memory-bound kernels around ``nbytes`` kept per token."""
        return self.cluster.rates.memory_passes * nbytes / self.cluster.hbm

    def _stage_work(self, stage: PipelineStage, policy: ActivationCheckpointing, path: ExecutionPath) -> _StageWork:
        key = (stage.layers, stage.first, stage.last, policy.mode, policy.every, path)
        if key in self._work:
            return self._work[key]
        cfg = self.facts.cfg
        if path not in self._layers:
            self._layers[path] = layer_activations(cfg, path)
        kept = self._layers[path]  # the trunk's layers, then the MTP layer's
        mtp = cfg.num_layers  # the MTP layer's index for the policy
        full = policy.mode == CheckpointMode.full
        layers = list(stage.layers) + ([mtp] if stage.last and cfg.mtp else [])
        mla = set(stage.mla_layers) | {mtp}

        def passes(i: int) -> int:  # forward, backward and a checkpointed layer's recompute
            return 3 if policy.checkpoints(i) else 2

        seconds = recompute = host_layers = 0.0
        for i in layers:
            host_layers += 1 + (HOST_RECOMPUTE_SHARE if policy.checkpoints(i) else 0.0)
            flops = self.mtp_flops if i == mtp else self.layer_flops[i]
            layer = self._seconds(flops) + self._memory_seconds(kept[i].none)
            seconds += layer
            if policy.checkpoints(i):
                recompute += layer / 3 if full else self._memory_seconds(kept[i].none - kept[i].selective) / 3
        if stage.last:
            seconds += self.head_seconds
        boundary = sources_before_layer(cfg, stage.layers.stop if not stage.last else stage.layers.start)
        work = _StageWork(
            seconds, recompute,
            tp_collectives=sum(self._tp_regions(i) * 2 * passes(i) for i in layers)
            + 2 * stage.first + 2 * stage.last,  # the embedding's and the head's
            moe_passes=sum(passes(i) for i in layers if not cfg.is_dense_layer(i)),
            mla_passes=sum(passes(i) for i in layers if i in mla),
            kda_passes=sum(passes(i) for i in layers if i not in mla),
            boundary_sources=boundary,
            host_layers=host_layers,
        )
        self._work[key] = work
        return work

    def _tp_regions(self, layer: int) -> int:
        """Tensor-parallel regions of a layer (each: an all-gather in, a reduce-scatter out): its token mixer
        and its dense GLU (the dense FFN, or the MoE's shared experts when it has any)."""
        cfg = self.facts.cfg
        return 1 + (cfg.is_dense_layer(layer) or cfg.moe.num_shared > 0)

    def _rates(self, stage: PipelineStage, L: Degrees) -> _Rates:
        """What each unit of the stage's work costs under the degrees ``L`` (no policy needed)."""
        cfg, shape, cluster = self.facts.cfg, self.shape, self.cluster
        tokens = shape.rank_tokens(L)
        e, k = cfg.moe, cfg.kda
        cp_group = Group.of(cluster, L.cp, L.tp)
        latents = shape.row_tokens * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_dim) * ACT
        states = L.cp * 2 * k.num_heads / L.tp * k.head_dim * 2 * k.head_dim * FP32
        pp_source = 0.0
        if L.pp > 1:
            neighbours = Group.of(cluster, 2, L.world // L.pp)  # consecutive stages
            bandwidth = cluster.nvlink if neighbours.per_node >= 2 else cluster.inter_node
            sends = (not stage.last) + (not stage.first)  # the forward's activations out, the gradients back
            pp_source = sends * tokens * cfg.d_model * ACT / bandwidth

        params = stage.params
        dense_group = Group.of(cluster, L.dp_shard * L.cp, L.tp)
        expert_group = Group.of(cluster, L.edp, L.ep)
        dense_local, experts_local = params.dense(L.tp), params.experts / L.ep
        gather, reduce, zero1 = 0.0, 0.0, 0.0
        if L.fsdp:
            gather = 2 * (ring_time(cluster, dense_local * ACT, dense_group)
                          + ring_time(cluster, experts_local * ACT, expert_group))
            replicas = Group.of(cluster, L.dp_replicate, L.dp_shard * L.cp * L.tp)
            reduce = (ring_time(cluster, dense_local * FP32, dense_group)
                      + ring_time(cluster, experts_local * FP32, expert_group)
                      + all_reduce_time(cluster, dense_local / dense_group.size * FP32, replicas)
                      + all_reduce_time(cluster, experts_local / expert_group.size * FP32, replicas))
        else:  # the gradients' all-reduce, then each owner's updated fp32 values to every rank
            dense_dp = Group.of(cluster, L.dp_replicate * L.dp_shard * L.cp, L.tp)
            expert_dp = Group.of(cluster, L.dp_replicate * L.edp, L.ep)
            zero1 = (all_reduce_time(cluster, dense_local * FP32, dense_dp)
                     + all_reduce_time(cluster, experts_local * FP32, expert_dp)
                     + ring_time(cluster, dense_local * FP32, dense_dp)
                     + ring_time(cluster, experts_local * FP32, expert_dp))
        return _Rates(
            stage,
            tokens=tokens,
            tp_collective=ring_time(cluster, shape.row_tokens / L.cp * cfg.d_model * ACT,
                                    Group.of(cluster, L.tp, 1)),
            moe_pass=2 * all_to_all_time(cluster, tokens * e.top_k * (e.latent_dim or cfg.d_model) * ACT,
                                         Group.of(cluster, L.ep, 1)),
            mla_pass=ring_time(cluster, latents, cp_group),
            kda_pass=ring_time(cluster, states, cp_group),
            pp_source=pp_source,
            fsdp_gather=gather, fsdp_reduce=reduce, zero1_sync=zero1,
            optimizer=self._optimizer_time(stage, L),
            host_layer=cluster.host_layer_s,
        )

    def _optimizer_time(self, stage: PipelineStage, L: Degrees) -> float:
        cluster, fsdp = self.cluster, L.fsdp
        replicas = 1 if fsdp else L.dp_replicate
        dense_ranks = L.dp_shard * L.cp * replicas
        expert_ranks = L.edp * replicas

        def shard(share: Share) -> float:
            return share.dense(L.tp) / dense_ranks + share.experts / L.ep / expert_ranks

        params, adamw = shard(stage.params), shard(stage.adamw)
        hbm = cluster.gpu.hbm_bandwidth * cluster.rates.optimizer_hbm
        if self.optimizer != "muon":
            return (ADAMW_BYTES + NORM_BYTES) * params / hbm
        hbm_bytes = MUON_BYTES * (params - adamw) + ADAMW_BYTES * adamw + NORM_BYTES * params
        ns = stage.newton_schulz
        whole_experts = not fsdp or (self.facts.expert_count // L.ep) % L.edp == 0
        flops = ns.experts / L.ep / (expert_ranks if whole_experts else 1)
        flops += ns.heads / L.tp / dense_ranks
        flops += ns.whole if fsdp else ns.whole / dense_ranks
        return hbm_bytes / hbm + flops / cluster.flops()
