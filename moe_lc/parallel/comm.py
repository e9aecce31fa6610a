"""Collectives with autograd, the boundaries between parallel regions (Megatron style).

Each forward collective has the transposed collective as its backward:

    gather_sequence       all-gather tokens          <->  reduce-scatter of gradients
    reduce_scatter_sequence  reduce-scatter partial sums  <->  all-gather of gradients
    sum_gradient          identity                   <->  all-reduce of gradients
    all_to_all            variable-split all-to-all  <->  all-to-all with the splits swapped
    gather_last_dim       all-gather (e.g. vocab)    <->  keep this rank's slice
    start_gather          all-gather, asynchronous   <->  reduce-scatter of gradients

``dim`` may be negative; the gathered/scattered dimension is split in rank order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather_along(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    world = group_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _all_gather_single(out, front, group=group)
    return _restore_dim(out, dim)


def reduce_scatter_along(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split {x.shape[dim]} tokens evenly over {world} sequence-parallel ranks: "
            f"make the (packed) sequence length a multiple of tp={world}"
        )
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=group)
    return _restore_dim(out, dim)


def _restore_dim(out: Tensor, dim: int) -> Tensor:
    """Move dim 0 back to ``dim`` as a fresh contiguous tensor (never a view: FSDP hooks module outputs)."""
    if dim == 0 or dim == -out.dim():
        return out
    return out.movedim(0, dim).clone(memory_format=torch.contiguous_format)


def split_along(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


def all_reduce_sum(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return split_along(grad, -1, ctx.group), None


class _StartGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, works: list) -> Tensor:
        ctx.group = group
        out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
        works.append(_all_gather_single(out, x, group=group, async_op=True))
        return out  # filled once the work completes: PendingGather.wait

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_along(grad, 0, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def gather_sequence(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Sequence shards -> full sequence (enter a tensor-parallel region)."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, dim, group)


def reduce_scatter_sequence(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Partial sums over the full sequence -> this rank's summed sequence shard (leave the region)."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, dim, group)


def sum_gradient(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Identity whose backward sums the gradient over ``group`` (replicated weights, partial grads)."""
    return x if group_size(group) == 1 else _SumGradient.apply(x, group)


def gather_last_dim(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Concatenate the ranks' slices of the last dim (e.g. vocab-parallel logits)."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)


def all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: Optional[dist.ProcessGroup]
) -> Tensor:
    """Rows ``input_splits[r]`` go to rank r; ``output_splits[r]`` rows arrive from rank r (dim 0)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


class PendingGather:
    """An all-gather in flight (:func:`start_gather`): ``wait()`` returns the gathered tensor."""

    def __init__(self, x: Tensor, out: Tensor, work: Optional[dist.Work]) -> None:
        self._x = x  # the input stays alive until the collective has read it
        self._out, self._work = out, work

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._x = None, None
        return self._out


def start_gather(x: Tensor, group: Optional[dist.ProcessGroup]) -> PendingGather:
    """All-gather along dim 0 started without waiting, so that the caller computes while it runs;
    differentiable like :func:`gather_sequence` (the backward's reduce-scatter is synchronous)."""
    if group_size(group) == 1:
        return PendingGather(x, x, None)
    x = x.contiguous()
    works: list = []
    out = _StartGather.apply(x, group, works)
    return PendingGather(x, out, works[0])
