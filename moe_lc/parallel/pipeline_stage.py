"""Pipeline stages: what crosses each boundary, and a stage as a view of the model's layers.

With Attention Residuals every sublayer mixes all sources completed so far (the embedding, the
closed block sums) and the running partial sum, so the state between two stages is the whole
`ResidualStream`, not one tensor. Counted from the config (the stream's rules, `model/attn_res.py`),
at the input of the stage that starts at decoder layer a:

    block:  1 + a // block_size completed sources, and a partial sum unless a % block_size == 0
    full:   1 + 2 a sources (every sublayer output is one), no partial sum
    none:   no sources, the plain residual as the partial

A rank sees every source of a micro-batch once: a later stage on the same rank (virtual stages,
the V's second leg) reuses the ones its earlier stage had, so the boundary into stage k carries
only the sources completed since that earlier stage (``BoundaryPlan.sent``) and the partial sum:
per token, d x (sent + 1) values. In backward the gradients of the reused sources go back to the
rank's earlier stage without leaving the rank (`pipeline_runtime`).

`PipelineStage` is a stage's module: the decoder layers it runs (with the embedding on the first
stage; the output mixer, final norm, LM head, loss and MTP on the last), all of them the model's
own modules, so parameter names stay the model's. `keep_stage_parts` removes from a rank's model
what none of its stages run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.model.attn_res import ResidualStream
from moe_lc.model.transformer import MoELCModel, balance_loss
from moe_lc.ops.documents import DocumentBounds
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.loss_weights import TermWeights, weighted_balance, weighted_terms
from moe_lc.parallel.pipeline_schedule import stage_ranks
from moe_lc.parallel.pipeline_split import pipeline_split


def sources_before(cfg: ModelConfig, layer: int) -> tuple[int, bool]:
    """(completed sources, whether there is a partial sum) of the stream before decoder layer ``layer``
    (``num_layers``: after the last)."""
    mode, size = cfg.attn_res.mode, cfg.attn_res.block_size
    if mode == "none":
        return 0, True
    if mode == "full":
        return 1 + 2 * layer, False
    return 1 + layer // size, layer % size != 0


@dataclass(frozen=True)
class BoundaryPlan:
    """The stream at one stage's input and what of it its rank already has."""

    stage: int
    rank: int  # the pp rank holding the stage
    layers: range
    sources: int  # completed sources at the stage's input
    partial: bool  # the input has a partial sum
    held: int  # sources 0 .. held - 1 are on the rank already (from its earlier stage on this micro-batch)
    local: bool = False  # the previous stage is on the same rank (the V's turn): nothing crosses ranks

    @property
    def sent(self) -> range:
        """The sources the boundary into this stage carries."""
        return range(self.held, self.sources)

    def tensors(self) -> int:
        """Tensors of [tokens, d] that cross ranks into this stage (0 for the first stage and a local boundary)."""
        return 0 if self.stage == 0 or self.local else len(self.sent) + int(self.partial)


def boundary_plans(cfg: ModelConfig, stage_layers: Sequence[range], ranks: Sequence[int]) -> list[BoundaryPlan]:
    """For every stage (layers ``stage_layers[k]`` on pp rank ``ranks[k]``), its input and what crosses into it."""
    plans = []
    for k, layers in enumerate(stage_layers):
        sources, partial = sources_before(cfg, layers.start)
        earlier = [j for j in range(k) if ranks[j] == ranks[k]]
        held = sources_before(cfg, stage_layers[earlier[-1]].stop)[0] if earlier else 0
        local = k > 0 and ranks[k - 1] == ranks[k]
        plans.append(BoundaryPlan(k, ranks[k], layers, sources, partial, held if k > 0 else 0, local))
    return plans


def boundary_bytes_per_token(cfg: ModelConfig, plan: BoundaryPlan, dtype_bytes: int) -> int:
    """Bytes per token into ``plan``'s stage in one direction (its gradients take the same back)."""
    return cfg.d_model * plan.tensors() * dtype_bytes


@dataclass(frozen=True)
class PipelinePlan:
    """A layout's pipeline: every stage's layers, rank and input boundary."""

    layers: tuple[range, ...]
    ranks: tuple[int, ...]
    boundaries: tuple[BoundaryPlan, ...]

    def stages_of(self, rank: int) -> list[int]:
        return [k for k, r in enumerate(self.ranks) if r == rank]


def plan_pipeline(
    cfg: ModelConfig,
    layout: ParallelLayout,
    seq_len: Optional[int] = None,
    policy: Optional[ActivationCheckpointing] = None,
) -> PipelinePlan:
    """The stages of a (resolved, pp > 1) layout: its split (balanced for ``seq_len`` under ``policy``
    unless it lists ``pp_stage_layers``), placement and boundaries."""
    layers = tuple(pipeline_split(cfg, layout, seq_len, policy))
    ranks = stage_ranks(layout.pp_schedule, layout.pp, layout.stages_per_rank)
    return PipelinePlan(layers, ranks, tuple(boundary_plans(cfg, layers, ranks)))


def build_stages(model: MoELCModel, plan: PipelinePlan, rank: int) -> dict[int, PipelineStage]:
    """The stage modules of pp rank ``rank``, by stage index (build after tensor and expert parallelism:
    they reference the modules those swap in)."""
    last = len(plan.layers) - 1
    mine = plan.stages_of(rank)
    return {k: PipelineStage(model, plan.boundaries[k], k == last, shares_embedding=0 in mine) for k in mine}


# ----------------------------------------------------------------------------- one micro-batch


@dataclass
class StageBatch:
    """What every stage of one micro-batch reads besides the stream (host-known: no stage sends it)."""

    tokens: int  # T, the packed row's length
    input_ids: Optional[Tensor]  # [1, T] on the device (first stage); this rank's [1, T / cp] under cp
    labels: Optional[Tensor]  # [1, T] on the device (last stage); likewise
    docs: Optional[DocumentBounds]  # rebuilt on every rank from the host boundaries (this rank's view under cp)
    weights: TermWeights  # the micro-batch's weights in the step's loss on this rank (n_i / N without cp)
    mtp_targets: Optional[Tensor] = None  # MTP's targets (last stage, under cp); None: made from the labels
    # evaluation (forward only): the last stage returns measure(logits, labels) per position instead of a loss
    measures: tuple[Callable[[Tensor, Optional[Tensor]], Tensor], ...] = ()


class StageResult(NamedTuple):
    """A stage's forward on one micro-batch (tensors only, so that module hooks find them)."""

    produced: tuple[Tensor, ...]  # the sources completed in this stage, in order
    partial: Optional[Tensor]  # the partial sum at its output (non-last stages)
    objective: Optional[Tensor]  # its share of the step's loss: LM + MTP (last), balance losses, weighted
    lm_term: Optional[Tensor]  # the objective's LM term, detached (last stage)
    extra: Optional[Tensor]  # its MTP and balance terms, detached
    measured: tuple[Tensor, ...] = ()  # evaluation: the batch's measures (last stage)


class PipelineStage(nn.Module):
    """One stage: the model's decoder layers ``plan.layers`` (and, on the first stage, the embedding;
    on the last, the output mixer, final norm, LM head + loss and MTP), run on one micro-batch.

    A view of the model, built from outside it: the modules are the model's own (``self.layers`` holds
    references), and the computation is the model's (`MoELCModel.start_stream`, `run_layers`,
    `head_input`, `objective`). The model itself is reached through an unregistered reference, so the
    stage's parameters are exactly those of the parts it runs.
    """

    def __init__(self, model: MoELCModel, plan: BoundaryPlan, last: bool, shares_embedding: bool) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: methods only
        self.plan, self.last = plan, last
        self.layers = nn.ModuleList(model.layers[i] for i in plan.layers)
        if plan.stage == 0:
            self.embed = model.embed
        if last:
            self.out_mixer, self.final_norm, self.lm_head = model.out_mixer, model.final_norm, model.lm_head
            self.mtp = model.mtp
            if model.mtp is not None and not shares_embedding:
                self.embed = model.embed  # MTP's next-token embedding: this rank's copy of the first stage's
        # modules the stage calls without holding them: on a rank with the first and the last stage (V
        # placement), MTP reads the first stage's embedding
        self.borrowed = (model.embed,) if last and model.mtp is not None and shares_embedding else ()
        self.moe = [layer.ffn for layer in self.layers if layer.is_moe]
        if last and model.mtp is not None and model.mtp.layer.is_moe:
            self.moe.append(model.mtp.layer.ffn)

    def weights(self) -> list[nn.Parameter]:
        """Every parameter the stage's computation uses (its own and the borrowed modules')."""
        return [*self.parameters(), *(p for m in self.borrowed for p in m.parameters())]

    def forward(self, *stream: Tensor, batch: StageBatch) -> StageResult:
        """``stream``: the input's sources then its partial sum (empty on the first stage)."""
        model, plan = self.model, self.plan
        if plan.stage == 0:
            state = model.start_stream(batch.input_ids)
        else:
            sources, partial = stream[: plan.sources], (stream[plan.sources] if plan.partial else None)
            state = ResidualStream(model.cfg.attn_res.mode, tuple(sources), partial)
        state = model.run_layers(state, self.layers, batch.docs)
        produced = state.sources[plan.sources if plan.stage > 0 else 0:] if state.mode != "none" else ()
        if not self.last:
            aux = balance_loss(self.moe)
            if aux is None:
                return StageResult(tuple(produced), state.partial, None, None, None)
            objective = weighted_balance(aux, batch.weights)
            return StageResult(tuple(produced), state.partial, objective, None, objective.detach())
        if batch.measures:
            logits = model.logits_from_hidden(model.head_input(state))
            return StageResult((), None, None, None, None, tuple(m(logits, batch.labels) for m in batch.measures))
        out = model.objective(model.head_input(state), batch.labels, batch.docs, False, self.moe, batch.mtp_targets)
        lm, extra = weighted_terms(out.lm_loss, out.mtp_loss, out.aux_loss, model.mtp_weight, batch.weights)
        return StageResult((), None, lm + extra, lm.detach(), extra.detach())


def keep_stage_parts(model: MoELCModel, stage_layers: Sequence[range], stages: Sequence[int]) -> MoELCModel:
    """Remove from ``model`` (in place) every part that none of ``stages`` (this rank's) runs; names stay.

    The decoder layers kept stay under their indices (`layers.<i>.…`); the embedding stays on the
    rank of the first stage and, with MTP, of the last one (its copy, kept equal by summing the two
    gradients); the output mixer, final norm, LM head and MTP stay on the last stage's rank.
    """
    last = len(stage_layers) - 1
    keep = {i for k in stages for i in stage_layers[k]}
    model.layers = KeptLayers({i: layer for i, layer in enumerate(model.layers) if i in keep})
    if 0 not in stages and not (last in stages and model.mtp is not None):
        model.embed = None
    if last not in stages:
        model.out_mixer = model.final_norm = model.lm_head = model.mtp = None
    model.register_forward_pre_hook(_not_a_whole_model)
    return model


def _not_a_whole_model(module: nn.Module, args) -> None:
    raise ConfigError("this model holds one pipeline stage's layers only (pp > 1); train it through its pipeline "
                      "(parallel_context(model).pipeline) or build a whole model for a single-stage layout")


class KeptLayers(nn.Module):
    """The decoder layers a rank keeps, registered under their indices in the whole model (so that
    parameter and checkpoint names do not depend on the split); iterates them in order."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, layer in sorted(layers.items()):
            self.add_module(str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]


def stream_shape(batch_tokens: int, tp: int, cp: int, d_model: int) -> torch.Size:
    """The shape of one stream tensor on a rank: [1, tokens / (cp x tp), d] (sequence parallelism and
    context parallelism split the packed row evenly)."""
    return torch.Size((1, batch_tokens // (cp * tp), d_model))
