r"""Gated MLA under context parallelism: every rank gathers the row's compressed keys and values.

MLA makes every key and value of a token from r + d_s numbers: its normalised kv latent
c_kv = RMSNorm(W_dkv x) (r = ``kv_lora_rank``) and its shared key W_ks x (d_s = ``qk_rope_dim``).
Under zigzag sharding (``moe_lc.parallel.context``: rank r holds chunks r and 2 cp - 1 - r) each
MLA layer, on each rank of the cp group:

1. computes c_kv and the shared key of its T / cp tokens (``GatedMLA``, unchanged);
2. starts one all-gather over the cp group of those [T / cp, r + d_s] latents (:func:`gather_row`,
   asynchronous), then projects its queries while the latents travel;
3. waits, puts the gathered chunks in sequence order, and up-projects the whole row's latents to
   per-head k_nope and v locally (under tensor parallelism: its H / tp heads); the shared key is
   broadcast to the heads;
4. attends its queries (its two chunks) to the keys of the row with the row's document-causal
   mask taken at the queries' row positions (``docs.attention_mask``: ``document_mask(...,
   query_ranges=...)`` in ``moe_lc.ops.attention``): a query at row position p sees the keys of its
   document up to p, whichever rank they came from.

Backward is autograd through the same steps: the gradients of the up-projected keys and values
flow back through the up-projection to the row's latents, and the all-gather's backward, a
reduce-scatter, sums every rank's gradient of each token's latent and returns it to the rank that
holds the token, which runs the backward of its norm and down-projections.

Cost per MLA layer and rank (T the row, cp ranks, H heads, d_qk = d_nope + d_s, d_v):

- communication: an all-gather of T / cp x (r + d_s) values per rank ((cp - 1) / cp of T (r + d_s)
  received), in the activations' dtype, and a reduce-scatter of as many gradients in backward. For
  k3-small (r = 512, d_s = 64) that is 1152 bytes per token in bf16, against 2 H (d_qk + d_v) = 10240
  bytes per token for the up-projected keys and values (H = 16): 8.9 times less. At T = 256K, cp = 4:
  216 MiB received per layer and rank.
- up-projection: every rank up-projects the whole row, 2 T r H (d_nope + d_v) FLOPs, cp times its
  one-process share; for k3-small at T = 256K and cp = 4 about 1.3% of the rank's attention FLOPs
  (those grow with T^2 / cp, this with T).
- attention: the causal work of the queries. For one document over the row, query chunk j costs
  about c (j c + c / 2) key visits (c = T / (2 cp)); chunks r and 2 cp - 1 - r sum to 2 cp c^2 =
  T^2 / (2 cp), exactly 1 / cp of the row's T^2 / 2: every rank does the same work. With many
  short documents the work follows where the documents fall and is balanced only on average.
- memory: the row's keys and values, T x H x (d_qk + d_v), on every rank (the one-process size).

Overlap: the forward's all-gather runs while the queries are projected (and the gate). A GPU
version could go further: gather per chunk and attend to the chunks already received while the
next arrive (ring-style, merging the partial softmaxes by their log-sum-exp), overlap the
backward's reduce-scatter with the queries' backward, up-project only the keys of the documents
that reach this rank's queries, or attend in the latent space (the up-projections absorbed into
the queries and the output), which makes the row's keys r + d_s wide per token for all heads.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from moe_lc.parallel.comm import PendingGather, start_gather
from moe_lc.parallel.context import DocumentShard, in_sequence_order

__all__ = ["PendingRow", "gather_row"]


class PendingRow:
    """The row's latents on their way (:func:`gather_row`); ``wait()`` returns them in sequence order."""

    def __init__(self, gather: PendingGather, widths: list[int], shard: DocumentShard) -> None:
        self._gather, self._widths, self._shard = gather, widths, shard

    def wait(self) -> list[Tensor]:
        """[1, row length, width] per part given to :func:`gather_row`."""
        row = in_sequence_order(self._gather.wait(), self._shard.context, dim=0)
        return [part.unsqueeze(0) for part in row.split(self._widths, dim=-1)]


def gather_row(parts: Sequence[Tensor], shard: DocumentShard) -> PendingRow:
    """Start the all-gather of this rank's per-token ``parts`` ([1, T / cp, width] each, e.g. MLA's
    c_kv and shared key) over the cp group, as one message; differentiable (backward: reduce-scatter)."""
    context = shard.context
    for part in parts:
        if part.dim() != 3 or part.shape[0] != 1 or part.shape[1] != context.local_len:
            raise ValueError(f"attention keys under context parallelism: each part must be this rank's local row "
                             f"[1, {context.local_len}, width] (shard_row of the packed row), got {tuple(part.shape)}")
    context.require_group("gather_row")
    widths = [part.shape[-1] for part in parts]
    local = torch.cat([part[0] for part in parts], dim=-1)  # [T / cp, sum of widths]
    return PendingRow(start_gather(local, context.group), widths, shard)
