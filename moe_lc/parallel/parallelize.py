"""``parallelize(model, layout, mesh, checkpointing)``: PP, TP/SP, EP, activation checkpointing and data
parallelism around an unchanged model.

Order: the pipeline split (the rank keeps only its stages' parts of the model, under their names),
tensor parallelism (DTensor parameters on the tp mesh, sequence-parallel regions, vocab-parallel
embedding/head/loss), expert parallelism (expert weights on the ep mesh, the all-to-all dispatch),
FP8 linears (``precision=fp8``), local-parameter hooks, activation checkpointing of the decoder layers (a recompute then reruns the
hooks and collectives above, inside the layer), the pipeline's stage modules (views of the layers
as they now are), then FSDP2 (it must come last: it wraps DTensor parameters from the same root
mesh and its hooks must run outside ours; under a pipeline each stage is a root).

Context parallelism needs no change to the model: its inputs are each rank's shard of the row
(``moe_lc.parallel.context.shard_model_inputs``), its ops run context-parallel where ``docs.shard``
is set, and the dense parameters' gradients are summed over dp_shard x cp (FSDP shards over the
two flattened; ZeRO-1 all-reduces over dp x cp), the experts' over edp, which holds cp already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe_lc.config import ConfigError
from moe_lc.model.moe import LatentMoE
from moe_lc.model.transformer import MoELCModel
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from moe_lc.parallel.data_parallel import DataParallelGroups, apply_fsdp, mixed_precision_policy
from moe_lc.parallel.expert_parallel import apply_expert_parallel
from moe_lc.parallel.compile import RegionalCompile, apply_compile
from moe_lc.parallel.float8 import Float8Training, apply_float8
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.local_params import expose_all_local_parameters
from moe_lc.parallel.mesh import build_expert_mesh, data_parallel_group, dims_group
from moe_lc.parallel.pipeline_runtime import Pipeline
from moe_lc.parallel.pipeline_stage import build_stages, keep_stage_parts, plan_pipeline
from moe_lc.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelContext:
    """What ``parallelize`` did, kept on the model as ``model.moe_lc_parallel``."""

    layout: ParallelLayout
    mesh: DeviceMesh
    expert_mesh: DeviceMesh
    dp_groups: DataParallelGroups
    pipeline: Optional[Pipeline] = None  # this rank's pipeline stages (pp > 1)


def parallelize(
    model: MoELCModel,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    checkpointing: Optional[ActivationCheckpointing] = None,
    seq_len: Optional[int] = None,
    float8: Optional[Float8Training] = None,
    compiled: Optional[RegionalCompile] = None,
) -> MoELCModel:
    """Apply ``layout`` and the activation ``checkpointing`` policy (None: none) to ``model`` in place
    (and return it). Every rank must pass an identical model.

    The model must be materialised (not meta) with identical weights on every rank (same seed).
    ``layout`` is resolved for the mesh's world (dp_shard=-1 filled); the context keeps the result.
    With pp > 1 the model keeps this rank's stages only and is trained through
    ``parallel_context(model).pipeline``; ``seq_len`` is the sequence length the stages are balanced
    for (attention's cost grows with it; None: 4096), unless the layout lists ``pp_stage_layers``.
    ``float8``: convert the dense linears to FP8 (``moe_lc.parallel.float8``; None: none);
    ``compiled``: the modules to ``torch.compile`` (``moe_lc.parallel.compile``; None: none).
    """
    if getattr(model, "moe_lc_parallel", None) is not None:
        raise ConfigError("this model is already parallelized; build a fresh model for another layout")
    layout = layout.resolve(mesh.size()).validate(model.cfg)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("parallelize needs materialised weights: build the model with build_model(cfg, device)")
    expert_mesh = build_expert_mesh(layout, mesh)
    compute_dtype = _compute_dtype(model, layout, mesh.device_type)
    pipeline_plan = plan_pipeline(model.cfg, layout, seq_len, checkpointing) if layout.pp > 1 else None
    pp_rank = mesh.get_local_rank("pp")
    if pipeline_plan is not None:
        keep_stage_parts(model, pipeline_plan.layers, pipeline_plan.stages_of(pp_rank))

    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if layout.ep > 1:
        apply_expert_parallel(model, expert_mesh["ep"])
    if float8 is not None:
        apply_float8(model, float8, layout.tp)
    if compiled is not None:
        apply_compile(model, compiled, layout.tp, mesh.size())
    expose_all_local_parameters(model)
    apply_activation_checkpointing(model, checkpointing or ActivationCheckpointing())
    stages = build_stages(model, pipeline_plan, pp_rank) if pipeline_plan is not None else None

    expert_params = {id(p) for m in model.modules() if isinstance(m, LatentMoE) for p in m.experts.parameters()}
    dp_groups = DataParallelGroups(
        dense=data_parallel_group(mesh),  # dp x cp: cp ranks hold different tokens
        expert=dims_group(expert_mesh, ("dp_replicate", "edp")),
        expert_params=expert_params,
    )
    if layout.dp_mode == "fsdp":
        apply_fsdp(
            model,
            _fsdp_mesh(mesh, ("dp_shard", "cp")),
            _fsdp_mesh(expert_mesh, ("edp",)),
            mixed_precision_policy(layout.param_dtype, mesh.device_type),
            roots=list(stages.values()) if stages is not None else None,
        )
        # FSDP replaced the parameter objects: record the experts' new ones.
        dp_groups.expert_params = {
            id(p) for m in model.modules() if isinstance(m, LatentMoE) for p in m.experts.parameters()
        }
    if layout.cp > 1:
        model.register_forward_pre_hook(_require_context_shard(layout.cp), with_kwargs=True)
    pipeline = None
    if stages is not None:
        pipeline = Pipeline(model, layout, pipeline_plan.boundaries, stages, mesh.get_group("pp"), compute_dtype)
    model.moe_lc_parallel = ParallelContext(layout, mesh, expert_mesh, dp_groups, pipeline)
    return model


def _compute_dtype(model: MoELCModel, layout: ParallelLayout, device_type: str):
    """The dtype the parameters compute in: FSDP's unsharded dtype, else the weights'."""
    weights = next(model.parameters()).dtype
    if layout.dp_mode != "fsdp":
        return weights
    return mixed_precision_policy(layout.param_dtype, device_type).param_dtype or weights


def _fsdp_mesh(mesh: DeviceMesh, shard_dims: tuple[str, ...]) -> DeviceMesh:
    """1-D FSDP mesh over ``shard_dims`` (flattened when several hold more than one rank, e.g.
    dp_shard x cp), or the 2-D (dp_replicate, shard) HSDP mesh when there are replicas.

    (A size-1 replicate dim would only add a mesh dim to every DTensor, which makes DTensor's
    sharding propagation much slower for nothing.)
    """
    names = mesh.mesh_dim_names
    live = tuple(d for d in shard_dims if mesh.size(names.index(d)) > 1) or shard_dims[:1]
    shard = mesh[live]._flatten("_".join(live)) if len(live) > 1 else mesh[live[0]]
    if mesh.size(names.index("dp_replicate")) == 1:
        return shard
    if len(live) == 1:
        return mesh["dp_replicate", live[0]]
    return DeviceMesh._concatenate([mesh["dp_replicate"], shard])


def _require_context_shard(cp: int):
    """Model forward pre-hook under cp > 1: the inputs must be this rank's shard of the row. A whole
    row would run on every cp rank and its gradients be summed cp times over."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        docs = kwargs.get("docs", args[2] if len(args) > 2 else None)
        shard = getattr(docs, "shard", None)
        if shard is None or shard.context.size != cp:
            raise ValueError(f"layout.cp={cp}: the model needs this rank's shard of each packed row; call it with "
                             "model(**shard_model_inputs(input_ids, labels, docs, ContextShard.from_mesh(mesh, "
                             "row_len))) (moe_lc.parallel.context)")

    return hook


def parallel_context(model: MoELCModel) -> Optional[ParallelContext]:
    return getattr(model, "moe_lc_parallel", None)

