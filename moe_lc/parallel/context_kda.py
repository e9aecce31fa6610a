r"""Context-parallel KDA (KCP): a packed row's tokens over the cp ranks, equal to one process.

KDA is linear in its state. Over a chunk's last document piece, S_end = M S_start + S~, where S~
is the piece's end state from a zero start and M the product of its per-token transitions
(``moe_lc.ops.kda_segments``). With zigzag sharding (``moe_lc.parallel.context``) rank r holds
chunks r and 2 cp - 1 - r; a document may run across any number of chunks, ranks and the gap
between a rank's two chunks. Each rank, in forward:

1. for each of its chunks whose last piece goes on into the next chunk: that piece's end state,
   in the compute dtype (fp32; fp64 for fp64 inputs). When the piece starts inside the chunk its
   start state is known (zero, or the document's initial state) and one KDA pass over the piece
   gives the end state E itself. When the piece is the whole chunk (a document that started
   earlier), its start state is another rank's, so it computes (S~, M) instead: two passes, the
   second with K zero-value columns from the identity.
2. one all-gather over the cp group of those [2, H, K, V] states (with M: [2, H, K, V + K]);
   ranks send zeros for chunks nobody needs, so every rank sends the same size, independent of T.
3. the same prefix scan over the chunks in sequence order on every rank, E_j = M_j E_{j-1} + S~_j
   where chunk j's last piece continues chunk j - 1's document, E_j = S~_j where it starts one
   (a document starting exactly at a chunk edge starts from its own state: no carry across it).
4. its outputs: one KDA pass over its local row, each piece started from E of the chunk before
   it when it continues a document, else from zero or the document's initial state.

Backward is the mirror image, by autograd through the same steps: the outputs' gradient flows back
into each piece's start state, through the scan (M_j^T) into the gathered states, and the
all-gather's backward (a reduce-scatter, summing every rank's gradient of chunk j's states)
returns it to the rank that computed them, which runs the backward of its passes of step 1.

Cost per KDA layer and rank, against one process's share (one pass over T / cp tokens): step 1 is
one extra pass over each local chunk's last piece that continues into the next chunk, and a second
one (K columns instead of V) where that piece is the whole chunk; worst case, one document over the
whole row, three passes in all. Communication: one all-gather of 2 H K V values (2 H K (V + K) when
some chunk of the row is one piece of a document started earlier) in the compute dtype, i.e.
(cp - 1) times that received; the backward reduce-scatters as much. Nothing is sent when no
document crosses a chunk edge. The scan is 2 cp small [K, K] x [K, V] products per head.

Only packed rows (B = 1, ``docs`` with a shard) are sharded; a row without documents is one
document [0, T]. Final states are not returned (a document ends on whichever rank holds its last
token). An ``initial_state`` is [N, H, K, V] for all N documents of the row, the same on every
rank; like a replicated weight's, its gradient on each rank is the part of that rank's tokens and
sums over the cp group to the whole.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import chunk_kda
from moe_lc.ops.kda_projections import chunk_kda_from_projections
from moe_lc.ops.kda_segments import transition_of
from moe_lc.parallel.comm import gather_sequence
from moe_lc.parallel.context import DocumentShard

__all__ = ["context_chunk_kda", "context_kda_from_projections", "context_parallel_kda", "LocalKDA"]


class LocalKDA(Protocol):
    """KDA over the tokens ``span`` of this rank's row with the given values and start states;
    returns ``(o, final_state or None)`` like :func:`moe_lc.ops.kda.chunk_kda`."""

    def __call__(self, span: slice, values: Tensor, initial_state: Optional[Tensor], output_final_state: bool,
                 docs: Optional[DocumentBounds]) -> tuple[Tensor, Optional[Tensor]]: ...


def context_chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                      initial_state: Optional[Tensor], output_final_state: bool, docs: DocumentBounds,
                      gate_lower_bound: Optional[float], backend: str) -> tuple[Tensor, None]:
    """:func:`moe_lc.ops.kda.chunk_kda` of this rank's local row (``docs.shard`` set); same arguments."""
    _check("chunk_kda", q, v, initial_state, output_final_state, docs)

    def run(span, values, start, final, piece_docs):
        return chunk_kda(q[:, span], k[:, span], values, g[:, span], beta[:, span], scale=scale, initial_state=start,
                         output_final_state=final, docs=piece_docs, gate_lower_bound=gate_lower_bound,
                         backend=backend)

    return context_parallel_kda(run, v, q.shape[-1], initial_state, docs.shard), None


def context_kda_from_projections(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, A_log: Tensor,
                                 dt_bias: Optional[Tensor], lower_bound: Optional[float], scale: float,
                                 initial_state: Optional[Tensor], output_final_state: bool, docs: DocumentBounds,
                                 backend: str) -> tuple[Tensor, None]:
    """:func:`moe_lc.ops.kda_projections.chunk_kda_from_projections` of this rank's local row
    (``docs.shard`` set); same arguments. Every pass runs on the fused backend the op would pick."""
    _check("chunk_kda_from_projections", q, v, initial_state, output_final_state, docs)

    def run(span, values, start, final, piece_docs):
        return chunk_kda_from_projections(q[:, span], k[:, span], values, z[:, span], beta_logits[:, span], A_log,
                                          dt_bias, lower_bound=lower_bound, scale=scale, initial_state=start,
                                          output_final_state=final, docs=piece_docs, backend=backend)

    return context_parallel_kda(run, v, q.shape[-1], initial_state, docs.shard), None


def context_parallel_kda(run: LocalKDA, v: Tensor, key_dim: int, initial_state: Optional[Tensor],
                         view: DocumentShard) -> Tensor:
    """The outputs ``[1, T/cp, H, V]`` of KCP (steps 1-4 of the module docstring) for any KDA
    implementation ``run``; ``v`` is this rank's values, ``initial_state`` None or [N, H, K, V]."""
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    gathered = _share_tail_states(run, v, key_dim, initial_state, view, dtype)  # steps 1 and 2
    if gathered is None and initial_state is None:
        starts = None  # no document crosses a chunk edge and none has a given start: all start from zero
    else:
        ends = {} if gathered is None else _scan(gathered, view, v.shape[3])  # step 3
        zero = v.new_zeros(v.shape[2], key_dim, v.shape[3], dtype=dtype)
        starts = torch.stack([ends[p.chunk - 1] if p.from_previous
                              else initial_state[p.doc].to(dtype) if initial_state is not None
                              else zero for p in view.pieces])
        if gathered is not None:
            starts = _DependOn.apply(starts, gathered)  # so that every rank's backward reaches the all-gather's
    out, _ = run(slice(None), v, starts, False, view.local)  # step 4
    return out


def _share_tail_states(run: LocalKDA, v: Tensor, key_dim: int, initial_state: Optional[Tensor], view: DocumentShard,
                       dtype: torch.dtype) -> Optional[Tensor]:
    """Every chunk's tail state(s) ``[2 cp, H, K, V (+ K)]`` in rank-major order, all-gathered;
    None (and nothing sent) when no document crosses a chunk edge."""
    carried = [chunk for chunk in view.chunks if not chunk.ends_document]
    if not carried:
        return None
    with_transition = any(chunk.tail_from_previous for chunk in carried)
    local = torch.stack([_tail_state(run, v, key_dim, initial_state, view, slot, with_transition, dtype)
                         for slot in (0, 1)])
    if torch.is_grad_enabled() and not local.requires_grad:
        local.requires_grad_()  # only zeros here (no chunk of this rank is needed), but the backward's
        # reduce-scatter must run on every rank: it returns the other ranks' gradients to them
    return gather_sequence(local, 0, view.context.group)


def _scan(gathered: Tensor, view: DocumentShard, value_dim: int) -> dict[int, Tensor]:
    """End state E_j of the document open at the end of chunk j, for the chunks before this
    rank's last one: E_j = M_j E_{j-1} + S~_j where chunk j is one piece of a document started
    earlier, else the E_j that chunk j's rank sent."""
    context = view.context
    ends: dict[int, Tensor] = {}
    for j in range(max(context.chunks)):
        if view.chunks[j].ends_document:
            continue
        rank, slot = context.holder(j)
        entry = gathered[2 * rank + slot]
        state = entry[..., :value_dim]
        if view.chunks[j].tail_from_previous:
            state = entry[..., value_dim:] @ ends[j - 1] + state
        ends[j] = state
    return ends


def _tail_state(run: LocalKDA, v: Tensor, key_dim: int, initial_state: Optional[Tensor], view: DocumentShard,
                slot: int, with_transition: bool, dtype: torch.dtype) -> Tensor:
    """What this rank sends for its chunk ``slot``: [H, K, V] end state E, or S~ (from zero) with
    M beside it ([H, K, V + K] when ``with_transition``); zeros where no later chunk needs them."""
    chunk = view.context.chunks[slot]
    info = view.chunks[chunk]
    heads, value_dim = v.shape[2], v.shape[3]
    width = value_dim + key_dim if with_transition else value_dim
    if info.ends_document:
        return v.new_zeros(heads, key_dim, width, dtype=dtype)
    tail = [p for p in view.pieces if p.chunk == chunk][-1]
    span = slice(tail.local_start, tail.local_end)

    def final_state(values: Tensor, start: Optional[Tensor]) -> Tensor:
        return run(span, values, start, True, None)[1].to(dtype)

    if info.tail_from_previous:
        s_tilde, transition = transition_of(final_state, v[:, span], key_dim)
        return torch.cat([s_tilde[0], transition[0]], dim=-1)
    start = None if initial_state is None else initial_state[tail.doc : tail.doc + 1]
    end = final_state(v[:, span], start)[0]
    if with_transition:
        end = torch.cat([end, end.new_zeros(heads, key_dim, key_dim)], dim=-1)
    return end


class _DependOn(torch.autograd.Function):
    """``x``, made to depend on ``other``: backward hands ``other`` a zero gradient, so that a rank
    whose outputs do not use the gathered states still takes part in the collective of their
    backward (a collective that only some ranks enter hangs)."""

    @staticmethod
    def forward(ctx, x: Tensor, other: Tensor) -> Tensor:
        ctx.other_shape, ctx.other_dtype = other.shape, other.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.other_shape, dtype=ctx.other_dtype)


def _check(name: str, q: Tensor, v: Tensor, initial_state: Optional[Tensor], output_final_state: bool,
           docs: DocumentBounds) -> None:
    """Errors before any collective, the same on every rank."""
    context = docs.shard.context
    if output_final_state:
        raise NotImplementedError(f"{name}: under context parallelism final states are not returned (each document "
                                  "ends on the rank holding its last token); call with output_final_state=False")
    if q.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"{name}: context parallelism shards one packed row: q must be [1, T/cp, H, K], got "
                         f"{tuple(q.shape)}; pack the rows into one with a document per row (docs)")
    if q.shape[1] != context.local_len or v.shape[1] != context.local_len:
        raise ValueError(f"{name}: this rank holds {context.local_len} of the row's {context.seq_len} tokens, got "
                         f"q with {q.shape[1]} and v with {v.shape[1]}; pass this rank's local row (shard_row)")
    expected = (docs.num_docs, q.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"{name}: initial_state must be [N, H, K, V] = {expected} for all N documents of the row "
                         f"(the same on every rank), got {tuple(initial_state.shape)}")
    context.require_group(name)
