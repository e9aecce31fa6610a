"""The MoE router from its logits, one dispatch point (docs/design.md §5.1).

    s = sigmoid(logits)   T = argtop_k(s + b)   alpha = (k+1)-th largest s + b   p_j = scale s_j / sum_T s

``route_reference`` is the definition in PyTorch (what ``LatentMoE.route`` and ``ExpertBalancer``
compute step by step). The "triton" backend (moe_lc_kernels.routing) computes the selection, the
weights and the cutoff in one kernel and their gradient in one; ``route_statistics`` adds a
micro-batch to Quantile Balancing's histogram and the loads in one more, where the composition
launches about fifteen kernels a layer forward. Both are ``torch.library`` custom ops, so the
compiled MoE glue keeps them in its graph. The kernels' sigmoid may differ from torch's by an ulp,
so a token whose k-th and (k+1)-th biased scores are that close may route differently.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc.model.balancing import route_with_cutoff
from moe_lc.model.precision import upcast
from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc_kernels.routing import route_backward_triton, route_statistics_triton, route_triton

__all__ = ["routing_weights", "route_reference", "route_topk", "route_statistics", "resolve_backend", "triton_unsupported_reason"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TRITON_EXPERTS = 512  # one tile row holds a token's scores over all experts


def routing_weights(scores: Tensor, topk_idx: Tensor, scale: float) -> Tensor:
    """p_j = scale s_j / sum_T s for the selected experts [T, k], differentiable in the scores."""
    picked = scores.gather(1, topk_idx)
    return picked / picked.sum(-1, keepdim=True) * scale


def route_reference(logits: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(topk_idx [T, k], weights [T, k] fp32, cutoff [T] fp32) from the formula; the weights are
    differentiable in the logits, the bias only selects (``route_with_cutoff``, the balancer's own)."""
    scores = torch.sigmoid(upcast(logits))
    topk_idx, cutoff = route_with_cutoff(scores, bias, top_k)
    return topk_idx, routing_weights(scores, topk_idx, scale), cutoff


# -- the Triton paths, as custom ops -----------------------------------------------------------------

@torch.library.custom_op("moe_lc::route", mutates_args=())
def _route(logits: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return route_triton(logits, bias, top_k, scale)


@_route.register_fake
def _(logits: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    tokens = logits.shape[0]
    return (logits.new_empty(tokens, top_k, dtype=torch.int64), logits.new_empty(tokens, top_k, dtype=torch.float32),
            logits.new_empty(tokens, dtype=torch.float32))


@torch.library.custom_op("moe_lc::route_backward", mutates_args=())
def _route_backward(logits: Tensor, topk_idx: Tensor, dweights: Tensor, scale: float) -> Tensor:
    return route_backward_triton(logits, topk_idx, dweights, scale)


@_route_backward.register_fake
def _(logits: Tensor, topk_idx: Tensor, dweights: Tensor, scale: float) -> Tensor:
    return logits.new_empty(logits.shape)


def _route_setup(ctx, inputs, output) -> None:
    logits, _, _, scale = inputs
    ctx.save_for_backward(logits, output[0])
    ctx.scale = scale
    ctx.mark_non_differentiable(output[0], output[2])


def _route_grad(ctx, _didx, dweights: Tensor, _dcutoff):
    logits, topk_idx = ctx.saved_tensors
    return _route_backward(logits, topk_idx, dweights, ctx.scale), None, None, None


_route.register_autograd(_route_grad, setup_context=_route_setup)


@torch.library.custom_op("moe_lc::route_statistics", mutates_args=("loads", "hist", "value_range"))
def _route_statistics(logits: Tensor, bias: Tensor, topk_idx: Tensor, cutoff: Tensor, loads: Tensor,
                      hist: Optional[Tensor], value_range: Optional[Tensor]) -> None:
    route_statistics_triton(logits, bias, topk_idx, cutoff, loads, hist, value_range)


@_route_statistics.register_fake
def _(logits, bias, topk_idx, cutoff, loads, hist, value_range) -> None:
    return None


# -- the dispatch ------------------------------------------------------------------------------------

def triton_unsupported_reason(logits: Tensor, top_k: int, bias: Optional[Tensor] = None) -> Optional[str]:
    """Why the Triton kernels cannot route these logits here, or None when they can."""
    reason = triton_device_reason(logits.device)
    if reason is not None:
        return reason
    if type(logits) is not torch.Tensor or (bias is not None and type(bias) is not torch.Tensor):
        return f"the kernels take plain tensors, got {type(logits).__name__} logits and a {type(bias).__name__} bias"
    if logits.dim() != 2 or logits.dtype not in _TRITON_DTYPES:
        return f"the kernels take fp32/bf16/fp16 logits [tokens, experts], got {tuple(logits.shape)} {logits.dtype}"
    if not 1 <= top_k < logits.shape[1] <= MAX_TRITON_EXPERTS:
        return f"the kernels take 1 <= top_k < experts <= {MAX_TRITON_EXPERTS}, got top_k={top_k} of {logits.shape[1]}"
    return None


def resolve_backend(logits: Tensor, top_k: int, backend: str = "auto", bias: Optional[Tensor] = None) -> str:
    """The backend ``route_topk`` runs: "auto" takes Triton only on CUDA (never the CPU interpreter)."""
    return choose_backend("routing", backend, "triton", triton_unsupported_reason(logits, top_k, bias),
                          auto_takes_fast=logits.is_cuda)


def route_topk(logits: Tensor, bias: Tensor, top_k: int, scale: float,
               backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """(topk_idx [T, k] int64, weights [T, k] fp32, cutoff [T] fp32) of logits [T, E] under ``bias``
    [E]; the weights are differentiable in the logits. Slots in descending order of s + b."""
    if resolve_backend(logits, top_k, backend, bias) == "torch":
        return route_reference(logits, bias, top_k, scale)
    return _route(logits, bias, top_k, float(scale))


def route_statistics(logits: Tensor, bias: Tensor, topk_idx: Tensor, cutoff: Tensor, loads: Tensor,
                     hist: Optional[Tensor], value_range: Optional[Tensor]) -> None:
    """Add one micro-batch routed by ``route_topk``'s Triton path to the step's statistics, in place:
    ``loads`` [E] int64, and with ``hist`` [E, bins] int64 the histogram of required biases
    alpha_i - s_ij over ``value_range`` = [min b - 1, max b + 1] (``QuantileHistogram``'s bins)."""
    with torch.no_grad():
        _route_statistics(logits.detach(), bias, topk_idx, cutoff, loads, hist, value_range)
