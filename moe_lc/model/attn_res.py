"""Attention Residuals across depth.

The input of sublayer j is a softmax mixture over the residual sources
    h_j = sum_i a_i v_i,   a = softmax_i( w_j . RMSNorm_j(v_i) )
where the sources are the embedding, the completed block sums and the current block's
partial sum. With w_j = 0 (the initialisation) the mixture is the uniform mean.

`ResidualStream` keeps the sources explicitly so that pipeline stages can send exactly
what the next stage lacks. It is immutable: adding a sublayer's output returns a new stream
(the tensors are shared, never copied), so a layer is a pure function of the stream it is
given, which activation checkpointing needs (a recomputed layer sees the same inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from moe_lc.model.norm import RMSNorm


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


class _MixerNorm(RMSNorm):
    """A depth mixer's RMSNorm_j. Its forward is the whole mixture (norm, scores against the query,
    softmax, weighted sum: one op), so that the norm's weight is used inside the norm module's own
    call, where module hooks (tensor parallelism's rank-local weights) expect it."""

    def forward(self, sources: list[Tensor], query: Tensor) -> Tensor:  # type: ignore[override]
        return _DepthMixture.apply(query, self.weight, self.eps, *sources)


class DepthMixer(nn.Module):
    """One pseudo-query w_j with its own RMSNorm, mixing a list of sources."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = _MixerNorm(d_model, eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        self.norm.reset_parameters()

    def forward(self, sources: list[Tensor]) -> Tensor:
        if len(sources) == 1:
            # softmax over one source is exactly 1; skip the work (no gradient to w either way)
            return sources[0]
        return self.norm(sources, self.query)


@dataclass(frozen=True)
class ResidualStream:
    """The residual state between sublayers (immutable: every update returns a new stream).

    mode "none": `partial` is the plain residual h (no sources).
    mode "block"/"full": `sources` are completed sources, `partial` the running block sum.
    """

    mode: str
    sources: tuple[Tensor, ...] = ()
    partial: Optional[Tensor] = None

    @classmethod
    def start(cls, mode: str, embedding: Tensor) -> "ResidualStream":
        if mode == "none":
            return cls(mode, (), embedding)
        return cls(mode, (embedding,), None)

    def all_sources(self) -> list[Tensor]:
        return [*self.sources, *([self.partial] if self.partial is not None else [])]

    def sublayer_input(self, mixer: Optional[DepthMixer]) -> Tensor:
        if self.mode == "none":
            return self.partial
        sources = self.all_sources()
        if mixer is None:
            if len(sources) != 1:
                raise RuntimeError(f"a sublayer without a depth mixer got {len(sources)} sources; expected 1")
            return sources[0]
        return mixer(sources)

    def plus(self, f: Tensor) -> "ResidualStream":
        """The stream after a sublayer's output f: a new source (full), else added to the partial sum."""
        if self.mode == "full":
            return ResidualStream(self.mode, (*self.sources, f), self.partial)
        return ResidualStream(self.mode, self.sources, f if self.partial is None else self.partial + f)

    def end_layer(self, layer_idx: int, block_size: int) -> "ResidualStream":
        """The stream after decoder layer `layer_idx` (0-based): its block closed when it completes one."""
        if self.mode == "block" and (layer_idx + 1) % block_size == 0 and self.partial is not None:
            return ResidualStream(self.mode, (*self.sources, self.partial), None)
        return self

    def final(self, mixer: Optional[DepthMixer]) -> Tensor:
        """What goes into the final norm: the plain residual, or the output mixture of all sources."""
        return self.sublayer_input(mixer)
