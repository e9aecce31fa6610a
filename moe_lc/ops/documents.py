"""Packed-document boundaries of a batch row (:class:`DocumentBounds`), and uploads that do not wait
for the GPU (:func:`upload`)."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor

from moe_lc.ops.attention import DocumentMask, document_mask
from moe_lc_kernels.transfer import upload

if TYPE_CHECKING:  # moe_lc.parallel imports the model, which imports this module
    from moe_lc.parallel.context import DocumentShard

__all__ = ["DocumentBounds", "as_document_bounds", "upload"]


@dataclass(frozen=True, eq=False)
class DocumentBounds:
    """Packed-document boundaries of one batch row, on the device and on the host.

    Why both: the layers index with the boundaries on the device (short-convolution positions,
    MTP labels, FlashAttention-style kernels) and loop, check and plan kernel launches with them
    on the host (attention per document, the KDA kernels' chunk tables). Reading a device tensor
    back waits for all queued GPU work, so the host copy is made once, where the batch is
    uploaded, and travels with the device tensor as one argument.

    Build it with :meth:`from_host` (the trainer: one pinned upload) or :meth:`of` (a tensor
    already on the device: one host read). The constructor checks what it can without reading
    the device: dtype, length, the host boundaries themselves, and the content when the tensor
    is on the CPU.

    Under context parallelism the boundaries stay those of the whole row and ``shard`` holds
    this rank's view of them (its pieces, what crosses its chunk edges; built once per batch by
    :func:`moe_lc.parallel.context.shard_documents`); the KDA op, the short convolution and MLA's
    keys and mask run context-parallel when it is set. None: the row is not sharded.
    """

    cu_seqlens: Tensor  # int32 [N+1] on the compute device (FlashAttention convention), 0 = b_0 < ... < b_N = T
    host: tuple[int, ...]  # the same boundaries as host ints (no device read needed)
    shard: Optional["DocumentShard"] = None  # this rank's view under context parallelism

    def __post_init__(self) -> None:
        _check_tensor(self.cu_seqlens, "DocumentBounds")
        if self.cu_seqlens.dtype != torch.int32:
            raise ValueError(f"DocumentBounds: cu_seqlens must be int32 (the FlashAttention convention), got "
                             f"{self.cu_seqlens.dtype}; build it with DocumentBounds.of or DocumentBounds.from_host")
        host = _host_ints(self.host, "DocumentBounds")
        object.__setattr__(self, "host", host)
        if self.cu_seqlens.numel() != len(host):
            raise ValueError(f"DocumentBounds: cu_seqlens has {self.cu_seqlens.numel()} entries and host {len(host)}; "
                             "build it with DocumentBounds.of or DocumentBounds.from_host so that they agree")
        if self.cu_seqlens.device.type == "cpu" and tuple(self.cu_seqlens.tolist()) != host:
            raise ValueError(f"DocumentBounds: cu_seqlens {_preview(self.cu_seqlens.tolist())} and host "
                             f"{_preview(host)} differ; build it with DocumentBounds.of or DocumentBounds.from_host")
        if self.shard is not None and self.shard.context.seq_len != host[-1]:
            raise ValueError(f"DocumentBounds: the shard view is of a row of {self.shard.context.seq_len} tokens, "
                             f"these documents end at {host[-1]}; build it with shard_documents(docs, context)")

    @classmethod
    def from_host(cls, cu_seqlens: Tensor | Sequence[int], device: torch.device | str) -> "DocumentBounds":
        """From host boundaries (a CPU tensor or ints): one pinned, non-blocking upload on CUDA."""
        if isinstance(cu_seqlens, Tensor):
            _check_tensor(cu_seqlens, "DocumentBounds.from_host")
            if cu_seqlens.device.type != "cpu":
                raise ValueError(f"DocumentBounds.from_host: cu_seqlens is on {cu_seqlens.device}, not the host; "
                                 "use DocumentBounds.of for a tensor already on the device")
            cu_seqlens = cu_seqlens.tolist()
        host = _host_ints(cu_seqlens, "DocumentBounds.from_host")
        return cls(upload(torch.tensor(host, dtype=torch.int32), torch.device(device)), host)

    @classmethod
    def of(cls, cu_seqlens: Tensor) -> "DocumentBounds":
        """From boundaries already on the device, with one host read (which on CUDA waits for the
        queued GPU work): for tests, evaluation and direct op calls. Keeps an int32 copy, so later
        in-place changes to ``cu_seqlens`` cannot make device and host disagree."""
        _check_tensor(cu_seqlens, "DocumentBounds.of")
        on_device = cu_seqlens.detach().to(torch.int32, copy=True)
        return cls(on_device, _host_ints(on_device.tolist(), "DocumentBounds.of"))

    @property
    def num_docs(self) -> int:
        return len(self.host) - 1

    @property
    def total(self) -> int:
        """Tokens in the row (the last boundary)."""
        return self.host[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.host, self.host[1:]))

    @property
    def max_len(self) -> int:
        """Tokens in the longest document."""
        return max(self.lengths)

    @functools.cached_property
    def attention_mask(self) -> DocumentMask:
        """The batch's document-causal attention mask (:func:`moe_lc.ops.attention.document_mask`), built
        on first use and then shared by every attention layer of the forward and backward; with a
        shard, the mask of this rank's queries (its chunks) against the whole row's keys."""
        queries = None if self.shard is None else self.shard.context.ranges
        return document_mask(self.total, cu_seqlens=self.cu_seqlens, seq_bounds=self.host,
                             device=self.cu_seqlens.device, query_ranges=queries)


def as_document_bounds(docs: DocumentBounds | Tensor | None) -> DocumentBounds | None:
    """An op's ``docs`` argument as :class:`DocumentBounds`: as given, None (one sequence per row),
    or a plain ``cu_seqlens`` tensor read once (:meth:`DocumentBounds.of`)."""
    if docs is None or isinstance(docs, DocumentBounds):
        return docs
    if isinstance(docs, Tensor):
        return DocumentBounds.of(docs)
    raise TypeError(f"docs must be DocumentBounds, a cu_seqlens tensor or None, got {type(docs).__name__}")


def _check_tensor(cu_seqlens: object, where: str) -> None:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{where}: cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    dtype = cu_seqlens.dtype
    if cu_seqlens.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{where}: cu_seqlens must be a 1-D integer tensor [N+1], got {dtype} "
                         f"shape {tuple(cu_seqlens.shape)}")


def _host_ints(bounds: Sequence[int], where: str) -> tuple[int, ...]:
    """``bounds`` as a tuple of ints, checked: starts at 0, at least one document, strictly increasing."""
    try:
        host = tuple(operator.index(b) for b in bounds)
    except TypeError:
        raise TypeError(f"{where}: document boundaries must be integers, got {_preview(list(bounds))}") from None
    if len(host) < 2 or host[0] != 0:
        raise ValueError(f"{where}: cu_seqlens must start at 0 and hold at least one document, got {_preview(host)}")
    if any(b <= a for a, b in zip(host, host[1:])):
        raise ValueError(f"{where}: cu_seqlens must be strictly increasing (no empty documents), got {_preview(host)}")
    return host


def _preview(bounds: Sequence[int]) -> str:
    bounds = list(bounds)
    return str(bounds) if len(bounds) <= 8 else f"[{', '.join(map(str, bounds[:4]))}, ..., {bounds[-1]}]"
