"""Launches of the token permutation's Triton kernels (``token_permutation_triton``).

The routed experts see their tokens' rows sorted by expert; a token's K rows go back to it as a sum.
These launchers take that sum (weighted: the combine; unweighted: the gradient of the gather into
expert order) and the combine's backward, over ``rows`` [T, K], the sorted row of each (token, slot).
Use ``moe_lc.ops.token_permutation``, which picks these or the PyTorch reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc_kernels.layout import row_stride

# Columns per program and warps: memory-bound gathers of whole rows (k3-small's latent width 1024 is
# one program per token at 1024 x 4 warps).
TUNING = dict(block=1024, warps=4)
# The sort's one-hot tile, slots x experts (padded to a power of two): 128 slots a block at 64 experts,
# int32: 113 registers a thread for sm_90 at 4 warps (256 slots and int64 ranks took all 255;
# benchmarks/sass_audit.py).
SORT_TILE_SLOTS = 8192


def _grid(tokens: int, width: int) -> tuple[tuple[int, int], int]:
    import triton

    block = min(TUNING["block"], triton.next_power_of_2(max(width, 1)))
    return (tokens, triton.cdiv(width, block)), block


def sum_token_rows_triton(src: Tensor, rows: Tensor, weights: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    """[T, width] in ``out_dtype``: out[t] = sum_s w[t, s] src[rows[t, s]] (w = 1 without weights)."""
    from moe_lc_kernels import token_permutation_triton as kt

    tokens, k = rows.shape
    width = src.shape[1]
    src = src if src.stride(1) == 1 else src.contiguous()
    rows = rows.contiguous()
    out = src.new_empty(tokens, width, dtype=out_dtype)
    if out.numel():
        grid, block = _grid(tokens, width)
        w = weights.contiguous() if weights is not None else rows  # unread without WEIGHTED
        kt.sum_rows_kernel[grid](src, rows, w, out, width, row_stride(src), K=k, WEIGHTED=weights is not None,
                                 BLOCK=block, num_warps=TUNING["warps"])
    return out


def combine_backward_triton(du: Tensor, src: Tensor, rows: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(dsrc in src's dtype, dw fp32 [T, K]) of out[t] = sum_s w[t, s] src[rows[t, s]]; every row of
    src must be some token's (rows a permutation), since each is written exactly once."""
    from moe_lc_kernels import token_permutation_triton as kt

    tokens, k = rows.shape
    width = src.shape[1]
    src = src if src.stride(1) == 1 else src.contiguous()
    du, rows, weights = du.contiguous(), rows.contiguous(), weights.contiguous()
    dsrc = src.new_empty(src.shape[0], width)
    if tokens == 0 or width == 0:
        return dsrc.zero_(), weights.new_zeros(tokens, k, dtype=torch.float32)
    grid, block = _grid(tokens, width)
    parts = torch.empty(tokens, k, grid[1], device=src.device, dtype=torch.float32)
    kt.combine_bwd_kernel[grid](du, src, rows, weights, dsrc, parts, width, row_stride(src), grid[1], K=k,
                                BLOCK=block, num_warps=TUNING["warps"])
    return dsrc, parts.sum(-1)


def sort_by_expert_triton(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(order, token_of_row, counts [E] int64, rows [T, K]) of a stable sort of topk_idx's flat slots by
    expert: a counting sort in two kernels and one cumulative sum over the blocks' counts."""
    import triton
    from moe_lc_kernels import token_permutation_triton as kt

    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1).contiguous()
    n = flat.numel()
    if n >= 2**31:
        raise ValueError(f"sort_by_expert_triton: {n} slots exceed the kernels' int32 ranks; use the reference")
    e_pow2 = triton.next_power_of_2(max(num_experts, 1))
    block = max(16, SORT_TILE_SLOTS // e_pow2)
    blocks = max(1, triton.cdiv(n, block))
    order = torch.empty(n, device=flat.device, dtype=torch.int64)
    token_of_row = torch.empty(n, device=flat.device, dtype=torch.int64)
    rows = torch.empty(n, device=flat.device, dtype=torch.int64)
    if n == 0:
        return order, token_of_row, torch.zeros(num_experts, device=flat.device, dtype=torch.int64), rows.view(tokens, k)
    part = torch.empty(blocks, e_pow2, device=flat.device, dtype=torch.int64)
    kt.expert_block_counts_kernel[(blocks,)](flat, part, n, E_POW2=e_pow2, BLOCK=block, num_warps=TUNING["warps"])
    part_cum = part.cumsum(0)
    kt.place_by_expert_kernel[(blocks,)](flat, part_cum, order, rows, token_of_row, n, K=k, E_POW2=e_pow2,
                                         BLOCK=block, num_warps=TUNING["warps"])
    return order, token_of_row, part_cum[-1, :num_experts], rows.view(tokens, k)
