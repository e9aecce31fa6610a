r"""MLA's softmax attention over packed documents in one call, with one dispatch point.

Per head, for tokens i, j of one row,

    o = softmax(q k^T * scale + M) v,      M[i, j] = 0 if j <= i and doc(i) == doc(j), else -inf

where doc(i) is the document token i belongs to. Documents are given by their boundaries in the
FlashAttention ``cu_seqlens`` convention (``[0, end_1, ..., T]``, one packed row, B == 1); without
boundaries, or with one document spanning the row, every row is one document (plain causal
attention). q and k share a head size (MLA: 128 "nope" + 64 shared key
channels = 192), v may be narrower (MLA: 128).

Backends (``backend=``):

* ``"torch"``: the definition, and the CPU default. One ``scaled_dot_product_attention`` call per
  document (a Python loop over host boundaries), or one causal call without documents.
* ``"flex"``: ``torch.nn.attention.flex_attention`` with a block-sparse document-causal mask
  (``create_block_mask`` over per-token document ids, built on the device). Compiled on CUDA, once
  per input shape; on CPU it runs eager and forward only (torch has no CPU backward for it).
* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 over packed sequences),
  where this torch has it: CUDA with compute capability >= 8.0, fp16/bf16, one head size of at most
  256 for q, k and v, so a narrower v is zero-padded (zero columns of v give zero output columns,
  sliced off; exact).
* ``"padded"``: the "torch" loop with every document padded at its end to a length of a few
  buckets (:func:`padded_length`: a multiple of 512 tokens, coarser beyond 16K, at most 1/16
  longer there), so that SDPA's cuDNN kernel on CUDA finds an execution plan built for that length
  before instead of building one (~0.1 s) for every new length. Exact: causality keeps the padding
  out of every real query, and the padded queries' outputs are cut off. Runs wherever SDPA does.
* ``"auto"``: on CUDA the first of :data:`CUDA_ORDER_DOCUMENTS` (with documents) or
  :data:`CUDA_ORDER_NO_DOCUMENTS` (without) that runs here and takes the inputs; ``"torch"`` on CPU.
  "padded" is taken only where the mask knows the boundaries on the host and the documents
  average at least :data:`PADDED_MIN_MEAN_LENGTH` tokens (its launches grow with their count).

Why those orders (H200, bf16, ``benchmarks/bench_attention.py``, docs/performance.md §11): without
documents SDPA runs cuDNN's Hopper kernel, about twice FlashAttention-2's speed. With documents the
per-document SDPA loop is as fast only while the document lengths repeat: cuDNN builds a plan for
every new sequence length (about 0.1 s each), and training packs new lengths into every batch, so
the loop took seconds per call where varlen took 27 ms (T = 64K, 24 documents); padded to a few
lengths it builds each plan once and runs cuDNN's kernel. varlen was 1.2-1.4x faster than flex at
all shapes measured but one (within 3% there). Change the orders when a measurement says otherwise.

The mask depends only on the batch's boundaries, not on the layer, so it is built once per batch
with :func:`document_mask` and handed to every MLA layer (``mask=``); without one, each call builds
its own.

Queries from part of the row (context parallelism: a rank holds two chunks of the row and attends
them against the keys of the whole row): ``document_mask(..., query_ranges=...)`` names the row
positions of the queries, q has only those tokens and k, v the whole row's. The mask is the same
M at the queries' row positions; it cuts the queries into :class:`QueryPieces` (a range's tokens of
one document), each attending to its document's keys up to its last query, which every backend
runs: "torch" one SDPA call per piece, "varlen" the pieces as variable-length sequences (their
keys packed per piece), "flex" a block mask over the queries' row positions.
:func:`keys_of_row` gives a layer the row's key inputs under context parallelism.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc_kernels.transfer import upload

if TYPE_CHECKING:  # documents.py imports this module
    from moe_lc.ops.documents import DocumentBounds

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


# The flex and varlen modules are imported on first use: importing flex_attention imports the
# compiler stack (torch._dynamo, Triton), seconds that every import of the model would pay, and
# importing the model must not need Triton at all.
@functools.cache
def _flex_api() -> Optional[tuple[Callable, Callable]]:
    """(create_block_mask, flex_attention), or None where this torch has no flex attention (< 2.5)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return create_block_mask, flex_attention


@functools.cache
def _varlen_api() -> Optional[Callable]:
    """torch.nn.attention.varlen.varlen_attn, or None where this torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn

__all__ = [
    "BACKENDS",
    "CUDA_ORDER_DOCUMENTS",
    "CUDA_ORDER_NO_DOCUMENTS",
    "DocumentMask",
    "QueryPieces",
    "document_mask",
    "padded_length",
    "padded_lengths",
    "keys_of_row",
    "query_pieces",
    "causal_document_attention",
    "backend_unavailable_reason",
    "inputs_unsupported_reason",
    "resolve_backend",
]

BACKENDS = ("auto", "torch", "padded", "flex", "varlen")
# What "auto" tries on CUDA, fastest first (measured on an H200: the module docstring says why).
CUDA_ORDER_DOCUMENTS = ("padded", "varlen", "flex", "torch")
CUDA_ORDER_NO_DOCUMENTS = ("torch", "varlen", "flex")
# the backends that run the per-document SDPA loop over host boundaries (no device-side mask)
_LOOP_BACKENDS = ("torch", "padded")

_FLEX_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size
# "padded": the smallest length step, and 2^PAD_OCTAVE_STEPS steps per doubling of the length above it
PAD_MIN_STEP = 512
PAD_OCTAVE_STEPS = 4
# "auto" takes "padded" for batches whose documents average at least this many tokens: each
# document is its own SDPA call (and a pad and slice), which shorter documents make launch-bound.
# On an H200 (H = 16, random cuts of the row) it was 1.37-1.40x varlen at means of 2,731 and 4,096
# tokens and 0.44-0.75x at 1,024 (docs/performance.md §11).
PADDED_MIN_MEAN_LENGTH = 2048


def padded_length(n: int) -> int:
    """n rounded up to a multiple of max(PAD_MIN_STEP, 2^(floor(log2 n) - PAD_OCTAVE_STEPS)): 16
    lengths up to 8K tokens, 16 more per doubling above, at most 1/16 above n from 8K on."""
    step = max(PAD_MIN_STEP, 1 << max(n.bit_length() - 1 - PAD_OCTAVE_STEPS, 0))
    return -(-n // step) * step


def padded_lengths(up_to: int) -> list[int]:
    """Every length :func:`padded_length` gives a document of 1 to ``up_to`` tokens, ascending."""
    lengths, n = [], 1
    while n <= up_to:
        lengths.append(padded_length(n))
        n = lengths[-1] + 1
    return lengths


@dataclass(frozen=True)
class QueryPieces:
    """Queries taken from some ranges of the row, cut where a document starts (:func:`query_pieces`).

    Piece i is query rows ``[query_bounds[i], query_bounds[i+1])`` of the call, at row positions
    ending at ``key_ends[i]``; it attends to the row's keys ``[key_starts[i], key_ends[i])`` (its
    document's start up to its last query), causally aligned at the end: the query at row
    position p sees the keys up to p.
    """

    ranges: tuple[tuple[int, int], ...]  # [start, end) of the queries in the row, in query order
    query_bounds: tuple[int, ...]  # 0 = b_0 < ... < b_P = the number of queries
    key_starts: tuple[int, ...]
    key_ends: tuple[int, ...]

    @property
    def num_queries(self) -> int:
        return self.query_bounds[-1]

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.query_bounds, self.query_bounds[1:])]

    @property
    def key_lengths(self) -> list[int]:
        return [e - s for s, e in zip(self.key_starts, self.key_ends)]


def query_pieces(bounds: Sequence[int], ranges: Sequence[tuple[int, int]]) -> QueryPieces:
    """The queries of row positions ``ranges`` cut at the document boundaries ``bounds`` (host ints,
    ``[0, ..., T]``; empty documents allowed), each piece with the span of keys it attends to."""
    seq_len = bounds[-1]
    ranges = tuple((int(a), int(b)) for a, b in ranges)
    if not ranges or any(not 0 <= a < b <= seq_len for a, b in ranges):
        raise ValueError(f"attention: query_ranges must be non-empty [start, end) ranges inside the row of {seq_len} "
                         f"tokens, got {list(ranges)}")
    query_bounds, starts, ends = [0], [], []
    for a, b in ranges:
        cuts = [a, *sorted({x for x in bounds if a < x < b}), b]
        for x, y in zip(cuts, cuts[1:]):
            query_bounds.append(query_bounds[-1] + y - x)
            starts.append(bounds[bisect_right(bounds, x) - 1])  # the start of the document holding x
            ends.append(y)
    return QueryPieces(ranges, tuple(query_bounds), tuple(starts), tuple(ends))


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """One batch's document-causal mask, in the form one backend consumes (:func:`document_mask`).

    ``bounds``: host boundaries when known (None without documents, or when only the device copy
    was given); ``cu_seqlens``: device boundaries (for "varlen": int32, covering all B*T tokens, one
    row per document without documents; with ``queries``: the query pieces' bounds); ``max_len``:
    the longest document ("varlen"; with ``queries``: the longest query piece); ``block_mask``: the
    flex block mask ("flex"). ``queries``: set when the queries are only some ranges of the row;
    "varlen" then packs each piece's keys (``key_index`` into the row, ``cu_seqlens_k``,
    ``max_len_k``). ``seq_len`` is always the row's (the keys') length.
    """

    backend: str
    seq_len: int
    batch: int
    has_documents: bool
    bounds: Optional[tuple[int, ...]] = None
    cu_seqlens: Optional[Tensor] = None
    max_len: Optional[int] = None
    block_mask: Optional["BlockMask"] = None
    queries: Optional[QueryPieces] = None
    key_index: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_len_k: Optional[int] = None

    @property
    def query_len(self) -> int:
        """Query tokens per row: the row's length, or the number of ``queries``."""
        return self.seq_len if self.queries is None else self.queries.num_queries

    @property
    def device(self) -> Optional[torch.device]:
        """Where the mask lives; None for a "torch" or "padded" mask (host boundaries only)."""
        if self.backend in _LOOP_BACKENDS:
            return None
        if self.block_mask is not None:
            return self.block_mask.kv_num_blocks.device
        return None if self.cu_seqlens is None else self.cu_seqlens.device


# ----------------------------------------------------------------------------- what runs where
def backend_unavailable_reason(backend: str, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` with this torch build, or None when it can."""
    device = torch.device(device)
    if backend in _LOOP_BACKENDS:
        return None
    if backend == "flex":
        if _flex_api() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (it needs torch >= 2.5)"
        if device.type not in ("cuda", "cpu"):
            return f"flex attention runs on CUDA and CPU here, not {device.type}"
        return None
    if backend == "varlen":
        if _varlen_api() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (it needs torch >= 2.10)"
        if device.type != "cuda":
            return f"varlen_attn runs FlashAttention kernels on CUDA only, not {device.type}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "varlen_attn needs a GPU of compute capability >= 8.0 (FlashAttention-2)"
        return None
    raise ValueError(f"attention: unknown backend {backend!r}; choose one of {list(BACKENDS)}")


def inputs_unsupported_reason(backend: str, q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why ``backend`` cannot take these q, k, v (dtype, head sizes, gradients), or None."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    if backend == "flex":
        if q.device.type == "cpu":
            return "flex attention has no backward on CPU" if needs_grad else None
        if q.dtype not in _FLEX_CUDA_DTYPES:
            return f"compiled flex attention takes fp16/bf16/fp32, got {q.dtype}"
        if min(qk_dim, v_dim) < 16:
            return f"compiled flex attention needs head sizes >= 16, got qk {qk_dim} and v {v_dim}"
        return None
    if backend == "varlen":
        if q.dtype not in _VARLEN_DTYPES:
            return f"varlen_attn takes fp16/bf16, got {q.dtype}"
        if _varlen_head_dim(qk_dim, v_dim) > _VARLEN_MAX_HEAD_DIM:
            return f"varlen_attn takes head sizes up to {_VARLEN_MAX_HEAD_DIM}, got qk {qk_dim} and v {v_dim}"
        return None
    return None


def _order(device: torch.device, has_documents: bool) -> tuple[str, ...]:
    if device.type != "cuda":
        return ("torch",)
    return CUDA_ORDER_DOCUMENTS if has_documents else CUDA_ORDER_NO_DOCUMENTS


def resolve_backend(backend: str, device: torch.device, has_documents: bool,
                    inputs: Optional[tuple[Tensor, Tensor, Tensor]] = None,
                    mean_document_length: Optional[float] = None) -> str:
    """The backend that runs: "auto" takes the first of its order that runs on ``device`` (and
    takes ``inputs`` when given), "padded" only for documents of ``mean_document_length`` (known on
    the host) >= PADDED_MIN_MEAN_LENGTH; an explicit backend that cannot is an error, not a fallback."""
    if backend not in BACKENDS:
        raise ValueError(f"attention: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    device = torch.device(device)
    candidates = _order(device, has_documents) if backend == "auto" else (backend,)
    if backend == "auto" and (mean_document_length is None or mean_document_length < PADDED_MIN_MEAN_LENGTH):
        candidates = tuple(name for name in candidates if name != "padded")
    for name in candidates:
        reason = backend_unavailable_reason(name, device)
        if reason is None and inputs is not None:
            reason = inputs_unsupported_reason(name, *inputs)
        if reason is None:
            return name
    raise RuntimeError(f'attention: backend "{backend}" unavailable: {reason}; use backend="torch" (or "auto")')


# ----------------------------------------------------------------------------- the mask
def _check_bounds(bounds: Sequence[int], seq_len: int) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or any(
        a > b for a, b in zip(bounds[:-1], bounds[1:])
    ):
        raise ValueError(
            f"attention: document boundaries must rise from 0 to the sequence length {seq_len} "
            f"(FlashAttention cu_seqlens convention), got {list(bounds)[:8]}{' ...' if len(bounds) > 8 else ''}"
        )
    return bounds


def _read_bounds(cu_seqlens: Tensor) -> list[int]:
    """The boundaries read back from the device: on CUDA this waits for all queued GPU work, so
    callers that have the host copy pass it as ``seq_bounds`` instead."""
    return cu_seqlens.tolist()


def _several_documents(cu_seqlens: Optional[Tensor], seq_bounds: Optional[Sequence[int]]) -> bool:
    """Whether the boundaries split the row: one document spanning it is plain causal attention,
    which runs as such (no mask; SDPA's fastest kernel on CUDA). Decided from sizes, not values."""
    if seq_bounds is not None:
        return len(seq_bounds) > 2
    return cu_seqlens is not None and cu_seqlens.numel() > 2


def _mean_length(bounds: Optional[Sequence[int]]) -> Optional[float]:
    """Mean document length from host boundaries; None when they are not on the host."""
    return None if bounds is None else bounds[-1] / (len(bounds) - 1)


def _document_ids(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """[T] index of each token's document, computed on cu_seqlens' device (no host read)."""
    positions = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.long), positions, right=True)


def _document_causal(doc_ids: Tensor) -> Callable:
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    return mask_mod


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, made once per process on first use (compiling is per input shape;
    building the wrapper imports the compiler, seconds that every import of the model would pay)."""
    return torch.compile(fn, dynamic=False)


def _document_causal_at(positions: Tensor, doc_ids: Optional[Tensor]) -> Callable:
    """The mask of queries at row ``positions`` (one per query) against the row's keys."""

    def mask_mod(b, h, q_idx, kv_idx):
        at = positions[q_idx]
        causal = at >= kv_idx
        return causal if doc_ids is None else causal & (doc_ids[at] == doc_ids[kv_idx])

    return mask_mod


def _block_mask(mask_mod: Callable, seq_len: int, device: torch.device, query_len: Optional[int] = None) -> "BlockMask":
    # Eager create_block_mask materialises the T x T mask (GBs at 64K); compiled, it does not.
    create_block_mask = _flex_api()[0]
    build = _compiled(create_block_mask) if device.type == "cuda" else create_block_mask
    return build(mask_mod, None, None, seq_len if query_len is None else query_len, seq_len, device=device)


def document_mask(
    seq_len: int,
    *,
    cu_seqlens: Optional[Tensor] = None,
    seq_bounds: Optional[Sequence[int]] = None,
    batch: int = 1,
    device: Optional[torch.device | str] = None,
    backend: str = "auto",
    query_ranges: Optional[Sequence[tuple[int, int]]] = None,
) -> DocumentMask:
    """The document-causal mask of one batch for ``backend``, to pass to every attention call.

    ``cu_seqlens``: device boundaries; ``seq_bounds``: the same as host ints (saves the "torch" and
    "varlen" masks a device read; "flex" uploads them when no device copy is given). Neither: plain
    causal over ``batch`` rows. ``device`` defaults to cu_seqlens' device, else CPU. "auto" resolves
    by device alone (the inputs are not known yet); a call whose inputs the mask's backend cannot
    take falls back to "torch" under "auto". ``query_ranges``: the row positions [start, end) of the
    queries, in the order q holds them (one packed row; k and v hold the whole row); None: q is the
    whole row.
    """
    if device is None:
        device = cu_seqlens.device if cu_seqlens is not None else torch.device("cpu")
    device = torch.device(device)
    if (cu_seqlens is not None or seq_bounds is not None) and batch != 1:
        raise ValueError(f"attention: packed documents need batch size 1, got {batch}; pack the rows into one "
                         "(reshape to [1, H, B * T, D]) with boundaries for every document")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        raise ValueError(f"attention: cu_seqlens must be 1-D [N+1] document boundaries (0, ..., T), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    bounds = None if seq_bounds is None else _check_bounds(seq_bounds, seq_len)
    has_documents = _several_documents(cu_seqlens, seq_bounds)
    if not has_documents:
        cu_seqlens = bounds = None
    if query_ranges is not None:
        if batch != 1:
            raise ValueError(f"attention: query_ranges are positions in one packed row, got batch size {batch}")
        return _pieces_mask(seq_len, cu_seqlens, bounds, query_ranges, device, backend)
    name = resolve_backend(backend, device, has_documents, mean_document_length=_mean_length(bounds))
    if name in _LOOP_BACKENDS:
        if has_documents and bounds is None:
            bounds = _check_bounds(_read_bounds(cu_seqlens), seq_len)
        return DocumentMask(name, seq_len, batch, has_documents, bounds=bounds, cu_seqlens=cu_seqlens)
    if has_documents and cu_seqlens is None:
        cu_seqlens = upload(torch.tensor(bounds, dtype=torch.int32), device)
    if has_documents:
        cu_seqlens = cu_seqlens.to(device)
    if name == "flex":
        mask_mod = _document_causal(_document_ids(cu_seqlens, seq_len)) if has_documents else _causal
        return DocumentMask("flex", seq_len, batch, has_documents, bounds=bounds, cu_seqlens=cu_seqlens,
                            block_mask=_block_mask(mask_mod, seq_len, device))
    if has_documents:
        if bounds is None:
            bounds = _check_bounds(_read_bounds(cu_seqlens), seq_len)
        cu32, max_len = cu_seqlens.to(torch.int32), max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    else:
        cu32 = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        max_len = seq_len
    return DocumentMask("varlen", seq_len, batch, has_documents, bounds=bounds, cu_seqlens=cu32, max_len=max_len)


def _pieces_mask(seq_len: int, cu_seqlens: Optional[Tensor], bounds: Optional[tuple[int, ...]],
                 query_ranges: Sequence[tuple[int, int]], device: torch.device, backend: str) -> DocumentMask:
    """:func:`document_mask` for queries from ``query_ranges`` of the row (boundaries already checked;
    both None for one document over the row)."""
    has_documents = cu_seqlens is not None or bounds is not None
    if has_documents and bounds is None:
        bounds = _check_bounds(_read_bounds(cu_seqlens), seq_len)
    pieces = query_pieces(bounds if has_documents else (0, seq_len), query_ranges)
    # the documents' order: plain causal SDPA cannot offset queries, and "padded" pads whole documents
    name = resolve_backend(backend, device, True)
    common = dict(has_documents=has_documents, bounds=bounds, queries=pieces)
    if name in _LOOP_BACKENDS:  # query pieces run the loop's pieces path either way
        return DocumentMask(name, seq_len, 1, cu_seqlens=cu_seqlens, **common)
    if name == "flex":
        if has_documents and cu_seqlens is None:
            cu_seqlens = upload(torch.tensor(bounds, dtype=torch.int32), device)
        doc_ids = _document_ids(cu_seqlens.to(device), seq_len) if has_documents else None
        positions = upload(torch.cat([torch.arange(a, b) for a, b in pieces.ranges]), device)
        block_mask = _block_mask(_document_causal_at(positions, doc_ids), seq_len, device, pieces.num_queries)
        return DocumentMask("flex", seq_len, 1, cu_seqlens=cu_seqlens, block_mask=block_mask, **common)
    key_lengths = pieces.key_lengths
    cu_k = torch.tensor([0, *key_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # key row j of piece i is the row's key key_starts[i] + (j - cu_k[i]); built on the device from 2P ints
    shift = upload(torch.tensor(pieces.key_starts) - cu_k[:-1], device)
    key_index = torch.arange(int(cu_k[-1]), device=device) + torch.repeat_interleave(
        shift, upload(torch.tensor(key_lengths), device), output_size=int(cu_k[-1]))
    cu_q = upload(torch.tensor(pieces.query_bounds, dtype=torch.int32), device)
    return DocumentMask("varlen", seq_len, 1, cu_seqlens=cu_q, max_len=max(pieces.lengths), key_index=key_index,
                        cu_seqlens_k=upload(cu_k, device), max_len_k=max(key_lengths), **common)


# ----------------------------------------------------------------------------- the backends
def _torch_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bounds: Optional[tuple[int, ...]],
                     queries: Optional[QueryPieces] = None, padded: bool = False) -> Tensor:
    """The definition: one causal SDPA call per document, or one for the whole row, or one per query
    piece; ``padded``: each document's q, k, v zero-padded at its end to ``padded_length``."""
    v_dim = v.shape[-1]
    if q.device.type == "cpu" and v_dim < q.shape[-1]:
        # CPU SDPA has a fast (flash) kernel only for equal q/k and v head sizes; zero columns
        # of v give zero output columns, so padding and slicing back is exact.
        return _torch_attention(q, k, F.pad(v, (0, q.shape[-1] - v_dim)), scale, bounds, queries,
                                padded)[..., :v_dim]
    if queries is not None:
        return _torch_pieces(q, k, v, scale, queries)
    if bounds is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # split, not one slice per document: its backward writes the gradient pieces into one tensor,
    # where every slice's backward would fill a whole-row tensor of zeros. Split, padded and joined
    # in [B, T, H, D] order: MLA hands q, k, v over as transposed views of that memory, cuDNN takes
    # it as it is and returns its output in q's order, and the buffers autograd makes for the pieces
    # (the split's joined gradient, a cut output's zero-padded gradient) come out in that order too,
    # so nothing is transposed by a copy on the way in or out.
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    rows = [x.transpose(1, 2) for x in (q, k, v)]
    pieces = zip(*(x.split(lengths, 1) for x in rows)) if len(lengths) > 1 else [rows]
    outs = [
        _causal_sdpa(qd, kd, vd, scale, padded_length(qd.shape[1]) if padded else qd.shape[1])
        for qd, kd, vd in pieces
        if qd.shape[1] > 0
    ]
    return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).transpose(1, 2)


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, length: int) -> Tensor:
    """Causal SDPA of one document, q, k, v and the result [B, n, H, D], run at ``length`` >= n: zero
    rows appended to q, k, v come after every real token, so causality hides them from the real
    queries; their outputs are cut."""
    n = q.shape[1]
    if length != n:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, length - n)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale).transpose(1, 2)
    return out if length == n else out[:, :n]


def _torch_pieces(q: Tensor, k: Tensor, v: Tensor, scale: float, queries: QueryPieces) -> Tensor:
    """Each query piece against its keys, the causal mask aligned at the end (its last query sees its
    last key); the reference for queries from part of the row, not a fast path (a bool mask per piece)."""
    outs = []
    for qd, start, end in zip(q.split(queries.lengths, 2), queries.key_starts, queries.key_ends):
        n_q, n_k = qd.shape[2], end - start
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        outs.append(F.scaled_dot_product_attention(qd, k[:, :, start:end], v[:, :, start:end], attn_mask=allowed,
                                                   scale=scale))
    return torch.cat(outs, dim=2)


def _flex(q: Tensor, k: Tensor, v: Tensor, scale: float, block_mask: "BlockMask") -> Tensor:
    flex_attention = _flex_api()[1]
    attend = _compiled(flex_attention) if q.is_cuda else flex_attention
    return attend(q, k, v, block_mask=block_mask, scale=scale)


def _varlen_head_dim(qk_dim: int, v_dim: int) -> int:
    """The one head size varlen_attn runs at: the larger of q/k's and v's, rounded up to 8."""
    return -(-max(qk_dim, v_dim) // 8) * 8


@functools.cache
def _varlen_options() -> tuple[bool, bool]:
    """(takes window_size, takes scale): its first release asked for is_causal and took no scale."""
    params = inspect.signature(_varlen_api()).parameters
    return "window_size" in params, "scale" in params


def _varlen(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: DocumentMask) -> Tensor:
    B, H, T, qk_dim = q.shape
    v_dim = v.shape[-1]
    dim = _varlen_head_dim(qk_dim, v_dim)
    windowed, scaled = _varlen_options()
    if not scaled:  # the kernel's own scale is dim ** -0.5
        q = q * (scale * dim**0.5)

    def packed(x: Tensor) -> Tensor:  # [B, H, T, D] -> [B*T, H, dim]; a view for MLA's layout
        x = x.transpose(1, 2)
        return (F.pad(x, (0, dim - x.shape[-1])) if x.shape[-1] < dim else x).reshape(-1, H, dim)

    keys, values = packed(k), packed(v)
    cu_k, max_k = mask.cu_seqlens, mask.max_len
    if mask.queries is not None:  # each query piece's keys, packed (FlashAttention aligns causality at the end)
        keys, values = keys[mask.key_index], values[mask.key_index]
        cu_k, max_k = mask.cu_seqlens_k, mask.max_len_k
    options = {"window_size": (-1, 0)} if windowed else {"is_causal": True}
    if scaled:
        options["scale"] = scale
    out = _varlen_api()(packed(q), keys, values, mask.cu_seqlens, cu_k, mask.max_len, max_k, **options)
    return out[..., :v_dim].reshape(B, T, H, v_dim).transpose(1, 2)


# ----------------------------------------------------------------------------- the op
def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Optional[DocumentMask]) -> None:
    if q.dim() != 4 or k.dim() != 4 or (k.shape[:2], k.shape[3]) != (q.shape[:2], q.shape[3]):
        raise ValueError(f"attention: q and k must be [B, H, T, Dqk] of one shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if k.shape[2] != q.shape[2] and (mask is None or mask.queries is None):
        raise ValueError(f"attention: q has {q.shape[2]} tokens and k {k.shape[2]}; for queries from part of the row "
                         "pass mask=document_mask(T, ..., query_ranges=...) with their row positions")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: v must be [B, H, T, Dv] = {list(k.shape[:3]) + ['Dv']}, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}; cast them to one")
    if q.shape[2] == 0:
        raise ValueError("attention: sequences must have at least one token (T = 0)")


def _check_mask(mask: DocumentMask, q: Tensor, k: Tensor, backend: str) -> None:
    B, T = k.shape[0], k.shape[2]
    if mask.seq_len != T or mask.batch != B:
        raise ValueError(f"attention: the mask was built for batch {mask.batch} x length {mask.seq_len}, the inputs "
                         f"are {B} x {T}; build it with document_mask({T}, batch={B}, ...)")
    if mask.query_len != q.shape[2]:
        raise ValueError(f"attention: the mask holds {mask.query_len} queries, q has {q.shape[2]}; build it with the "
                         "query_ranges of these queries")
    if mask.device is not None and mask.device != q.device:
        raise ValueError(f"attention: the mask is on {mask.device}, the inputs on {q.device}; build it with "
                         f"device={q.device}")
    if backend not in ("auto", mask.backend):
        raise ValueError(f'attention: the mask was built for backend "{mask.backend}", the call asks for "{backend}"; '
                         f'build it with backend="{backend}" or call with backend="{mask.backend}" (or "auto")')


def causal_document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    cu_seqlens: Optional[Tensor] = None,
    seq_bounds: Optional[Sequence[int]] = None,
    backend: str = "auto",
    mask: Optional[DocumentMask] = None,
) -> Tensor:
    """Causal softmax attention that never crosses a document boundary; differentiable in q, k, v.

    q, k: [B, H, T, Dqk]; v: [B, H, T, Dv]; returns [B, H, T, Dv] in q's dtype. Documents come
    from ``mask`` (:func:`document_mask`, built once per batch) or from ``cu_seqlens`` (device) /
    ``seq_bounds`` (the same as host ints), which need B == 1; none of them: causal over each row.
    A mask with ``query_ranges`` takes q of those row positions only, [1, H, Tq, Dqk], against k, v of
    the whole row, and returns [1, H, Tq, Dv].
    """
    _check_inputs(q, k, v, mask)
    if mask is not None and (cu_seqlens is not None or seq_bounds is not None):
        raise ValueError("attention: pass the documents once, either as mask= or as cu_seqlens=/seq_bounds=")
    if mask is None:
        name = resolve_backend(backend, q.device, _several_documents(cu_seqlens, seq_bounds), inputs=(q, k, v))
        mask = document_mask(q.shape[2], cu_seqlens=cu_seqlens, seq_bounds=seq_bounds, batch=q.shape[0],
                             device=q.device, backend=name)
    _check_mask(mask, q, k, backend)
    name = mask.backend
    reason = inputs_unsupported_reason(name, q, k, v)
    if reason is not None:
        if backend != "auto":
            raise RuntimeError(f'attention: backend "{name}" cannot take these inputs: {reason}; use backend="torch" '
                               '(or "auto")')
        warnings.warn(f'attention: the mask was built for "{name}", which cannot take these inputs ({reason}); '
                      'running the per-document "torch" loop instead', stacklevel=2)
        name = "torch"
    if name == "flex":
        return _flex(q, k, v, scale, mask.block_mask)
    if name == "varlen":
        return _varlen(q, k, v, scale, mask)
    bounds = mask.bounds
    if mask.has_documents and bounds is None and mask.queries is None:
        bounds = _check_bounds(_read_bounds(mask.cu_seqlens), mask.seq_len)
    return _torch_attention(q, k, v, scale, bounds, mask.queries, padded=name == "padded")


# ----------------------------------------------------------------------------- the keys of the row
class PendingKeys(Protocol):
    """What :func:`keys_of_row` returns: ``wait()`` gives the row's key inputs."""

    def wait(self) -> list[Tensor]: ...


@dataclass(frozen=True)
class _Ready:
    parts: list[Tensor]

    def wait(self) -> list[Tensor]:
        return self.parts


def keys_of_row(parts: Sequence[Tensor], docs: Optional["DocumentBounds"]) -> PendingKeys:
    """The per-token tensors [B, T, width] that keys and values are made of (MLA: the normalised kv
    latent and the shared key), for every token of the row; ``.wait()`` returns them.

    Without a context-parallel shard on ``docs``, ``parts`` themselves. With one (``docs.shard``),
    every rank's, in sequence order, [1, row length, width] each: one all-gather over the cp
    group (:func:`moe_lc.parallel.context_mla.gather_row`), started here so that the caller
    computes meanwhile (MLA: its queries) and waited for by ``.wait()``.
    """
    if docs is None or docs.shard is None:
        return _Ready(list(parts))
    # imported here: moe_lc.parallel imports the model, which imports this op
    from moe_lc.parallel.context_mla import gather_row

    return gather_row(parts, docs.shard)
