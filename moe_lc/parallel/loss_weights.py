"""A micro-batch's weights in the step's loss, per term, for ranks that hold part of its rows.

The step's loss is sum_i n_i / N (lm_i + w mtp_i + aux_i) over the micro-batches i of the global
batch (N: its label tokens). A rank that computes a micro-batch whole weights every term by n_i / N.
Under context parallelism a rank holds a shard of the row, and its means are over the shard's
tokens; these weights make the ranks' terms add up to the whole row's:

    lm:   n_here / N                          (lm_here n_here is the shard's part of lm_i n_i)
    mtp:  (n_row / N) (m_here / m_row)        (m: MTP targets; splits mtp_i by the shard's share)
    aux:  n_here / N                          (each shard's own balance loss, moe.balancing=aux)

A term whose weight is zero (a shard without labels or MTP targets) contributes zero, not the NaN
of its empty mean; its gradient is zero either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class TermWeights:
    """Device scalars (float64): the weight of each term of one micro-batch on this rank."""

    lm: Tensor
    mtp: Tensor
    aux: Tensor

    @classmethod
    def whole(cls, label_tokens: int, denom: Tensor) -> "TermWeights":
        """The micro-batch computed whole: n_i / N for every term."""
        share = torch.full_like(denom, label_tokens) / denom
        return cls(share, share, share)

    @classmethod
    def shard(cls, label_tokens_here: int, label_tokens_row: int, mtp_here: Optional[Tensor],
              mtp_row: Optional[Tensor], denom: Tensor, ignore_index: int) -> "TermWeights":
        """A shard of the row: ``mtp_here`` / ``mtp_row`` are the shard's and the row's MTP targets
        (None without MTP; only their counts matter)."""
        here = torch.full_like(denom, label_tokens_here) / denom
        if mtp_here is None or mtp_row is None:
            return cls(here, torch.zeros_like(denom), here)
        m_here = (mtp_here != ignore_index).sum().to(denom.dtype)
        m_row = (mtp_row != ignore_index).sum().to(denom.dtype).clamp(min=1)
        return cls(here, label_tokens_row * m_here / (m_row * denom), here)


def _weighted(value: Tensor, weight: Tensor) -> Tensor:
    return torch.where(weight > 0, value * weight.to(value.dtype), torch.zeros_like(value))


def weighted_balance(aux_loss: Tensor, weights: TermWeights) -> Tensor:
    """The balance-loss term of layers whose micro-batch has no LM head here (a pipeline's inner stages)."""
    return _weighted(aux_loss, weights.aux)


def weighted_terms(lm_loss: Tensor, mtp_loss: Optional[Tensor], aux_loss: Optional[Tensor], mtp_weight: float,
                   weights: TermWeights) -> tuple[Tensor, Tensor]:
    """(the LM term, the other terms) of this rank's share of the step's loss; their sum is what the
    backward starts from."""
    lm = _weighted(lm_loss, weights.lm)
    extra = torch.zeros_like(lm)
    if mtp_loss is not None:
        extra = extra + mtp_weight * _weighted(mtp_loss, weights.mtp)
    if aux_loss is not None:
        extra = extra + weighted_balance(aux_loss, weights)
    return lm, extra
