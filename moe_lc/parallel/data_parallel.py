"""Data parallelism: FSDP2/HSDP or ZeRO-1 and gradient synchronisation.

Convention: gradients are SUMMED over data-parallel ranks (never averaged). Each rank scales
its summed token loss by ``1 / global_label_tokens`` (``moe_lc.parallel.global_label_tokens``), so the
gradient is that of the global-batch mean loss for any split of the batch over ranks and
micro-batches.

Groups. Dense parameters are reduced over ``dp_replicate x dp_shard x cp`` (cp ranks hold
different tokens of the same rows; the gradients are already complete over tp, see
``local_params``). Routed experts live on the expert mesh and are reduced over
``dp_replicate x edp``: every rank that holds a copy of the same expert shard (edp folds
dp_shard, cp and tp ranks that are not in the expert's ep group).

fsdp: ``fully_shard`` on every token mixer and channel mixer (the routed experts as their own
unit on the expert mesh) and on the root, sharded over dp_shard x cp (edp for experts) and, when
dp_replicate > 1, replicated across it (HSDP); bf16 compute
with fp32 master weights and fp32 gradient reduction on CUDA (MixedPrecisionPolicy).
zero1: parameters and gradients replicated; ``finish_gradient_sync`` all-reduces the gradients
(flat buffers) and ``build_optimizer`` gives each data-parallel rank the optimizer state of a
balanced share of the parameters, broadcasting the updated values after each step.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moe_lc.model.ffn import GatedFFN
from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import LatentMoE, RoutedExperts
from moe_lc.parallel.comm import group_size


@dataclass
class DataParallelGroups:
    """Which group reduces which parameters (ZeRO-1 and gradient clipping need it)."""

    dense: Optional[dist.ProcessGroup]
    expert: Optional[dist.ProcessGroup]
    expert_params: set[int] = field(default_factory=set)  # id() of routed-expert parameters

    def group_of(self, param: Tensor) -> Optional[dist.ProcessGroup]:
        return self.expert if id(param) in self.expert_params else self.dense


def mixed_precision_policy(param_dtype: str, device_type: str) -> MixedPrecisionPolicy:
    if param_dtype == "auto":
        param_dtype = "bfloat16" if device_type == "cuda" else "float32"
    if param_dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    dense_dp_mesh: DeviceMesh,
    expert_dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    roots: Optional[list[nn.Module]] = None,
) -> None:
    """FSDP2 units: routed experts (expert mesh), each token/channel mixer (dense mesh), then the root.

    Units take and return tensors (not the ResidualStream), so FSDP's backward hooks attach.
    Gradients are summed over the data-parallel ranks (divide factor 1). ``roots``: a pipeline's
    stages on this rank, each a root of its own (they, not the model, are called); the embedding is
    then a unit of its own, since two stages of a rank may call it (the first one and MTP's).
    """
    # LatentMoE returns y.view(shape); nothing writes into sublayer outputs in place, so FSDP's
    # warning about in-place ops on returned views does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLatentMoE\) returned a view")
    for module in list(model.modules()):
        if isinstance(module, RoutedExperts):
            fully_shard(module, mesh=expert_dp_mesh, mp_policy=mp_policy)
    for module in list(model.modules()):
        if isinstance(module, (KDAttention, GatedMLA, GatedFFN, LatentMoE)) and not _inside_moe(model, module):
            fully_shard(module, mesh=dense_dp_mesh, mp_policy=mp_policy)
    if roots is not None and getattr(model, "embed", None) is not None:
        fully_shard(model.embed, mesh=dense_dp_mesh, mp_policy=mp_policy)
    for root in roots if roots is not None else [model]:
        fully_shard(root, mesh=dense_dp_mesh, mp_policy=mp_policy)
    for module in {id(m): m for root in [model, *(roots or [])] for m in root.modules()}.values():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def _inside_moe(model: nn.Module, module: nn.Module) -> bool:
    """Shared experts are GatedFFNs inside a LatentMoE unit: they go with it."""
    return isinstance(module, GatedFFN) and any(
        isinstance(m, LatentMoE) and m.shared is module for m in model.modules()
    )


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Gradient accumulation: disable the data-parallel reduction on all but the last micro-batch,
    unless the layout reduces every micro-batch (``fsdp_reduce_every_micro_batch``).

    (FSDP only; ZeRO-1 reduces once in ``finish_gradient_sync``.)
    """
    ctx = getattr(model, "moe_lc_parallel", None)
    if ctx is not None and ctx.layout.fsdp_reduce_every_micro_batch:
        enabled = True
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled, recurse=True)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def finish_gradient_sync(model: nn.Module) -> None:
    """Sum gradients over the data-parallel groups (ZeRO-1); a no-op under FSDP, which did it in backward."""
    ctx = getattr(model, "moe_lc_parallel", None)
    if ctx is None or ctx.layout.dp_mode != "zero1":
        return
    buckets: dict[Any, list[Tensor]] = defaultdict(list)
    for param in model.parameters():
        if param.grad is None:
            continue
        group = ctx.dp_groups.group_of(param)
        if group_size(group) > 1:
            buckets[group].append(_local(param.grad))
    for group, grads in buckets.items():
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


@torch.no_grad()
def _owner_of_params(params: list[Tensor], world: int) -> list[int]:
    """Greedy balanced assignment (largest first) of parameters to ranks; deterministic everywhere."""
    loads = [0] * world
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-_local(params[i]).numel(), i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += _local(params[i]).numel()
    return owner


class ZeroOneStep:
    """Post-step hook of a ZeRO-1 optimizer: owners broadcast updated values; other grads are dropped."""

    def __init__(self, shares: list[tuple[Optional[dist.ProcessGroup], list[Tensor], list[int]]]) -> None:
        self.shares = shares

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, params, owners in self.shares:
            ranks = dist.get_process_group_ranks(group)
            for owner in sorted(set(owners)):
                mine = [_local(p) for p, o in zip(params, owners) if o == owner]
                for dtype in {t.dtype for t in mine}:
                    same = [t for t in mine if t.dtype == dtype]
                    flat = torch.cat([t.reshape(-1) for t in same])
                    dist.broadcast(flat, src=ranks[owner], group=group)
                    offset = 0
                    for t in same:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()
            me = dist.get_rank(group)
            for p, o in zip(params, owners):
                if o != me:
                    p.grad = None


def build_optimizer(
    model: nn.Module, optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer for a parallelized model: plain for FSDP, state-sharded for ZeRO-1.

    For ZeRO-1 the returned optimizer holds only this rank's share of the parameters (so its
    state, and DCP's view of it, covers that share) and broadcasts updates after ``step()``.
    """
    ctx = getattr(model, "moe_lc_parallel", None)
    params = [p for p in model.parameters() if p.requires_grad]
    if ctx is None or ctx.layout.dp_mode != "zero1":
        return optimizer_cls(params, **kwargs)
    by_group: dict[Any, list[Tensor]] = defaultdict(list)
    for p in params:
        by_group[ctx.dp_groups.group_of(p)].append(p)
    owned: list[Tensor] = []
    shares = []
    for group, members in by_group.items():
        if group_size(group) == 1:
            owned.extend(members)
            continue
        owners = _owner_of_params(members, group_size(group))
        me = dist.get_rank(group)
        owned.extend(p for p, o in zip(members, owners) if o == me)
        shares.append((group, members, owners))
    owned_ids = {id(p) for p in owned}
    optimizer = optimizer_cls([p for p in params if id(p) in owned_ids], **kwargs)
    optimizer.register_step_post_hook(ZeroOneStep(shares))
    return optimizer
