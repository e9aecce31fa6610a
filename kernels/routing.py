"""Launches of the MoE router's Triton kernels (``routing_triton``).

The router's selection, weights and cutoff in one kernel, their gradient in one, and Quantile
Balancing's per-micro-batch statistics in one, where the PyTorch composition makes a sigmoid, a
top-(k+1) (two kernels on CUDA), a gather, the normalisation, and for the statistics a fp64 binning,
two zero-filled buffers and two scatter-adds. Use ``moe_lc.ops.routing``, which picks these or the
reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc_kernels.layout import row_stride

# Tokens per program: a [BLOCK_T, 64] fp32 tile is 32 registers a thread at 4 warps.
TUNING = dict(block_t=64, warps=4)


def _shape(logits: Tensor, top_k: int) -> tuple[int, int, int, int, int]:
    """(tokens, experts, E_POW2, K_POW2, row stride)."""
    import triton

    tokens, experts = logits.shape
    return tokens, experts, triton.next_power_of_2(experts), triton.next_power_of_2(top_k), row_stride(logits)


def _rows(logits: Tensor) -> Tensor:
    """logits with unit column stride (a column slice of a wider output is taken in place)."""
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def route_triton(logits: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(topk_idx [T, k] int64, weights [T, k] fp32, cutoff [T] fp32) of logits [T, E]."""
    import triton
    from moe_lc_kernels import routing_triton as kt

    logits = _rows(logits)
    tokens, experts, e_pow2, k_pow2, stride = _shape(logits, top_k)
    idx = torch.empty(tokens, top_k, device=logits.device, dtype=torch.int64)
    weights = torch.empty(tokens, top_k, device=logits.device, dtype=torch.float32)
    cutoff = torch.empty(tokens, device=logits.device, dtype=torch.float32)
    if tokens:
        block = TUNING["block_t"]
        kt.route_fwd_kernel[(triton.cdiv(tokens, block),)](
            logits, bias.float().contiguous(), idx, weights, cutoff, tokens, stride, float(scale), E=experts,
            E_POW2=e_pow2, K=top_k, K_POW2=k_pow2, BLOCK_T=block, num_warps=TUNING["warps"])
    return idx, weights, cutoff


def route_backward_triton(logits: Tensor, topk_idx: Tensor, dweights: Tensor, scale: float) -> Tensor:
    """d logits [T, E] in logits' dtype (zero off the selected experts) from d weights [T, k]."""
    import triton
    from moe_lc_kernels import routing_triton as kt

    logits = _rows(logits)
    top_k = topk_idx.shape[1]
    tokens, experts, e_pow2, k_pow2, stride = _shape(logits, top_k)
    dlogits = torch.empty(tokens, experts, device=logits.device, dtype=logits.dtype)
    if tokens:
        block = TUNING["block_t"]
        kt.route_bwd_kernel[(triton.cdiv(tokens, block),)](
            logits, topk_idx.contiguous(), dweights.float().contiguous(), dlogits, tokens, stride, float(scale),
            E=experts, E_POW2=e_pow2, K=top_k, K_POW2=k_pow2, BLOCK_T=block, num_warps=TUNING["warps"])
    return dlogits


def route_statistics_triton(logits: Tensor, bias: Tensor, topk_idx: Tensor, cutoff: Tensor, loads: Tensor,
                            hist: Optional[Tensor], value_range: Optional[Tensor]) -> None:
    """loads += the micro-batch's tokens per expert; with ``hist`` [E, bins] (int64) also the histogram
    of required biases, and ``value_range`` (fp64 [2]) set to the range its bins cover."""
    import triton
    from moe_lc_kernels import routing_triton as kt

    logits = _rows(logits)
    top_k = topk_idx.shape[1]
    tokens, experts, e_pow2, k_pow2, stride = _shape(logits, top_k)
    histogram = hist is not None
    if not tokens:  # nothing to count (the caller sets the range the bins would cover)
        return
    block = TUNING["block_t"]
    kt.route_statistics_kernel[(triton.cdiv(tokens, block),)](
        logits, bias.float().contiguous(), topk_idx.contiguous(), cutoff.contiguous(), loads,
        hist if histogram else loads, value_range if histogram else loads, tokens, stride, E=experts,
        E_POW2=e_pow2, K=top_k, K_POW2=k_pow2, BINS=hist.shape[1] if histogram else 1, BLOCK_T=block,
        HISTOGRAM=histogram, num_warps=TUNING["warps"])
