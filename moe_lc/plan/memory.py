"""Memory per GPU of one training step under a layout and a checkpointing policy.

Each pipeline stage is priced on its own and the heaviest one reported; its peak is the larger of
the forward/backward's and the optimizer step's. Terms (bytes per GPU):

- weights: fp32 master weights. FSDP: dense parameters (tp-split ones divided by tp) sharded over
  dp_shard x cp, routed experts (divided by ep) over edp; replicated over dp_replicate (HSDP).
  ZeRO-1: every rank holds its tp/ep slice whole.
- gradients: fp32, sharded like the weights (FSDP) or whole (ZeRO-1).
- optimizer: AdamW 8 B per parameter (two fp32 moments); Muon 4 B (its momentum) per Muon matrix
  and 8 B for the rest (embedding, head, vectors). FSDP: sharded like the weights; ZeRO-1: sharded
  over every data-parallel rank (dp_replicate x dp_shard x cp; experts dp_replicate x edp).
- accumulation: with more than one micro-batch per step FSDP skips the reduce-scatter until the
  last one and keeps every parameter's unsharded gradient in fp32 meanwhile (`reduce_dtype`);
  nothing with ``fsdp_reduce_every_micro_batch`` (a reduce-scatter per micro-batch).
- activations: what the in-flight micro-batches keep for backward
  (`moe_lc.parallel.activation_memory`, per layer and policy, tokens split over cp and tp), 1F1B
  keeping up to ``pp - s`` micro-batches on stage s; under cp the MLA layers that keep their keys
  and values keep them for the whole row (the gathered latents are up-projected on every rank).
- backward: the recompute of one checkpointed layer (the share of it alive at once), the KDA
  backward's buffers, gradients in flight; logits: one chunk of the loss in flight (last stage; the
  fused loss's bf16 logits and their gradient in the forward, or under tensor parallelism a
  recomputed chunk when the loss is chunked, else its log-probabilities are among the
  activations). The two do not overlap: the peak takes the larger.
- buffers: FSDP's all-gathered bf16 parameters (the root's through the step, the largest unit and
  the next one prefetched) and that unit's unsharded gradients (bf16 and their fp32 copy); under
  bf16 autocast over fp32 weights (ZeRO-1, one GPU) the bf16 copy of every weight, experts
  included, which the backward keeps until it passes the weight's layer; the EP
  dispatch's send and receive rows; the residual stream tensors a pipeline stage receives per
  in-flight micro-batch and one send buffer; under cp one MLA layer's gathered latents and the
  whole row's keys and values, and the KDA states' all-gather.
- optimizer step: the state, Muon's working copy of its largest whole matrix (fp32 gathered update,
  bf16 iterate) and ZeRO-1's flat all-reduce buffer of the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from moe_lc.config import ModelConfig
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode
from moe_lc.parallel.activation_memory import (
    FP32,
    ActivationEstimate,
    ExecutionPath,
    backward_working_bytes_per_token,
    embedding_bytes,
    estimate_activations,
    gpu_execution_path,
    layer_activations,
    sources_before_layer,
)
from moe_lc.parallel.compile import RegionalCompile
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.plan.model_facts import EMBEDDING, MTP, ModelFacts, PipelineStage, Share

GiB = 1024**3


def _fused_loss(cfg: ModelConfig, L: Degrees) -> bool:
    """Whether the loss computes its gradients in the forward (``MoELCModel.fuses_head_and_loss``): on
    unless the model config turns it off or tensor parallelism splits the head."""
    return cfg.fused_loss and L.tp == 1

LOSS_CHUNK_ELEMENTS = 1 << 28  # MoELCModel.loss_chunk_elements: logits computed (and recomputed) per chunk
# bf16 logits and their fp32 log-probabilities, one recomputed chunk at a time (the gradient takes the
# log-probabilities' place: measured 1.5 GiB above what is stored for 8192 x 32768 logits on an H200)
LOSS_BYTES_PER_LOGIT = 2 + 4
# The fused loss (one process or FSDP: a plain head, moe_lc.ops.linear_cross_entropy) holds one chunk's
# bf16 logits and their bf16 gradient at a time, in the forward, and keeps no logits for backward.
FUSED_LOSS_BYTES_PER_LOGIT = 2 + 2
ADAMW_STATE = 8  # two fp32 moments
MUON_STATE = 4  # one fp32 momentum buffer
MUON_WORKING_BYTES = FP32 + 2 * 2  # per element of the largest whole matrix: fp32 update, bf16 iterate and result


@dataclass(frozen=True)
class Degrees:
    """A resolved layout's degrees as plain integers (the planner reads them many times per layout)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    edp: int
    world: int
    fsdp: bool
    reduce_every_micro_batch: bool = False  # FSDP without the unsharded accumulation

    @classmethod
    def of(cls, layout: ParallelLayout) -> "Degrees":
        return cls(layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep, layout.edp,
                   layout.world_size, layout.wraps_with_fsdp, layout.fsdp_reduce_every_micro_batch)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class StageShape:
    """What one curriculum stage's step asks for, whatever the layout."""

    seq_len: int
    micro_batch: int
    sequences_per_step: int

    def grad_accum(self, layout: "ParallelLayout | Degrees") -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.sequences_per_step // (self.micro_batch * layout.dp)

    def rank_tokens(self, layout: "ParallelLayout | Degrees") -> int:
        """Tokens of one micro-batch on one rank (cp splits the rows, sequence parallelism the tp ranks)."""
        return self.micro_batch * self.seq_len // (layout.cp * layout.tp)

    @property
    def row_tokens(self) -> int:
        """Tokens of one micro-batch's rows."""
        return self.micro_batch * self.seq_len


@dataclass
class MemoryBreakdown:
    """Bytes per GPU of the heaviest pipeline stage (see the module docstring for each term)."""

    stage: int
    weights: float
    gradients: float
    optimizer: float
    accumulation: float
    activations: float
    backward: float
    logits: float
    buffers: dict[str, float] = field(default_factory=dict)  # fsdp, ep, pp, autocast, cp
    optimizer_step: float = 0.0  # the optimizer step's peak

    @property
    def training_peak(self) -> float:
        """The loss chunk's logits come and go before the layers' backward starts: the larger of the two."""
        return (self.weights + self.gradients + self.optimizer + self.accumulation + self.activations
                + max(self.backward, self.logits) + sum(self.buffers.values()))

    @property
    def total(self) -> float:
        return max(self.training_peak, self.optimizer_step)


def _sharded(share: Share, layout: Degrees, over_replicas: bool) -> float:
    """Parameters of ``share`` per rank after data-parallel sharding (over dp_replicate too for ZeRO-1's state)."""
    L = layout
    replicas = L.dp_replicate if over_replicas else 1
    return share.dense(L.tp) / (L.dp_shard * L.cp * replicas) + share.experts / L.ep / (L.edp * replicas)


def optimizer_bytes_per_param(optimizer: str, updated_by_adamw: bool) -> int:
    """State bytes of one parameter: Muon keeps one buffer for its matrices, AdamW two for the rest."""
    return ADAMW_STATE if optimizer != "muon" or updated_by_adamw else MUON_STATE


class MemoryModel:
    """The memory of a model's steps for one stage shape; cheap to evaluate for many layouts (the
    per-layer sums are made once per pipeline split, policy and execution path)."""

    def __init__(self, facts: ModelFacts, shape: StageShape, optimizer: str,
                 compile: Optional[RegionalCompile] = None) -> None:
        """``compile``: the run's regional-compile policy (None: the layers run eagerly)."""
        self.facts, self.shape, self.optimizer, self.compile = facts, shape, optimizer, compile
        self._per_layer: dict[ExecutionPath, list] = {}
        self._estimates: dict[tuple, ActivationEstimate] = {}
        self._kept: dict[tuple, float] = {}
        self._backward: dict[tuple, float] = {}

    def _layers(self, path: ExecutionPath) -> list:
        if path not in self._per_layer:
            self._per_layer[path] = layer_activations(self.facts.cfg, path)
        return self._per_layer[path]

    def _kept_per_token(self, stage: PipelineStage, policy: ActivationCheckpointing, path: ExecutionPath,
                        loss_tokens: int, fused_loss: bool) -> float:
        """Bytes per token the stage's blocks keep for backward under ``policy`` (``fused_loss``: the loss
        computes its gradients in the forward, as it does without tensor parallelism)."""
        key = (stage.layers, stage.last, policy.mode, policy.every, policy.kda_states, policy.kda_prep, path, loss_tokens,
               fused_loss)
        if key not in self._kept:
            per_policy = key[2:]
            if per_policy not in self._estimates:
                self._estimates[per_policy] = estimate_activations(self.facts.cfg, policy, loss_tokens, path,
                                                                   self._layers(path), fused_loss=fused_loss)
            est = self._estimates[per_policy]
            kept = sum(est.by_layer[f"layer{i}"] for i in stage.layers)
            if stage.last:  # embedding, output mixture, loss and MTP (the embedding's stream tensor is small)
                kept += est.by_layer["other"] + est.by_layer.get("mtp", 0.0)
            self._kept[key] = kept
        return self._kept[key]

    def _backward_per_token(self, policy: ActivationCheckpointing, path: ExecutionPath) -> float:
        key = (policy.mode, policy.every, policy.kda_states, policy.kda_prep, path)
        if key not in self._backward:
            self._backward[key] = backward_working_bytes_per_token(self.facts.cfg, policy, path, self._layers(path))
        return self._backward[key]

    def __call__(self, layout: ParallelLayout, policy: ActivationCheckpointing) -> MemoryBreakdown:
        return self.price(layout, (policy,))[0]

    def price(self, layout: ParallelLayout, policies: Sequence[ActivationCheckpointing]) -> list[MemoryBreakdown]:
        """The heaviest pipeline stage's memory under each of ``policies``."""
        path, L = gpu_execution_path(layout, self.compile), Degrees.of(layout)
        heaviest: list[Optional[MemoryBreakdown]] = [None] * len(policies)
        for stage in self.facts.pipeline_stages(L.pp):
            fixed = self._fixed(stage, L, path)
            for j, policy in enumerate(policies):
                mem = self._with_policy(fixed, stage, L, policy, path)
                if heaviest[j] is None or mem.total > heaviest[j].total:
                    heaviest[j] = mem
        return heaviest

    def _in_flight(self, stage: PipelineStage, L: Degrees) -> int:
        """Micro-batches stage s keeps at once under 1F1B: up to pp - s."""
        return min(L.pp - stage.index, self.shape.grad_accum(L))

    def _fixed(self, stage: PipelineStage, L: Degrees, path: ExecutionPath) -> MemoryBreakdown:
        """Everything but the activations and the backward's working memory (no policy needed)."""
        cfg, shape = self.facts.cfg, self.shape
        params, adamw = stage.params, stage.adamw
        local = params.local(L.tp, L.ep)
        fsdp = L.fsdp
        weights = gradients = FP32 * (_sharded(params, L, over_replicas=False) if fsdp else local)
        state_share = _sharded(params, L, over_replicas=not fsdp)
        adamw_share = _sharded(adamw, L, over_replicas=not fsdp)
        optimizer = (optimizer_bytes_per_param(self.optimizer, False) * (state_share - adamw_share)
                     + optimizer_bytes_per_param(self.optimizer, True) * adamw_share)
        accumulation = FP32 * local if fsdp and shape.grad_accum(L) > 1 and not L.reduce_every_micro_batch else 0.0
        logits = 0.0
        loss_tokens = shape.row_tokens // L.cp
        if stage.last and _fused_loss(cfg, L):  # the fused loss: one chunk in flight, whatever the tokens
            logits = min(loss_tokens * cfg.padded_vocab_size, LOSS_CHUNK_ELEMENTS) * FUSED_LOSS_BYTES_PER_LOGIT
        elif stage.last and loss_tokens * cfg.padded_vocab_size > LOSS_CHUNK_ELEMENTS:  # else kept: in the activations
            logits = min(loss_tokens * (cfg.padded_vocab_size // L.tp), LOSS_CHUNK_ELEMENTS) * LOSS_BYTES_PER_LOGIT

        tokens = shape.rank_tokens(L)
        m, k, e = cfg.mla, cfg.kda, cfg.moe
        buffers = {}
        gathered = path.stream  # FSDP gathers parameters in their compute dtype
        grad_copy = FP32 if gathered < FP32 else 0
        largest_unit = max(stage.largest_dense_unit(L.tp), stage.largest_expert_unit / L.ep)
        root = stage.root.local(L.tp, L.ep)
        buffers["fsdp"] = gathered * root + (2 * gathered + gathered + grad_copy) * largest_unit if fsdp else 0.0
        buffers["ep"] = (2 * tokens * e.top_k * (e.latent_dim or cfg.d_model) * path.act
                         if L.ep > 1 and stage.moe_blocks else 0.0)
        buffers["pp"] = 0.0
        if not stage.first:
            sources = sources_before_layer(cfg, stage.layers.start)
            received = self._in_flight(stage, L) + 1  # one set per micro-batch in flight, one send buffer
            buffers["pp"] = sources * tokens * cfg.d_model * max(embedding_bytes(cfg, path), path.act) * received
        buffers["autocast"] = 0.0  # depends on the policy: _with_policy
        buffers["cp"] = 0.0
        if L.cp > 1 and stage.mla_layers:
            buffers["cp"] += self._row_kv(L, path) + shape.row_tokens * (m.kv_lora_rank + m.qk_rope_dim) * path.act
        if L.cp > 1 and len(stage.mla_layers) < len(stage.layers):
            buffers["cp"] += L.cp * 2 * k.num_heads / L.tp * k.head_dim * 2 * k.head_dim * FP32

        muon = MUON_WORKING_BYTES * stage.largest_gathered_matrix if self.optimizer == "muon" else 0.0
        flat = 0.0 if fsdp else FP32 * max(params.dense(L.tp), params.experts / L.ep)
        optimizer_step = weights + gradients + optimizer + muon + flat
        return MemoryBreakdown(stage.index, weights, gradients, optimizer, accumulation, 0.0, 0.0, logits, buffers,
                               optimizer_step)

    def _row_kv(self, L: Degrees, path: ExecutionPath) -> float:
        """One MLA layer's keys and values for the whole row, this rank's heads."""
        m = self.facts.cfg.mla
        return self.shape.row_tokens * m.num_heads / L.tp * (m.qk_dim + m.v_dim) * path.act

    def _with_policy(self, fixed: MemoryBreakdown, stage: PipelineStage, L: Degrees,
                     policy: ActivationCheckpointing, path: ExecutionPath) -> MemoryBreakdown:
        tokens = self.shape.rank_tokens(L)
        activations = tokens * self._kept_per_token(stage, policy, path, tokens * L.tp,  # the loss sees T / cp
                                                    _fused_loss(self.facts.cfg, L))
        if L.cp > 1:  # the whole row's keys and values, kept by each MLA layer that is not fully recomputed
            recomputed = policy.mode == CheckpointMode.full
            keeps_kv = sum(1 for i in stage.mla_layers if not (recomputed and policy.checkpoints(i)))
            activations += keeps_kv * self._row_kv(L, path) * (1 - 1 / L.cp)
        activations *= self._in_flight(stage, L)
        backward = tokens * self._backward_per_token(policy, path)
        buffers = {**fixed.buffers, "autocast": self._autocast_copies(stage, L, policy) if path.casts else 0.0}
        return MemoryBreakdown(fixed.stage, fixed.weights, fixed.gradients, fixed.optimizer, fixed.accumulation,
                               activations, backward, fixed.logits, buffers, fixed.optimizer_step)

    def _autocast_copies(self, stage: PipelineStage, L: Degrees, policy: ActivationCheckpointing) -> float:
        """bf16 autocast over fp32 weights: every matmul weight's bf16 copy (the experts' too: grouped_glu
        casts them as autocast casts a matmul's) is kept for backward until the backward passes its
        layer; a checkpointed layer makes its copies again in its backward, one layer at a time. The
        embedding is looked up, not cast. (Measured on an H200: ~130 MB a layer of the proxy without
        checkpointing, none visible under full checkpointing.)"""
        checkpoint_index = {f"layer{i}": i for i in stage.layers} | {MTP: self.facts.cfg.num_layers}
        kept, recomputed = 0.0, 0.0
        for block in stage.blocks:
            if block.label == EMBEDDING:
                continue
            copy = 2 * block.params.local(L.tp, L.ep)
            index = checkpoint_index.get(block.label)
            if index is not None and policy.mode != CheckpointMode.none and policy.checkpoints(index):
                recomputed = max(recomputed, copy)
            else:
                kept += copy
        return kept + recomputed
