"""Chunkwise KDA in plain PyTorch: the ``"torch"`` backend of :func:`moe_lc.ops.kda.chunk_kda`.

Inputs arrive validated (see ``kda.py``). The work splits into a part that is parallel over all
chunks (decayed score matrices and the WY/UT solve) and a short Python loop over chunks that
carries the state. See the docstring of ``moe_lc.ops.kda`` for the derivation.

Numerical care (why the code is not a literal transcription of the formulas):
- Decay ratios ``exp(G_i - G_j)`` are never formed as ``Gamma_i * (1 / Gamma_j)`` over a whole
  64-token chunk: with g near -5 per step, ``1 / Gamma`` reaches e^320 and overflows. Inside a
  chunk we work in 16-token tiles and split the log-decay between two tokens into same-sign sums
  (rest of the key's tile, whole tiles in between, start of the query's tile); every factor is
  <= 1, so nothing overflows for any g <= 0, and no large cumulative sums are subtracted.
- Only the diagonal tiles need ``exp(-prefix)`` (at most e^(16 |g|max)). When that could
  overflow the compute dtype (unbounded softplus gates), diagonal tiles fall back to an exact
  pairwise decay tensor.
- Documents are padded one by one to a multiple of the chunk size, so every document starts on a
  chunk boundary; padding tokens have k = v = q = 0, beta = 0, g = 0 and leave the state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds

CHUNK_SIZE = 64
TILE_SIZE = 16

# Largest per-tile decay span (-sum of g over one tile) for which exp(+span) times an O(1)
# operand stays finite and exp(-span) stays a normal number in the compute dtype.
_FACTORIZED_SPAN_LIMIT = {torch.float32: 81.0, torch.float64: 600.0}


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _ChunkTable:
    """Where every token goes once each document is padded to a multiple of the chunk size.

    Every row (batch element) has the same document structure: one document spanning the row
    without document boundaries, the packed documents of the single row with them. Document ``n`` of
    row ``r`` is global document ``r * docs_per_row + n``.
    """

    gather_index: Tensor  # [T_padded]: source token of each padded slot (T = zero slot)
    scatter_index: Tensor  # [T]: padded slot of each real token
    start_chunk: dict[int, int]  # chunk index -> local document starting there
    end_chunk: dict[int, int]  # chunk index -> local document ending there
    docs_per_row: int
    num_chunks: int

    @staticmethod
    def build(seq_len: int, bounds: Sequence[int] | None, chunk: int, device: torch.device) -> "_ChunkTable":
        """From the host boundaries (None: one document per row); index tables copied to ``device``."""
        cu = torch.tensor([0, seq_len] if bounds is None else list(bounds), dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        padded = (lengths + chunk - 1) // chunk * chunk
        padded_starts = torch.cumsum(padded, 0) - padded
        docs = torch.arange(len(lengths))

        slot_doc = torch.repeat_interleave(docs, padded)
        slot_offset = torch.arange(int(padded.sum())) - padded_starts[slot_doc]
        is_real = slot_offset < lengths[slot_doc]
        gather_index = torch.where(is_real, cu[:-1][slot_doc] + slot_offset, seq_len)

        token_doc = torch.repeat_interleave(docs, lengths)
        scatter_index = padded_starts[token_doc] + torch.arange(seq_len) - cu[:-1][token_doc]

        first = (padded_starts // chunk).tolist()
        last = ((padded_starts + padded) // chunk - 1).tolist()
        return _ChunkTable(
            gather_index=gather_index.to(device),
            scatter_index=scatter_index.to(device),
            start_chunk={c: n for n, c in enumerate(first)},
            end_chunk={c: n for n, c in enumerate(last)},
            docs_per_row=len(lengths),
            num_chunks=int(padded.sum()) // chunk,
        )

    def to_chunks(self, x: Tensor, chunk: int) -> Tensor:
        """[R, T, H, *D] -> [num_chunks, R, H, chunk, *D] with zero padding slots.

        Chunk-major and contiguous, so the state loop takes cheap contiguous slices."""
        zero_slot = x.new_zeros(x.shape[0], 1, *x.shape[2:])
        padded = torch.cat([x, zero_slot], dim=1)[:, self.gather_index]
        padded = padded.reshape(x.shape[0], self.num_chunks, chunk, *x.shape[2:])
        return padded.permute(1, 0, 3, 2, *range(4, padded.dim())).contiguous()

    def from_chunks(self, x: Tensor) -> Tensor:
        """[num_chunks, R, H, chunk, D] -> [R, T, H, D] (drops the padding slots)."""
        _, rows, heads, _, dim = x.shape
        flat = x.permute(1, 0, 3, 2, 4).reshape(rows, -1, heads, dim)
        return flat[:, self.scatter_index]


# ----------------------------------------------------------------------------- decayed scores
def _reverse_exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """out[j] = sum of x[m] over m > j along ``dim`` (a same-sign sum, no cancellation)."""
    tail = x.narrow(dim, 1, x.shape[dim] - 1)
    summed = tail.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([summed, torch.zeros_like(x.narrow(dim, 0, 1))], dim=dim)


@dataclass(frozen=True)
class _TileDecay:
    """Same-sign partial sums of g inside 16-token tiles, shared by every score matrix of a chunk."""

    prefix: Tensor  # [..., tiles, 16, K]: log-decay over (tile start, i]
    suffix: Tensor  # [..., tiles, 16, K]: log-decay over (j, tile end]
    tile_total: Tensor  # [..., tiles, K]
    pairwise_diagonal: bool  # True when exp(-prefix) could overflow the dtype

    @staticmethod
    def build(g: Tensor, pairwise_diagonal: bool | None = None) -> "_TileDecay":
        *batch, chunk, dim = g.shape
        tiles = g.reshape(*batch, chunk // TILE_SIZE, TILE_SIZE, dim)
        prefix = tiles.cumsum(-2)
        tile_total = prefix[..., -1, :]
        if pairwise_diagonal is None:
            span = float(-tile_total.detach().min()) if tile_total.numel() else 0.0
            pairwise_diagonal = span > _FACTORIZED_SPAN_LIMIT[g.dtype]
        return _TileDecay(prefix, _reverse_exclusive_cumsum(tiles, -2), tile_total, pairwise_diagonal)


def decayed_scores(x: Tensor, y: Tensor, g: Tensor, *, strict: bool, pairwise_diagonal: bool | None = None) -> Tensor:
    """Causal decayed scores inside each chunk.

    ``out[..., i, j] = sum_c x[i, c] * y[j, c] * exp(sum_{m in (j, i]} g[m, c])`` for ``j <= i``
    (``j < i`` if ``strict``) and 0 above, over the last two dims ``[C, K]`` (C a multiple of 16).
    ``pairwise_diagonal=None`` picks the factorized diagonal tiles whenever that is safe.
    """
    return _decayed_scores(x, y, _TileDecay.build(g, pairwise_diagonal), strict=strict)


def _decayed_scores(x: Tensor, y: Tensor, decay: _TileDecay, *, strict: bool) -> Tensor:
    """See :func:`decayed_scores`; built one 16-row tile at a time.

    The log-decay from key j (tile b) to query i (tile a > b) is
    ``prefix_a(i) + (whole tiles strictly between) + suffix_b(j)``, all <= 0, so every factor is
    <= 1. Inside a tile (b == a) it is ``prefix(i) - prefix(j)``: factorized as a matmul of
    ``x e^{prefix}`` with ``y e^{-prefix}`` (finite while the tile span fits the dtype) or pairwise.
    """
    *batch, chunk, dim = x.shape
    tiles = chunk // TILE_SIZE
    xt = x.reshape(*batch, tiles, TILE_SIZE, dim)
    yt = y.reshape(*batch, tiles, TILE_SIZE, dim)
    x_in = xt * decay.prefix.exp()
    y_out = yt * decay.suffix.exp()
    causal = torch.ones(TILE_SIZE, TILE_SIZE, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)

    if decay.pairwise_diagonal:
        log_decay = decay.prefix[..., :, None, :] - decay.prefix[..., None, :, :]
        log_decay = log_decay.masked_fill(~causal[..., None], float("-inf"))
        diagonal = (xt[..., :, None, :] * yt[..., None, :, :] * log_decay.exp()).sum(-1)
    else:
        diagonal = torch.where(causal, x_in @ (yt * (-decay.prefix).exp()).transpose(-1, -2), 0.0)

    rows = []
    for a in range(tiles):
        # Keys of earlier tiles, decayed to the start of tile a.
        earlier = [y_out[..., b, :, :] * decay.tile_total[..., b + 1 : a, None, :].sum(-3).exp() for b in range(a)]
        blocks = [x_in[..., a, :, :] @ torch.cat(earlier, dim=-2).transpose(-1, -2)] if earlier else []
        blocks.append(diagonal[..., a, :, :])
        if a < tiles - 1:
            blocks.append(x.new_zeros(*batch, TILE_SIZE, (tiles - 1 - a) * TILE_SIZE))
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)


# ----------------------------------------------------------------------------- chunk form
def chunk_kda_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    docs: DocumentBounds | None,
    gate_lower_bound: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise KDA (chunk 64) on validated inputs; computes in fp32 (fp64 for fp64 inputs).

    The reference checks ``g`` itself (a device read) and does not use ``gate_lower_bound``."""
    if bool((g > 0).any()):
        raise ValueError("chunk_kda: g is a log-decay and must be <= 0 everywhere; use kda_gate to produce it")
    rows, seq_len, heads, key_dim = k.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    layout = _ChunkTable.build(seq_len, None if docs is None else docs.host, CHUNK_SIZE, q.device)

    q, k, v, g = (layout.to_chunks(t.to(compute), CHUNK_SIZE) for t in (q, k, v, g))
    q = q * scale
    beta = layout.to_chunks(beta.to(compute), CHUNK_SIZE)[..., None]  # [N, R, H, C, 1]

    # Everything that does not depend on the state, for all chunks at once (names as in docs/design.md §2.6).
    log_gamma = g.cumsum(-2)  # G_i: log-decay from chunk start through token i; Gamma = exp(G)
    log_to_end = _reverse_exclusive_cumsum(g, -2)  # G_C - G_i
    tile_decay = _TileDecay.build(g)
    lower = beta * _decayed_scores(k, k, tile_decay, strict=True)  # StrictTril(Diag(beta)(Gamma*K)(K/Gamma)^T)
    causal_qk = _decayed_scores(q, k, tile_decay, strict=False)  # Tril((Gamma*Q)(K/Gamma)^T)
    # (I + lower) [W | U] = Diag(beta) [Gamma*K | V], i.e. W = M (Gamma*K), U = M V.
    rhs = beta * torch.cat([k * log_gamma.exp(), v], dim=-1)
    wu = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    w, u = wu.split([key_dim, v.shape[-1]], dim=-1)
    q_decayed = q * log_gamma.exp()  # Gamma*Q
    k_to_end = (k * log_to_end.exp()).transpose(-1, -2)  # (Gamma^{i->C} * K)^T
    chunk_decay = log_gamma[..., -1, :, None].exp()  # gamma_C

    # The state pass: one step per chunk.
    if initial_state is not None:
        initial_state = initial_state.to(compute).reshape(rows, layout.docs_per_row, *initial_state.shape[1:])
    per_chunk = zip(*(t.unbind(0) for t in (w, u, q_decayed, causal_qk, k_to_end, chunk_decay)))
    state = None
    outputs, finals = [], []
    for c, (w_c, u_c, q_c, qk_c, k_c, decay_c) in enumerate(per_chunk):
        if c in layout.start_chunk:
            doc = layout.start_chunk[c]
            if initial_state is None:
                state = q.new_zeros(rows, heads, key_dim, v.shape[-1])
            else:
                state = initial_state[:, doc]
        delta = u_c - w_c @ state  # U - W S
        outputs.append(q_c @ state + qk_c @ delta)
        state = decay_c * state + k_c @ delta
        if c in layout.end_chunk:
            finals.append(state)

    out = layout.from_chunks(torch.stack(outputs, dim=0))
    final_state = torch.stack(finals, dim=1).flatten(0, 1) if output_final_state else None
    return out, final_state
