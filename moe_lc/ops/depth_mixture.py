"""The AttnRes depth mixture, one dispatch point.

    h = sum_i a_i v_i,   a = softmax_i( w . (g * v_i / rms(v_i)) ),   rms(v) = sqrt(mean(v^2) + eps)

over S sources v_i [..., d] with the pseudo-query w and the RMSNorm gain g ([d] each); with
``out_norm`` = (gamma, eps2) the result is the sublayer's pre-norm of it, gamma * h / rms(h)
(``moe_lc.ops.rms_norm``), which the Triton kernels apply without writing h or keeping it.
``depth_mixture_reference`` is the definition (plain PyTorch, any float dtype and device; what a
float64 model runs); ``depth_mixture`` picks it or the fused Triton kernels
(moe_lc_kernels.depth_mixture: one kernel each way, where the reference makes a dozen passes over
[tokens, d] per source). The Triton entry point is a graph break under ``torch.compile`` (the
``attn_res`` compile target compiles each depth mixer): Dynamo never traces into its launches.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc.ops.rms_norm import rms_norm
from moe_lc_kernels.depth_mixture import MAX_SOURCES, GradientSum, depth_mixture_triton
from moe_lc_kernels.depth_mixture import add_to_partial_sum as _add_to_partial_sum

__all__ = ["depth_mixture_reference", "depth_mixture", "resolve_backend", "triton_unsupported_reason", "GradientSum",
           "add_to_partial_sum"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _normalised(v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(v / rms(v), 1 / rms(v)) in fp32 over the last dim, as RMSNorm computes them (fp64 stays fp64)."""
    vf = v if v.dtype in (torch.float32, torch.float64) else v.float()
    r = torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)
    return vf * r, r


class _DepthMixture(torch.autograd.Function):
    """h = sum_i a_i v_i with a = softmax_i(w . (g * v_i / rms(v_i))), without stacking the sources.

    The forward keeps only the sources themselves (which the stream holds anyway), the mixture
    weights a and the inverse rms values, [S, B, T] each in fp32; the backward recomputes each
    normalised source when it needs it, one source at a time. Stacking the sources instead would
    copy all of them into a new [S, B, T, d] tensor, twice per layer, and autograd would keep it
    (with the norm's fp32 intermediates of the same size).
    """

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, eps: float, *sources: Tensor) -> Tensor:
        wide = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for a float64 model
        g, q = norm_weight.to(wide), query.to(wide)
        logits, inv_rms = [], []
        for v in sources:
            u, r = _normalised(v, eps)
            logits.append((u * g * q).sum(-1))  # the order of RMSNorm then the dot with the query
            inv_rms.append(r.squeeze(-1))
        a = torch.softmax(torch.stack(logits), dim=0)  # [S, B, T]
        out_dtype = sources[0].dtype
        for v in sources[1:]:
            out_dtype = torch.promote_types(out_dtype, v.dtype)
        mixed = a[0].to(out_dtype).unsqueeze(-1) * sources[0].to(out_dtype)
        for i in range(1, len(sources)):
            mixed = mixed + a[i].to(out_dtype).unsqueeze(-1) * sources[i].to(out_dtype)
        ctx.save_for_backward(query, norm_weight, a, torch.stack(inv_rms), *sources)
        return mixed

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, norm_weight, a, inv_rms, *sources = ctx.saved_tensors
        wide = a.dtype
        g = grad.to(wide)
        # d loss / d a_i = grad . v_i, then through the softmax: dl_i = a_i (da_i - sum_j a_j da_j)
        da = torch.stack([(g * v.to(wide)).sum(-1) for v in sources])
        dlogits = a * (da - (a * da).sum(0, keepdim=True))
        w = norm_weight.to(wide) * query.to(wide)
        weighted = torch.zeros_like(w)  # sum over tokens and sources of dl_i * u_i, u_i = v_i / rms(v_i)
        grads = []
        for i, v in enumerate(sources):
            r = inv_rms[i].unsqueeze(-1)
            u = v.to(wide) * r
            dl = dlogits[i].unsqueeze(-1)
            weighted += (dl * u).flatten(0, -2).sum(0)
            du = dl * w  # logit_i = u_i . w
            dv = a[i].unsqueeze(-1) * g + r * (du - u * (du * u).mean(-1, keepdim=True))
            grads.append(dv.to(v.dtype) if ctx.needs_input_grad[3 + i] else None)
        d_query = (weighted * norm_weight.to(wide)).to(query.dtype) if ctx.needs_input_grad[0] else None
        d_norm = (weighted * query.to(wide)).to(norm_weight.dtype) if ctx.needs_input_grad[1] else None
        return d_query, d_norm, None, *grads


def depth_mixture_reference(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """The mixture in plain PyTorch: math in fp32 (fp64 stays fp64), output in the sources'
    promoted dtype, each source's gradient in its own dtype. The reference."""
    return _DepthMixture.apply(query, norm_weight, eps, *sources)


def triton_unsupported_reason(sources: list[Tensor], query: Tensor, norm_weight: Tensor,
                              out_gain: Optional[Tensor] = None) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs here (with ``out_gain``, the pre-norm's gain), or
    None when they can."""
    first = sources[0]
    reason = triton_device_reason(first.device)
    if reason is not None:
        return reason
    if len(sources) > MAX_SOURCES:
        return f"the kernels take at most {MAX_SOURCES} sources, got {len(sources)}"
    tensors = [*sources, query, norm_weight, *([] if out_gain is None else [out_gain])]
    if any(t.dtype not in _TRITON_DTYPES for t in tensors):
        return (f"the kernels take fp32/bf16/fp16 sources, query and norm weight (fp64 runs the reference), got "
                f"{sorted({str(t.dtype) for t in tensors})}")
    if any(v.shape != first.shape for v in sources):
        return f"the kernels take sources of one shape, got {sorted({tuple(v.shape) for v in sources})}"
    if query.shape != (first.shape[-1],) or norm_weight.shape != query.shape:
        return (f"the kernels take a query and a norm weight of shape [d = {first.shape[-1]}], got "
                f"{tuple(query.shape)} and {tuple(norm_weight.shape)}")
    if out_gain is not None and out_gain.shape != query.shape:
        return f"the kernels take a pre-norm gain of shape [d = {first.shape[-1]}], got {tuple(out_gain.shape)}"
    if any(t.device != first.device for t in tensors):
        return f"the inputs are on several devices: {sorted({str(t.device) for t in tensors})}"
    if any(v.stride(-1) != 1 for v in sources if v.shape[-1] > 1):
        return "the kernels take sources whose last dim is contiguous (stride 1)"
    return None


def resolve_backend(sources: list[Tensor], query: Tensor, norm_weight: Tensor, backend: str = "auto",
                    out_gain: Optional[Tensor] = None) -> str:
    """The backend ``depth_mixture`` runs: "auto" takes Triton only on CUDA (never the slow CPU interpreter)."""
    reason = triton_unsupported_reason(sources, query, norm_weight, out_gain)
    return choose_backend("depth_mixture", backend, "triton", reason, auto_takes_fast=sources[0].is_cuda)


# A graph break under torch.compile: Dynamo runs the kernels' autograd Function as it is, eagerly.
_depth_mixture_fused = torch.compiler.disable(depth_mixture_triton)
# The same for the partial sum's add, whose backward hands its gradient to a GradientSum (a Python object).
add_to_partial_sum = torch.compiler.disable(_add_to_partial_sum)


def depth_mixture(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float,
                  backend: str = "auto", sums: Optional[Sequence[GradientSum]] = None,
                  out_norm: Optional[tuple[Tensor, float]] = None) -> Tensor:
    """sum_i a_i v_i over ``sources`` (at least one, [..., d] each), differentiable in all inputs.

    Backends: "torch" (the reference), "triton" (fused kernels: fp32/bf16/fp16 sources of one
    shape, possibly of different dtypes, with a contiguous last dim; at most MAX_SOURCES), "auto"
    (triton for such CUDA inputs when installed, torch otherwise, float64 included).
    ``sums``: one :class:`GradientSum` per source, shared by all the mixtures that read it, where the
    Triton backward sums the source's gradient in its kernels (the reference leaves it to autograd);
    the gradients autograd sees in the end are the same either way.
    ``out_norm``: (gain [d], eps) of the RMSNorm that reads the mixture; the result is then that
    norm's output (the reference computes the mixture, then ``rms_norm``; the kernels do both at once).
    """
    if resolve_backend(sources, query, norm_weight, backend, None if out_norm is None else out_norm[0]) == "torch":
        mixed = depth_mixture_reference(sources, query, norm_weight, eps)
        return mixed if out_norm is None else rms_norm(mixed, *out_norm)
    return _depth_mixture_fused(sources, query, norm_weight, eps, sums, out_norm)
