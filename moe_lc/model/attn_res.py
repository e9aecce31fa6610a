"""Attention Residuals across depth.

The input of sublayer j is a softmax mixture over the residual sources
    h_j = sum_i a_i v_i,   a = softmax_i( w_j . RMSNorm_j(v_i) )
where the sources are the embedding, the completed block sums and the current block's
partial sum. With w_j = 0 (the initialisation) the mixture is the uniform mean.

`ResidualStream` keeps the sources explicitly so that pipeline stages can send exactly
what the next stage lacks. It is immutable: adding a sublayer's output returns a new stream
(the tensors are shared, never copied), so a layer is a pure function of the stream it is
given, which activation checkpointing needs (a recomputed layer sees the same inputs). Beside
each source it keeps the source's ``GradientSum``, handed to every mixture that reads the source,
so that the fused backward kernels sum the source's gradient over its readers (the embedding and
each block sum are read by every later sublayer's mixer) instead of autograd adding each
reader's share in a pass of its own; the sums carry no value in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from moe_lc.model.norm import RMSNorm
from moe_lc.ops.depth_mixture import GradientSum, add_to_partial_sum, depth_mixture, resolve_backend
from moe_lc.ops.stacked_linear import plain_tensor


class _MixerNorm(RMSNorm):
    """A depth mixer's RMSNorm_j. Its forward is the whole mixture (norm, scores against the query,
    softmax, weighted sum: one op, ``moe_lc.ops.depth_mixture`` on ``backend``), so that the norm's
    weight is used inside the norm module's own call, where module hooks (tensor parallelism's
    rank-local weights) expect it."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: str = "auto") -> None:
        super().__init__(dim, eps)
        self.backend = backend

    def forward(self, sources: list[Tensor], query: Tensor,  # type: ignore[override]
                sums: Optional[list[GradientSum]] = None,
                out_norm: Optional[tuple[Tensor, float]] = None) -> Tensor:
        return depth_mixture(sources, query, self.weight, self.eps, self.backend, sums, out_norm)


class DepthMixer(nn.Module):
    """One pseudo-query w_j with its own RMSNorm, mixing a list of sources.

    ``backend`` is handed to ``depth_mixture`` ("auto": the fused Triton kernels on GPUs);
    ``fused_norm``: the pre-norm that reads the mixture may run in the mixture's kernels
    (``fuses_norm``)."""

    def __init__(self, d_model: int, eps: float = 1e-6, backend: str = "auto", fused_norm: bool = True) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = _MixerNorm(d_model, eps, backend)
        self.fused_norm = fused_norm

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        self.norm.reset_parameters()

    def fuses_norm(self, out_norm: RMSNorm, sources: list[Tensor]) -> bool:
        """Whether ``out_norm`` (of this class exactly: no gate) goes into the mixture's kernels: the
        option is on, there is a mixture (two sources or more), the kernels take the inputs, and every
        weight is a plain tensor (under tensor parallelism they are DTensors whose local pieces only
        each module's own call sees: the norm then runs in its own call)."""
        if not self.fused_norm or len(sources) < 2 or type(out_norm) is not RMSNorm:
            return False
        weights = (self.query, self.norm.weight, out_norm.weight)
        if not all(plain_tensor(w) for w in weights):
            return False
        return resolve_backend(sources, self.query, self.norm.weight, self.norm.backend, out_norm.weight) == "triton"

    def forward(self, sources: list[Tensor], sums: Optional[list[GradientSum]] = None,
                out_norm: Optional[RMSNorm] = None) -> Tensor:
        """The mixture; ``sums``: the sources' gradient sums (``ResidualStream.sums``), or None.
        ``out_norm``: the norm that reads the mixture, applied in the mixture's kernels (the caller has
        checked ``fuses_norm``); the result is then that norm's output."""
        if len(sources) == 1:
            # softmax over one source is exactly 1; skip the work (no gradient to w either way)
            return sources[0]
        fused = None if out_norm is None else (out_norm.weight, out_norm.eps)
        return self.norm(sources, self.query, sums, fused)


@dataclass(frozen=True)
class ResidualStream:
    """The residual state between sublayers (immutable: every update returns a new stream).

    mode "none": `partial` is the plain residual h (no sources).
    mode "block"/"full": `sources` are completed sources, `partial` the running block sum.
    """

    mode: str
    sources: tuple[Tensor, ...] = ()
    partial: Optional[Tensor] = None
    # one per tensor of all_sources(), made where missing (mode "none" has none)
    sums: tuple[GradientSum, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        missing = 0 if self.mode == "none" else len(self.all_sources()) - len(self.sums)
        if missing > 0:
            object.__setattr__(self, "sums", (*self.sums, *(GradientSum() for _ in range(missing))))

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
        return mixer(sources, list(self.sums))

    def normed_input(self, mixer: Optional[DepthMixer], norm: RMSNorm) -> Tensor:
        """``norm`` of the sublayer's input: in the mixture's kernels where ``mixer.fuses_norm`` allows,
        else the norm's own call on the mixture."""
        if self.mode != "none" and mixer is not None:
            sources = self.all_sources()
            if mixer.fuses_norm(norm, sources):
                return mixer(sources, list(self.sums), out_norm=norm)
        return norm(self.sublayer_input(mixer))

    def plus(self, f: Tensor) -> "ResidualStream":
        """The stream after a sublayer's output f: a new source (full), else added to the partial sum."""
        if self.mode == "full":
            return ResidualStream(self.mode, (*self.sources, f), self.partial, self.sums)
        # a new partial sum: a new tensor, so a new gradient sum (made by __post_init__; none in mode "none").
        # The old partial's gradient through this sum is added in its mixture's backward kernel where
        # that mixture sums in its kernel (``add_to_partial_sum``), not by autograd in a pass of its own.
        if self.partial is None:
            partial = f
        elif self.mode == "none":
            partial = self.partial + f
        else:
            partial = add_to_partial_sum(self.partial, f, self.sums[len(self.sources)])
        return ResidualStream(self.mode, self.sources, partial, self.sums[: len(self.sources)])

    def end_layer(self, layer_idx: int, block_size: int) -> "ResidualStream":
        """The stream after decoder layer `layer_idx` (0-based): its block closed when it completes one."""
        if self.mode == "block" and (layer_idx + 1) % block_size == 0 and self.partial is not None:
            return ResidualStream(self.mode, (*self.sources, self.partial), None, self.sums)
        return self
