"""Attention Residuals across depth (SPEC 2.4).

The input of sublayer j is a softmax mixture over the residual sources
    h_j = sum_i a_i v_i,   a = softmax_i( w_j . RMSNorm_j(v_i) )
where the sources are the embedding, the completed block sums and the current block's
partial sum. With w_j = 0 (the initialisation) the mixture is the uniform mean.

`ResidualStream` keeps the sources explicitly so that pipeline stages can send exactly
what the next stage lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from moe_lc.model.norm import RMSNorm
from moe_lc.model.precision import upcast


class DepthMixer(nn.Module):
    """One pseudo-query w_j with its own RMSNorm, mixing a list of sources."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = RMSNorm(d_model, eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        self.norm.reset_parameters()

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            # softmax over one source is exactly 1; skip the work (no gradient to w either way)
            return sources[0]
        v = torch.stack(sources, dim=0)  # [S, B, T, d]
        logits = (upcast(self.norm(v)) * upcast(self.query)).sum(-1)  # [S, B, T]
        a = torch.softmax(logits, dim=0).to(v.dtype)
        return (a.unsqueeze(-1) * v).sum(0)


@dataclass
class ResidualStream:
    """The residual state between sublayers.

    mode "none": `partial` is the plain residual h (sources holds only the embedding, unused).
    mode "block"/"full": `sources` are completed sources, `partial` the running block sum.
    """

    mode: str
    sources: list[torch.Tensor] = field(default_factory=list)
    partial: Optional[torch.Tensor] = None

    @classmethod
    def start(cls, mode: str, embedding: torch.Tensor) -> "ResidualStream":
        if mode == "none":
            return cls(mode, [], embedding)
        return cls(mode, [embedding], None)

    def all_sources(self) -> list[torch.Tensor]:
        return self.sources + ([self.partial] if self.partial is not None else [])

    def sublayer_input(self, mixer: Optional[DepthMixer]) -> torch.Tensor:
        if self.mode == "none":
            return self.partial
        sources = self.all_sources()
        if mixer is None:
            if len(sources) != 1:
                raise RuntimeError(f"a sublayer without a depth mixer got {len(sources)} sources; expected 1")
            return sources[0]
        return mixer(sources)

    def add_output(self, f: torch.Tensor) -> None:
        if self.mode == "full":
            self.sources.append(f)
        else:
            self.partial = f if self.partial is None else self.partial + f

    def end_layer(self, layer_idx: int, block_size: int) -> None:
        """Close the block after decoder layer `layer_idx` (0-based) when it completes one."""
        if self.mode == "block" and (layer_idx + 1) % block_size == 0 and self.partial is not None:
            self.sources.append(self.partial)
            self.partial = None

    def final(self, mixer: Optional[DepthMixer]) -> torch.Tensor:
        """What goes into the final norm: the plain residual, or the output mixture of all sources."""
        return self.sublayer_input(mixer)
