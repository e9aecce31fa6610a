"""Expert parallelism for LatentMoE (SPEC 2.5, 3): routed experts sharded over the ep group.

Rank r of an ep group of size P holds experts [r n/P, (r+1) n/P) (dim 0 of the stacked
weights). A step of ``LatentMoE.routed`` becomes, dropless:

1. sort this rank's (token, slot) assignments by expert (as the single-process path does);
2. exchange counts: an all-to-all of the [P, n/P] per-expert counts tells every rank how
   many rows it will receive from each source for each of its experts;
3. dispatch: an all-to-all with variable splits of the latent-width rows z (width l, not
   d: the point of LatentMoE);
4. regroup the received rows by local expert and run each local expert once (a grouped
   GEMM on CUDA, a loop elsewhere);
5. combine: the inverse all-to-all, then the same weighted scatter-add as one process.

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

from moe_lc.model.ffn import glu_activation
from moe_lc.model.moe import LatentMoE, RoutedExperts, grouped_experts, sort_by_expert
from moe_lc.model.precision import upcast
from moe_lc.parallel.comm import all_to_all
from moe_lc.parallel.tensor_parallel import distribute_parameters


def grouped_mm_available(x: Tensor) -> bool:
    return x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16


def grouped_glu_experts(
    x: Tensor, counts: list[int], w_gate: Tensor, w_in: Tensor, w_out: Tensor, activation: str, b1: float, b2: float
) -> Tensor:
    """Expert e on rows [sum(counts[:e]), sum(counts[:e+1])) of ``x``; same math as ``moe.grouped_experts``.

    One ``torch._grouped_mm`` per matrix on CUDA (bf16); the per-expert loop elsewhere. With no
    rows at all the (empty) result still depends on the weights and on ``x``, so backward
    reaches this module on every rank: FSDP's per-module gradient reduction then runs in the
    same order everywhere, even on an ep rank that received no tokens this step.
    """
    if x.shape[0] == 0:
        h = glu_activation(x @ w_gate[0].t(), x @ w_in[0].t(), activation, b1, b2)
        return h @ w_out[0].t()
    if not grouped_mm_available(x):
        return grouped_experts(x, counts, w_gate, w_in, w_out, activation, b1, b2)
    offsets = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a = torch._grouped_mm(x, w_gate.transpose(-2, -1), offs=offsets)
    c = torch._grouped_mm(x, w_in.transpose(-2, -1), offs=offsets)
    h = glu_activation(a, c, activation, b1, b2)
    return torch._grouped_mm(h, w_out.transpose(-2, -1), offs=offsets)


class GroupedExperts(RoutedExperts):
    """RoutedExperts computed by ``grouped_glu_experts`` (same parameters, names and math)."""

    def forward(self, x_sorted: Tensor, tokens_per_expert: list[int]) -> Tensor:
        return grouped_glu_experts(
            x_sorted, tokens_per_expert, self.w_gate, self.w_in, self.w_out, self.activation, self.beta1, self.beta2
        )


def use_grouped_experts(experts: RoutedExperts) -> None:
    """Switch the module's class in place: parameters, names and state dict stay the same."""
    if type(experts) is RoutedExperts:
        experts.__class__ = GroupedExperts


def expert_parallel_routed(
    moe: LatentMoE, group: dist.ProcessGroup, z: Tensor, topk_idx: Tensor, weights: Tensor
) -> Tensor:
    """Drop-in for ``LatentMoE.routed``: u = sum_{j in T} p_j E_j(z) with experts spread over ``group``."""
    world = dist.get_world_size(group)
    n = moe.cfg.num_routed
    local_n = n // world
    order, token_of_row, counts = sort_by_expert(topk_idx, n)
    send_counts = torch.tensor(counts, dtype=torch.int64, device=z.device).view(world, local_n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # recv[src, e]: rows src sends to my e
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    received = all_to_all(z[token_of_row], recv_splits, send_splits, group)  # ordered (source, local expert)
    expert_of_row = torch.arange(local_n, device=z.device).repeat(world).repeat_interleave(recv_counts.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = moe.experts(received[by_expert], recv_counts.sum(0).tolist())
    out_by_source = torch.empty_like(out).index_copy(0, by_expert, out)
    out_sorted = all_to_all(out_by_source, send_splits, recv_splits, group)

    w_sorted = weights.reshape(-1)[order].unsqueeze(-1)
    u = upcast(z.new_zeros(z.shape))
    u.index_add_(0, token_of_row, upcast(out_sorted) * w_sorted)
    return u.to(z.dtype)


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard each MoE layer's routed experts over the 1-D ``ep_mesh`` and swap in the EP dispatch."""
    group = ep_mesh.get_group()
    for moe in _moe_layers(model):
        distribute_parameters(moe.experts, ep_mesh, lambda name: Shard(0))
        use_grouped_experts(moe.experts)
        moe.routed = functools.partial(expert_parallel_routed, moe, group)


def _moe_layers(model: torch.nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]

