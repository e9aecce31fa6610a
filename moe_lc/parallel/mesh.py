"""Device meshes for a layout, and the process groups the trainer needs (data sharding, loss, QB).

Two meshes over the same ranks (see ``layout.py``): the dense mesh
``(pp, dp_replicate, dp_shard, cp, tp)`` used by attention, dense FFN, shared experts, norms,
embedding and LM head, and the expert mesh ``(pp, dp_replicate, edp, ep)`` used by the routed
experts. Both are row-major over the global ranks, so the ep ranks are the innermost ranks of
``dp_shard x cp x tp``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moe_lc.config import ConfigError
from moe_lc.parallel.layout import EXPERT_MESH_DIMS, MESH_DIMS, ParallelLayout


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(
    layout: ParallelLayout, world_size: Optional[int] = None, device_type: Optional[str] = None
) -> DeviceMesh:
    """The dense mesh with named dims ``pp, dp_replicate, dp_shard, cp, tp`` (sizes may be 1).

    Resolves and validates the layout for the world size first, so a wrong layout raises the
    same ConfigError on every rank instead of hanging in a collective.
    """
    if world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "build_mesh needs torch.distributed to be initialised (launch with torchrun, or call "
                "torch.distributed.init_process_group) or an explicit world_size"
            )
        world_size = dist.get_world_size()
    layout = layout.resolve(world_size).validate()
    return init_device_mesh(device_type or default_device_type(), layout.mesh_shape(), mesh_dim_names=MESH_DIMS)


def build_expert_mesh(layout: ParallelLayout, mesh: DeviceMesh) -> DeviceMesh:
    """The expert mesh ``pp, dp_replicate, edp, ep`` over the same ranks as ``mesh``."""
    layout = layout.resolve(mesh.size())
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS or tuple(mesh.mesh.shape) != layout.mesh_shape():
        raise ConfigError(
            f"mesh {tuple(mesh.mesh.shape)} with dims {mesh.mesh_dim_names} was not built from this layout "
            f"{layout.mesh_shape()}; build it with moe_lc.parallel.build_mesh(layout)"
        )
    return init_device_mesh(mesh.device_type, layout.expert_mesh_shape(), mesh_dim_names=EXPERT_MESH_DIMS)


def dims_group(mesh: DeviceMesh, dims: tuple[str, ...]) -> Optional[dist.ProcessGroup]:
    """One process group over several mesh dims (None when they hold a single rank)."""
    sizes = [mesh.size(mesh.mesh_dim_names.index(d)) for d in dims]
    if all(s == 1 for s in sizes):
        return None
    live = tuple(d for d, s in zip(dims, sizes) if s > 1)
    if len(live) == 1:
        return mesh.get_group(live[0])
    return mesh[live]._flatten("_".join(live)).get_group()


def data_parallel_info(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp_rank, dp_size) for sharding the data: ranks of one tp/cp/pp group read the same samples."""
    names = mesh.mesh_dim_names
    coord = mesh.get_coordinate()
    rep, shard = names.index("dp_replicate"), names.index("dp_shard")
    shard_size = mesh.size(shard)
    return coord[rep] * shard_size + coord[shard], mesh.size(rep) * shard_size


def data_parallel_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """The ranks holding different label tokens of the step: dp_replicate x dp_shard x cp.

    cp ranks read the same samples (``data_parallel_info``) but each holds its own shard of every
    row, so label tokens, loss sums and the dense parameters' gradients are summed over cp as over
    the data-parallel ranks (Megatron's data-parallel group with context parallelism). tp ranks
    compute the loss of the same tokens and are not part of it.
    """
    return dims_group(mesh, ("dp_replicate", "dp_shard", "cp"))


def balance_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """Every rank holding tokens of the step within one pipeline stage: dp x cp x tp.

    tp belongs here because sequence parallelism gives each tp rank its own tokens to route.
    Pass it to ``ExpertBalancer.update(group)``; None means the whole world is one rank. A pipeline
    stage held by one rank gets its one-rank group (a balancer reads None as the world).
    """
    group = dims_group(mesh, ("dp_replicate", "dp_shard", "cp", "tp"))
    if group is None and mesh.size() > 1:
        return mesh.get_group("tp")
    return group


def global_label_tokens(num_local: int, mesh: Optional[DeviceMesh]) -> int:
    """Label tokens of the whole step (all micro-batches of all data-parallel and cp ranks; under
    context parallelism ``num_local`` counts this rank's shard of its rows).

    Gradients are summed over data-parallel ranks, so each rank weights its summed token
    loss by ``1 / global_label_tokens``: the result is the global-batch mean whatever the split.
    """
    if mesh is None:
        return int(num_local)
    group = data_parallel_group(mesh)
    count = torch.tensor([int(num_local)], dtype=torch.int64, device=_comm_device(mesh))
    if group is not None:
        dist.all_reduce(count, group=group)
    return int(count.item())


def _comm_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
