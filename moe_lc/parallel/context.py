"""How one packed row is split over the ranks of a context-parallel (cp) group: the zigzag
sharding (:class:`ContextShard`), each rank's view of the row's documents
(:class:`DocumentShard`, reached as ``docs.shard``), and moving rows in and out of shards.

Zigzag (head-tail) sharding: the row of T tokens is cut into 2 cp chunks of T / (2 cp) tokens and
rank r holds chunks r and 2 cp - 1 - r, in that order, as its local row of T / cp tokens. Causal
attention work grows with the position, so pairing an early chunk with a late one gives every rank
the same work. Every context-parallel layer uses this one sharding; token-wise layers do not care.

The documents view is pure host bookkeeping from the global host boundaries, made once per batch:
the row's documents cut at chunk edges into pieces, what each piece is part of, and which chunks a
document runs across. Building it reads nothing back from the device and communicates nothing.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from moe_lc.model.transformer import mtp_labels
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.short_conv import position_in_document
from moe_lc.parallel.comm import gather_sequence

__all__ = ["ContextShard", "ChunkDocuments", "DocumentPiece", "DocumentShard", "in_sequence_order",
           "shard_documents", "shard_model_inputs", "shard_row", "unshard_row"]


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of a row of ``seq_len`` tokens: chunks ``rank`` and ``2 size - 1 - rank``.

    ``group`` is the cp process group; None is allowed for host-side bookkeeping only (the
    context-parallel ops refuse it when ``size > 1``). Build it from a process group with
    :meth:`of` or from the mesh's ``cp`` dim with :meth:`from_mesh`.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"ContextShard: rank {self.rank} is not one of the {self.size} ranks of the cp group")
        if self.seq_len <= 0 or self.seq_len % (2 * self.size):
            raise ValueError(f"ContextShard: a row of {self.seq_len} tokens cannot be cut into 2*cp = {2 * self.size} "
                             f"equal chunks; make seq_len a multiple of {2 * self.size}")

    @classmethod
    def of(cls, group: Optional[dist.ProcessGroup], seq_len: int) -> "ContextShard":
        """This process's shard in ``group`` (None: a single rank, no communication)."""
        if group is None:
            return cls(None, 0, 1, seq_len)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), seq_len)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, seq_len: int) -> "ContextShard":
        """This process's shard along the mesh's ``cp`` dim (see ``moe_lc.parallel.build_mesh``)."""
        dim = mesh.mesh_dim_names.index("cp")
        if mesh.size(dim) == 1:
            return cls(None, 0, 1, seq_len)
        return cls(mesh.get_group("cp"), mesh.get_local_rank("cp"), mesh.size(dim), seq_len)

    @property
    def num_chunks(self) -> int:
        return 2 * self.size

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Tokens this rank holds (two chunks)."""
        return 2 * self.chunk_len

    @property
    def chunks(self) -> tuple[int, int]:
        """The global indices of this rank's chunks, in local order."""
        return self.rank, self.num_chunks - 1 - self.rank

    @property
    def ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The global token ranges [start, end) of this rank's chunks, in local order."""
        return tuple(self.chunk_range(c) for c in self.chunks)

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        return chunk * self.chunk_len, (chunk + 1) * self.chunk_len

    def holder(self, chunk: int) -> tuple[int, int]:
        """(rank, slot): which rank holds global chunk ``chunk``, and as its first (0) or second (1) chunk."""
        return (chunk, 0) if chunk < self.size else (self.num_chunks - 1 - chunk, 1)

    def require_group(self, where: str) -> None:
        """Fail before any collective when a shard of several ranks was built without their group."""
        if self.size > 1 and self.group is None:
            raise ValueError(f"{where}: this ContextShard of {self.size} ranks has no process group (group=None is "
                             "for host-side bookkeeping); build it with ContextShard.of(group, seq_len) or "
                             "ContextShard.from_mesh(mesh, seq_len)")


@dataclass(frozen=True)
class ChunkDocuments:
    """How the row's documents meet one chunk (global indices; every chunk holds at least one piece)."""

    first_doc: int  # the document of the chunk's first token
    last_doc: int  # the document of the chunk's last token
    starts_document: bool  # a document starts at the chunk's first token
    ends_document: bool  # a document ends at the chunk's last token

    @property
    def tail_from_previous(self) -> bool:
        """The chunk's last piece continues a document from the previous chunk (the chunk is one
        piece of a document that started earlier): its end state depends on that chunk's."""
        return self.first_doc == self.last_doc and not self.starts_document


@dataclass(frozen=True)
class DocumentPiece:
    """The part of one document inside one chunk of this rank."""

    local_start: int  # [local_start, local_end) in this rank's row
    local_end: int
    chunk: int  # the global chunk
    doc: int  # the global document
    from_previous: bool  # the document started in an earlier chunk
    into_next: bool  # the document goes on in the next chunk


@dataclass(frozen=True, eq=False)
class DocumentShard:
    """The row's documents as this rank sees them (``docs.shard``; build with :func:`shard_documents`).

    ``local`` marks the pieces of this rank's row as documents, so a per-document op that runs on
    the local row alone starts every piece afresh; the context-parallel ops use ``pieces`` and
    ``chunks`` to carry what crosses a chunk edge (KDA's state, the short convolution's halo).
    """

    context: ContextShard
    local: DocumentBounds  # boundaries of this rank's row: its documents cut at the two chunk edges
    pieces: tuple[DocumentPiece, ...]  # in local order, one per document of ``local``
    chunks: tuple[ChunkDocuments, ...]  # every chunk of the row, in global order
    positions: Tensor  # [local_len] on the device: each local token's offset from its document's start


def shard_documents(docs: DocumentBounds, context: ContextShard) -> DocumentBounds:
    """``docs`` (the whole row's boundaries) with this rank's view attached as ``.shard``.

    Host bookkeeping from ``docs.host``, one small upload of the local boundaries, and the
    positions computed on the device from ``docs.cu_seqlens``: no device read, no communication.
    """
    if docs.shard is not None:
        raise ValueError("shard_documents: these documents are already sharded; pass the row's unsharded bounds")
    if docs.total != context.seq_len:
        raise ValueError(f"shard_documents: the documents end at {docs.total} but the shard was built for rows of "
                         f"{context.seq_len} tokens; build the ContextShard with seq_len={docs.total}")
    bounds = docs.host
    chunks = tuple(_chunk_documents(bounds, *context.chunk_range(c)) for c in range(context.num_chunks))
    pieces: list[DocumentPiece] = []
    offset = 0
    for chunk, (start, end) in zip(context.chunks, context.ranges):
        cuts = [start, *(b for b in bounds if start < b < end), end]
        first = chunks[chunk].first_doc
        for n, (a, b) in enumerate(zip(cuts, cuts[1:])):
            pieces.append(DocumentPiece(offset + a - start, offset + b - start, chunk, first + n,
                                        from_previous=n == 0 and not chunks[chunk].starts_document,
                                        into_next=b == end and not chunks[chunk].ends_document))
        offset += end - start
    local = DocumentBounds.from_host([0, *(p.local_end for p in pieces)], docs.cu_seqlens.device)
    row_positions = position_in_document(docs.total, docs.cu_seqlens, docs.cu_seqlens.device)
    positions = torch.cat([row_positions[a:b] for a, b in context.ranges])
    view = DocumentShard(context, local, tuple(pieces), chunks, positions)
    return dataclasses.replace(docs, shard=view)


def _chunk_documents(bounds: tuple[int, ...], start: int, end: int) -> ChunkDocuments:
    """Which documents hold the first and last token of [start, end), by bisection of the bounds."""
    first = bisect_right(bounds, start) - 1
    last = bisect_right(bounds, end - 1) - 1
    return ChunkDocuments(first, last, starts_document=bounds[first] == start, ends_document=bounds[last + 1] == end)


def shard_model_inputs(input_ids: Optional[Tensor], labels: Optional[Tensor], docs: DocumentBounds,
                       context: ContextShard, mtp_row: Optional[Tensor] = None) -> dict:
    """The model's keyword arguments for this rank's shard of one packed row ([1, T] ``input_ids``
    and ``labels``, the row's ``docs``): its tokens and labels, the MTP targets cut from the whole
    row's (:func:`moe_lc.model.transformer.mtp_labels`, or ``mtp_row`` when the caller made them:
    the label after a chunk's last token lies in the next chunk), and the documents with this rank's
    view. Host-side cuts of host or device tensors; no communication. ``model(**shard_model_inputs(
    ...), return_logits=False)``. A None ``input_ids`` stays None (a pipeline's later stages)."""
    inputs = dict(input_ids=shard_row(input_ids, context) if input_ids is not None else None,
                  docs=shard_documents(docs, context))
    if labels is not None:
        inputs["labels"] = shard_row(labels, context)
        inputs["mtp_targets"] = shard_row(mtp_row if mtp_row is not None else mtp_labels(labels, docs), context)
    return inputs


def shard_row(x: Tensor, context: ContextShard, dim: int = 1) -> Tensor:
    """This rank's two chunks of the full row ``x`` (along ``dim``), concatenated; no communication."""
    if x.shape[dim] != context.seq_len:
        raise ValueError(f"shard_row: x has {x.shape[dim]} tokens along dim {dim} but the shard was built for rows "
                         f"of {context.seq_len}; build the ContextShard with the row's length")
    return torch.cat([x.narrow(dim, a, b - a) for a, b in context.ranges], dim=dim)


def unshard_row(x: Tensor, context: ContextShard, dim: int = 1) -> Tensor:
    """The full row from every rank's local row ``x`` (along ``dim``): one all-gather over the cp
    group, then the chunks put back in sequence order. Differentiable (the backward returns each
    rank the summed gradient of its tokens)."""
    if x.shape[dim] != context.local_len:
        raise ValueError(f"unshard_row: x has {x.shape[dim]} tokens along dim {dim}, a shard holds "
                         f"{context.local_len}; pass this rank's local row")
    context.require_group("unshard_row")
    return in_sequence_order(gather_sequence(x, dim, context.group), context, dim)


def in_sequence_order(gathered: Tensor, context: ContextShard, dim: int = 1) -> Tensor:
    """The row from every rank's local row concatenated in rank order (what an all-gather over the
    cp group returns: chunks 0, 2cp-1, 1, 2cp-2, ...), its chunks put back in sequence order."""
    slots = gathered.chunk(context.num_chunks, dim=dim)
    in_order = [slots[2 * rank + slot] for rank, slot in map(context.holder, range(context.num_chunks))]
    return torch.cat(in_order, dim=dim)
