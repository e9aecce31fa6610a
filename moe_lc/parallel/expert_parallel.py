"""Expert parallelism for LatentMoE (docs/design.md §5.4, §8.2): routed experts sharded over the ep group.

Rank r of an ep group of size P holds experts [r n/P, (r+1) n/P) (dim 0 of the stacked
weights). A step of ``LatentMoE.routed`` becomes, dropless:

1. sort this rank's (token, slot) assignments by expert (as the single-process path does);
2. exchange counts: an all-to-all of the [P, n/P] per-expert counts tells every rank how
   many rows it will receive from each source for each of its experts;
3. dispatch: an all-to-all with variable splits of the latent-width rows z (width l, not
   d: the point of LatentMoE);
4. regroup the received rows by local expert and run the local experts through the same
   dispatch as one process (``moe_lc.ops.grouped_experts.grouped_glu``: one grouped GEMM per
   matrix on CUDA bf16/fp32, the reference loop elsewhere);
5. combine: the inverse all-to-all, then the same weighted combine as one process.

Autograd runs through both all-to-alls (their backward swaps the splits). Router, latent
projections and shared experts are untouched: they stay replicated or tensor-parallel.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from moe_lc.model.moe import LatentMoE
from moe_lc.ops.token_permutation import combine_by_token, sort_by_expert
from moe_lc.parallel.comm import all_to_all
from moe_lc.parallel.tensor_parallel import distribute_parameters


def expert_parallel_routed(
    moe: LatentMoE, group: dist.ProcessGroup, z: Tensor, topk_idx: Tensor, weights: Tensor
) -> Tensor:
    """Drop-in for ``LatentMoE.routed``: u = sum_{j in T} p_j E_j(z) with experts spread over ``group``.

    One host read per layer: the variable-split all-to-all takes its split sizes on the host, so
    the per-rank row totals (both directions, one ``tolist``) are read back after the counts'
    all-to-all; everything else (sort, counts, regrouping, expert offsets) stays on the device.
    Avoiding that read would take either a fixed-capacity exchange (pad every rank's send buffer
    to a worst case known in advance, ship the counts on the device, and run the experts on the
    padded buffer) or a device-initiated all-to-all that reads the counts on the GPU (NVSHMEM-
    style kernels), neither of which NCCL's all_to_all_single offers.

    A rank that receives no rows still runs its experts on an empty input that depends on the
    weights (``grouped_glu`` does this), so backward reaches them on every rank.
    """
    world = dist.get_world_size(group)
    n = moe.cfg.num_routed
    local_n = n // world
    order, token_of_row, counts = sort_by_expert(topk_idx, n)
    send_counts = counts.view(world, local_n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # recv[src, e]: rows src sends to my e
    send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the host read

    received = all_to_all(z[token_of_row], recv_splits, send_splits, group)  # ordered (source, local expert)
    expert_of_row = torch.arange(local_n, device=z.device).repeat(world).repeat_interleave(
        recv_counts.reshape(-1), output_size=sum(recv_splits)
    )
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = moe.experts(received[by_expert], recv_counts.sum(0))
    out_by_source = torch.empty_like(out).index_copy(0, by_expert, out)
    out_sorted = all_to_all(out_by_source, send_splits, recv_splits, group)
    return combine_by_token(out_sorted, order, weights).to(z.dtype)


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard each MoE layer's routed experts over the 1-D ``ep_mesh`` and swap in the EP dispatch."""
    group = ep_mesh.get_group()
    for moe in _moe_layers(model):
        distribute_parameters(moe.experts, ep_mesh, lambda name: Shard(0))
        moe.routed = functools.partial(expert_parallel_routed, moe, group)


def _moe_layers(model: torch.nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]

