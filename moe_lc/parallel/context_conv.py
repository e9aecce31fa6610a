"""The short convolution under context parallelism: each chunk borrows a halo of W - 1 tokens.

A causal convolution of W taps at the first W - 1 tokens of a chunk reaches into the previous
chunk in sequence order, which zigzag sharding puts on another rank (chunk r - 1 on rank r - 1 for
a rank's first chunk; chunk 2 cp - 2 - r on rank r + 1 for its second, or this rank's own first
chunk when r = cp - 1). Each rank therefore sends the last W - 1 tokens of each of its chunks to
the holder of the next chunk and receives one halo per chunk, point to point
(``batch_isend_irecv``: at most two sends and two receives per rank). It then convolves the
windows [halo, chunk] with every token's position in its document: a tap is used only where it
stays inside the token's document, so no halo value reaches across a document start (and chunk
0's zero halo is never used). The backward sends each halo's gradient back to the rank that lent
it, which adds it to its tail's gradient.

Cost per convolution and rank: (W - 1) x C values sent and received per chunk edge, twice in
each direction at most (forward: activations; backward: their gradients); one copy of the local
row into the windows and one out of them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.short_conv import convolve_at_positions
from moe_lc.parallel.context import ContextShard

__all__ = ["context_short_conv", "exchange_halos"]


def _lending(context: ContextShard):
    """This rank's part in the exchange, where chunk j - 1's tail becomes chunk j's halo for every
    chunk j > 0: sends (tail slot, borrowing rank), receives (halo slot, lending rank) and the
    pairs it lends itself (tail slot, halo slot)."""
    sends, receives, local = [], [], []
    for chunk in range(1, context.num_chunks):
        (lender, lent_slot), (borrower, halo_slot) = context.holder(chunk - 1), context.holder(chunk)
        if lender == context.rank and borrower == context.rank:
            local.append((lent_slot, halo_slot))
        elif lender == context.rank:
            sends.append((lent_slot, borrower))
        elif borrower == context.rank:
            receives.append((halo_slot, lender))
    return sends, receives, local


def _exchange(context: ContextShard, outgoing: list[tuple[Tensor, int]], incoming: list[tuple[Tensor, int]]) -> None:
    """Send each (tensor, peer) of ``outgoing`` and fill each of ``incoming``; cp-group ranks as peers."""
    group = context.group
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group) for t, peer in outgoing]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in incoming]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, context: ContextShard, *tails: Tensor) -> tuple[Tensor, ...]:
        ctx.context = context
        sends, receives, local = _lending(context)
        halos = [torch.zeros_like(t) for t in tails]
        for lent_slot, halo_slot in local:
            halos[halo_slot].copy_(tails[lent_slot])
        _exchange(context, [(tails[s], peer) for s, peer in sends], [(halos[s], peer) for s, peer in receives])
        return tuple(halos)

    @staticmethod
    def backward(ctx, *halo_grads: Tensor):
        sends, receives, local = _lending(ctx.context)
        tail_grads = [torch.zeros_like(g) for g in halo_grads]
        for lent_slot, halo_slot in local:
            tail_grads[lent_slot] += halo_grads[halo_slot]
        returned = [(s, torch.empty_like(tail_grads[s])) for s, _ in sends]
        _exchange(ctx.context, [(halo_grads[s], peer) for s, peer in receives],
                  [(buf, peer) for (_, buf), (_, peer) in zip(returned, sends)])
        for slot, buf in returned:
            tail_grads[slot] += buf
        return (None, *tail_grads)


def exchange_halos(context: ContextShard, head_tail: Tensor, back_tail: Tensor) -> tuple[Tensor, Tensor]:
    """The halos of this rank's two chunks (the tails of the chunks before them in sequence
    order; zeros before chunk 0) from the tails of its own chunks, ``[B, W - 1, C]`` each.
    Differentiable: the backward returns every halo's gradient to the rank it came from."""
    context.require_group("exchange_halos")
    return _HaloExchange.apply(context, head_tail, back_tail)


def context_short_conv(
    x: Tensor, weight: Tensor, docs: DocumentBounds, activation: Optional[str] = "silu", backend: str = "auto"
) -> Tensor:
    """:func:`moe_lc.ops.short_conv.short_conv` of this rank's local row ``x`` ``[1, T/cp, C]``
    (``docs.shard`` set), equal to the convolution of the whole row restricted to this rank's tokens."""
    context = docs.shard.context
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != context.local_len:
        raise ValueError(f"short_conv: under context parallelism x must be this rank's local row [1, "
                         f"{context.local_len}, C] (shard_row of the packed row), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"short_conv: weight must be [C, W], got shape {tuple(weight.shape)}")
    halo, chunk = weight.shape[1] - 1, context.chunk_len
    if halo > chunk:
        raise ValueError(f"short_conv: a convolution of {weight.shape[1]} taps needs chunks of at least {halo} tokens "
                         f"under context parallelism, got {chunk} (seq_len {context.seq_len} over 2*cp = "
                         f"{context.num_chunks} chunks); use a longer row or a smaller cp")
    positions = docs.shard.positions.clamp(max=halo)  # a tap j only asks whether the position is >= j
    if halo == 0:
        return convolve_at_positions(x, weight, positions, activation, backend)
    head, back = x[:, :chunk], x[:, chunk:]
    head_halo, back_halo = exchange_halos(context, head[:, chunk - halo:], back[:, chunk - halo:])
    windows = torch.cat([head_halo, head, back_halo, back], dim=1)
    pad = positions.new_zeros(halo)  # the halo's own outputs are dropped, so its positions do not matter
    window_positions = torch.cat([pad, positions[:chunk], pad, positions[chunk:]])
    y = convolve_at_positions(windows, weight, window_positions, activation, backend)
    return torch.cat([y[:, halo:halo + chunk], y[:, 2 * halo + chunk:]], dim=1)
