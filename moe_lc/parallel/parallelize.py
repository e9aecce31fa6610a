"""``parallelize(model, layout, mesh, checkpointing)``: TP/SP, EP, activation checkpointing and data
parallelism around an unchanged model.

Order: tensor parallelism (DTensor parameters on the tp mesh, sequence-parallel regions,
vocab-parallel embedding/head/loss), expert parallelism (expert weights on the ep mesh, the
all-to-all dispatch), local-parameter hooks, activation checkpointing of the decoder layers
(a recompute then reruns the hooks and collectives above, inside the layer), then FSDP2 (it must
come last: it wraps DTensor parameters from the same root mesh and its hooks must run outside ours).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh

from moe_lc.config import ConfigError
from moe_lc.model.moe import LatentMoE
from moe_lc.model.transformer import MoELCModel
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from moe_lc.parallel.data_parallel import DataParallelGroups, apply_fsdp, mixed_precision_policy
from moe_lc.parallel.expert_parallel import apply_expert_parallel
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.local_params import expose_all_local_parameters
from moe_lc.parallel.mesh import build_expert_mesh, dims_group
from moe_lc.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelContext:
    """What ``parallelize`` did, kept on the model as ``model.moe_lc_parallel``."""

    layout: ParallelLayout
    mesh: DeviceMesh
    expert_mesh: DeviceMesh
    dp_groups: DataParallelGroups


def parallelize(
    model: MoELCModel,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    checkpointing: Optional[ActivationCheckpointing] = None,
) -> MoELCModel:
    """Apply ``layout`` and the activation ``checkpointing`` policy (None: none) to ``model`` in place
    (and return it). Every rank must pass an identical model.

    The model must be materialised (not meta) with identical weights on every rank (same seed).
    ``layout`` is resolved for the mesh's world (dp_shard=-1 filled); the context keeps the result.
    """
    if getattr(model, "moe_lc_parallel", None) is not None:
        raise ConfigError("this model is already parallelized; build a fresh model for another layout")
    layout = layout.resolve(mesh.size()).validate(model.cfg)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("parallelize needs materialised weights: build the model with build_model(cfg, device)")
    expert_mesh = build_expert_mesh(layout, mesh)

    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if layout.ep > 1:
        apply_expert_parallel(model, expert_mesh["ep"])
    expose_all_local_parameters(model)
    apply_activation_checkpointing(model, checkpointing or ActivationCheckpointing())

    expert_params = {id(p) for m in model.modules() if isinstance(m, LatentMoE) for p in m.experts.parameters()}
    dp_groups = DataParallelGroups(
        dense=dims_group(mesh, ("dp_replicate", "dp_shard")),
        expert=dims_group(expert_mesh, ("dp_replicate", "edp")),
        expert_params=expert_params,
    )
    if layout.dp_mode == "fsdp":
        apply_fsdp(
            model,
            _fsdp_mesh(mesh, "dp_shard"),
            _fsdp_mesh(expert_mesh, "edp"),
            mixed_precision_policy(layout.param_dtype, mesh.device_type),
        )
        # FSDP replaced the parameter objects: record the experts' new ones.
        dp_groups.expert_params = {
            id(p) for m in model.modules() if isinstance(m, LatentMoE) for p in m.experts.parameters()
        }
    model.moe_lc_parallel = ParallelContext(layout, mesh, expert_mesh, dp_groups)
    return model


def _fsdp_mesh(mesh: DeviceMesh, shard_dim: str) -> DeviceMesh:
    """1-D FSDP mesh, or the 2-D (dp_replicate, shard) HSDP mesh when there are replicas.

    (A size-1 replicate dim would only add a mesh dim to every DTensor, which makes DTensor's
    sharding propagation much slower for nothing.)
    """
    if mesh.size(mesh.mesh_dim_names.index("dp_replicate")) == 1:
        return mesh[shard_dim]
    return mesh["dp_replicate", shard_dim]


def parallel_context(model: MoELCModel) -> Optional[ParallelContext]:
    return getattr(model, "moe_lc_parallel", None)

