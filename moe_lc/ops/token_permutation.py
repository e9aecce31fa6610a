"""The routed experts' token permutation: tokens into expert order and back, one dispatch point.

    sort:     the (token, slot) assignments by expert; row i of the sorted matrix is flat slot order[i]
    gather:   x_sorted[i] = z[token_of_row[i]]
    combine:  u_t = sum_j p_tj out_sorted[rows[t, j]]      (rows = the inverse of order, [T, k])

Backends: "torch", the reference (``combine_by_token``'s copy to the inverse permutation, then the
weighted sum over slots; the gather's gradient by autograd's index_put); "triton", where every sum
over a token's k slots is a gather of k rows summed in fp32 in slot order (moe_lc_kernels.
token_permutation): the combine writes no [T k, l] copy in slot order, the gather's gradient needs
no zero-filled buffer and no atomic adds, and the combine's backward writes d out_sorted and dp in
one pass; "auto": triton on CUDA. The Triton paths are ``torch.library`` custom ops, so a compiled
MoE layer (``compile.targets``' "moe") calls them inside its graph instead of breaking it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc.model.precision import upcast
from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc_kernels.token_permutation import combine_backward_triton, sort_by_expert_triton, sum_token_rows_triton

__all__ = ["sort_by_expert", "slot_rows", "expert_order", "gather_by_expert", "combine_by_token", "combine", "resolve_backend",
           "triton_unsupported_reason"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sort_by_expert(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flattened (token, slot) assignments ordered by expert: (order, token_of_row, counts [E] int64).

    All three stay on topk_idx's device with no host read. The counts come from a search of the
    sorted expert ids, not ``torch.bincount``: on CUDA bincount reads the largest id back to the
    host to size its output, a stream sync per layer. The ids are sorted in the narrowest integer
    type that holds them: a radix sort makes one pass per key byte (8 for the router's int64).
    """
    key_dtype = _expert_id_dtype(num_experts)
    flat = topk_idx.reshape(-1).to(key_dtype)
    experts_sorted, order = torch.sort(flat, stable=True)
    token_of_row = order // topk_idx.shape[1]
    experts = torch.arange(num_experts, device=flat.device, dtype=key_dtype)
    ends = torch.searchsorted(experts_sorted, experts, right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return order, token_of_row, counts


def _expert_id_dtype(num_experts: int) -> torch.dtype:
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def slot_rows(order: Tensor, top_k: int) -> Tensor:
    """[T, k]: the sorted row of each (token, slot), the inverse permutation of ``order``."""
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return rows.view(-1, top_k)


def combine_by_token(out_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """u_t = sum_j p_tj out[row of (t, j)]: [T, width] in at least fp32 from rows in expert order. The
    reference.

    The rows go back to (token, slot) order by a copy to the inverse permutation (each row lands
    once; its backward is a gather by ``order``), then each token's k rows are summed in fp32 in
    slot order: deterministic on GPUs, where a scatter-add's atomics sum them in a varying order.
    """
    tokens, k = weights.shape
    by_slot = out_sorted.new_empty(out_sorted.shape).index_copy(0, order, out_sorted)
    return (upcast(by_slot).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)


def expert_order(topk_idx: Tensor, num_experts: int, backend: str = "torch") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(order, token_of_row, counts, rows): ``sort_by_expert`` and ``slot_rows`` in one call.

    "triton" (``moe.router_backend``, with the router's kernels) is a stable counting sort in two
    kernels and a cumulative sum, where the reference launches about a dozen (the narrowing, the
    radix sort's passes and buffers, the search for the counts, the inverse's scatter); the same
    four tensors, exactly."""
    reason = triton_device_reason(topk_idx.device)
    if num_experts > MAX_SORT_EXPERTS:
        reason = f"the counting sort takes at most {MAX_SORT_EXPERTS} experts, got {num_experts}"
    if choose_backend("expert_order", backend, "triton", reason, auto_takes_fast=topk_idx.is_cuda) == "torch":
        order, token_of_row, counts = sort_by_expert(topk_idx, num_experts)
        return order, token_of_row, counts, slot_rows(order, topk_idx.shape[1])
    return _expert_order(topk_idx, num_experts)


MAX_SORT_EXPERTS = 1024  # the counting sort's tile holds a block's slots against every expert


# -- the Triton paths, as custom ops -----------------------------------------------------------------

@torch.library.custom_op("moe_lc::expert_order", mutates_args=())
def _expert_order(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    order, token_of_row, counts, rows = sort_by_expert_triton(topk_idx, num_experts)
    return order, token_of_row, counts.clone(), rows


@_expert_order.register_fake
def _(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = topk_idx.numel()
    return (topk_idx.new_empty(n, dtype=torch.int64), topk_idx.new_empty(n, dtype=torch.int64),
            topk_idx.new_empty(num_experts, dtype=torch.int64), topk_idx.new_empty(topk_idx.shape, dtype=torch.int64))


@torch.library.custom_op("moe_lc::sum_token_rows", mutates_args=())
def _sum_token_rows(src: Tensor, rows: Tensor, weights: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    return sum_token_rows_triton(src, rows, weights, out_dtype)


@_sum_token_rows.register_fake
def _(src: Tensor, rows: Tensor, weights: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    return src.new_empty(rows.shape[0], src.shape[1], dtype=out_dtype)


@torch.library.custom_op("moe_lc::combine_token_rows_backward", mutates_args=())
def _combine_backward(du: Tensor, src: Tensor, rows: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    return combine_backward_triton(du, src, rows, weights)


@_combine_backward.register_fake
def _(du: Tensor, src: Tensor, rows: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    return src.new_empty(src.shape), weights.new_empty(weights.shape, dtype=torch.float32)


@torch.library.custom_op("moe_lc::combine_token_rows", mutates_args=())
def _combine(src: Tensor, rows: Tensor, weights: Tensor, out_dtype: torch.dtype) -> Tensor:
    return sum_token_rows_triton(src, rows, weights, out_dtype)


@_combine.register_fake
def _(src: Tensor, rows: Tensor, weights: Tensor, out_dtype: torch.dtype) -> Tensor:
    return src.new_empty(rows.shape[0], src.shape[1], dtype=out_dtype)


def _combine_setup(ctx, inputs, output) -> None:
    src, rows, weights, _ = inputs
    ctx.save_for_backward(src, rows, weights)
    ctx.weights_dtype = weights.dtype


def _combine_grad(ctx, du: Tensor):
    src, rows, weights = ctx.saved_tensors
    dsrc, dw = _combine_backward(du, src, rows, weights)
    return dsrc, None, dw.to(ctx.weights_dtype), None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)


@torch.library.custom_op("moe_lc::gather_token_rows", mutates_args=())
def _gather(z: Tensor, token_of_row: Tensor, rows: Tensor) -> Tensor:
    return z.index_select(0, token_of_row)


@_gather.register_fake
def _(z: Tensor, token_of_row: Tensor, rows: Tensor) -> Tensor:
    return z.new_empty(token_of_row.shape[0], z.shape[1])


def _gather_setup(ctx, inputs, output) -> None:
    z, _, rows = inputs
    ctx.save_for_backward(rows)
    ctx.z_dtype = z.dtype


def _gather_grad(ctx, dx: Tensor):
    rows, = ctx.saved_tensors
    return _sum_token_rows(dx, rows, None, ctx.z_dtype), None, None


_gather.register_autograd(_gather_grad, setup_context=_gather_setup)


# -- the dispatch ------------------------------------------------------------------------------------

def triton_unsupported_reason(x: Tensor, rows: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take x [rows, width] and rows [T, k] here, or None when they can."""
    reason = triton_device_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype not in _TRITON_DTYPES:
        return f"the kernels take fp32/bf16/fp16 rows, got {x.dtype}"
    if x.dim() != 2 or rows.dim() != 2 or rows.numel() != x.shape[0]:
        return f"want rows [T k, width] and rows_of_token [T, k], got {tuple(x.shape)} and {tuple(rows.shape)}"
    if rows.device != x.device:
        return f"rows_of_token is on {rows.device}, the rows on {x.device}"
    return None


def resolve_backend(x: Tensor, rows: Tensor, backend: str = "auto") -> str:
    """The backend the permutation runs: "auto" takes Triton only on CUDA (never the CPU interpreter)."""
    return choose_backend("token_permutation", backend, "triton", triton_unsupported_reason(x, rows),
                          auto_takes_fast=x.is_cuda)


def gather_by_expert(z: Tensor, token_of_row: Tensor, rows: Tensor, backend: str = "auto") -> Tensor:
    """x_sorted = z[token_of_row] [T k, width]; differentiable in z. ``rows`` (``slot_rows``) is what
    the Triton path's gradient sums over: dz_t = sum_j dx_sorted[rows[t, j]]."""
    probe = z.new_empty(rows.numel(), z.shape[1]) if z.dim() == 2 else z
    if resolve_backend(probe, rows, backend) == "torch":
        return z[token_of_row]
    return _gather(z, token_of_row, rows)


def combine(out_sorted: Tensor, order: Tensor, rows: Tensor, weights: Tensor, out_dtype: torch.dtype,
            backend: str = "auto") -> Tensor:
    """u_t = sum_j p_tj out_sorted[rows[t, j]] [T, width] in ``out_dtype``, summed in (at least) fp32;
    differentiable in out_sorted and the weights. ``order`` is what the reference takes, ``rows``
    (its inverse, ``slot_rows``) what the Triton path does."""
    if resolve_backend(out_sorted, rows, backend) == "torch":
        return combine_by_token(out_sorted, order, weights).to(out_dtype)
    return _combine(out_sorted, rows, weights, out_dtype)
