"""Packing documents into fixed-length training sequences, blended across weighted sources.

The map from a global sequence index i (0, 1, 2, ... forever) to a training sample is a pure
function of (sources, seq_len, seed), so the data position a trainer checkpoints is just i,
whatever the parallel layout (data-parallel rank r of D reads its share of each global batch
by index).

    i --blend--> (source s, j)                  deterministic interleave, fraction of s -> w_s
    j --epochs--> (epoch e, window w)           e = j // W_s, w = shuffle_e(j % W_s)
    window w    = tokens [w T, (w+1) T) of epoch e's stream of source s,
    stream      = the source's documents (each ending in EOD) concatenated in a shuffled order.

Every token of a source is an input exactly once per epoch of that source; documents may
straddle two windows (Megatron style). Labels are the next token of the stream, except where
there is none to learn: after an EOD input (the next document is unrelated), at the end of
the stream, and on padding (the last window of an epoch is padded to seq_len), all -100.
`cu_seqlens` cuts after every EOD (a document = its tokens + its EOD), at the end of the real
tokens, and at seq_len, so KDA state and MLA attention reset exactly at document starts.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from moe_lc.data import _megatron
from moe_lc.data.prepare import bin_path, read_meta, require_indexed

IGNORE_INDEX = -100  # == moe_lc.model.transformer.IGNORE_INDEX
MAX_BLEND_PERIOD = 1 << 16  # weights are realised exactly if they are multiples of 1/P for some P <= this


@dataclass(frozen=True)
class DataSource:
    """A `.bin`/`.idx` prefix and its blending weight (weights are relative; they need not sum to 1)."""

    prefix: str
    weight: float = 1.0


@dataclass
class Sample:
    """One packed training sequence of length seq_len."""

    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX where there is no target
    cu_seqlens: torch.Tensor  # [n+1] int32, 0 = cu[0] < ... < cu[n] = T
    source: int = 0  # index of the DataSource it came from


@dataclass
class Batch:
    """Samples packed into one flat row, as the model takes them (B == 1 with cu_seqlens)."""

    input_ids: torch.Tensor  # [1, B*T] int64
    labels: torch.Tensor  # [1, B*T] int64
    cu_seqlens: torch.Tensor  # [N+1] int32, documents also cut at sample boundaries
    num_label_tokens: int  # positions with a target (the loss normaliser)


class Location(NamedTuple):
    """Where global sequence i comes from."""

    source: int
    epoch: int  # epoch of that source
    window: int  # position of the window in that epoch's token stream


# ---------------------------------------------------------------------------------------------
# Blending


def blend_quotas(weights: Sequence[float]) -> np.ndarray:
    """Integer quotas q_s with q_s / sum(q) = w_s / sum(w): exact when the weights are multiples of
    1/P for a period P <= MAX_BLEND_PERIOD (e.g. 0.7/0.3 -> 7/3), else largest-remainder at P = 2**16."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("the data mixture is empty: give at least one DataSource")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"data source weights must be finite and > 0, got {list(weights)}; drop a source instead of weighting it 0")
    w = w / w.sum()
    periods = np.arange(1, MAX_BLEND_PERIOD + 1, dtype=np.float64)[:, None]
    scaled = periods * w[None, :]
    exact = np.all(np.abs(scaled - np.round(scaled)) < 1e-9 * periods, axis=1) & np.all(np.round(scaled) >= 1, axis=1)
    if exact.any():
        return np.round(scaled[int(np.argmax(exact))]).astype(np.int64)
    ideal = w * MAX_BLEND_PERIOD
    q = np.floor(ideal).astype(np.int64)
    q[np.argsort(-(ideal - q), kind="stable")[: MAX_BLEND_PERIOD - int(q.sum())]] += 1
    if np.any(q == 0):
        raise ValueError(f"data source weight too small: each weight must be >= 1/{MAX_BLEND_PERIOD} of the total, got {list(weights)}")
    return q


class BlendSchedule:
    """Deterministic interleave of sources: seat k of source s (its k-th sequence) is due at time
    (k + 1/2) / q_s; sequences are served in order of due time (ties: lower source index first).

    This is the Sainte-Laguë/Webster order: after n sequences every source has within one
    sequence of its share n q_s / P, and the order repeats with period P = sum(q), so locating
    sequence i costs O(1).
    """

    def __init__(self, weights: Sequence[float]):
        self.quotas = blend_quotas(weights)
        self.period = int(self.quotas.sum())
        source = np.repeat(np.arange(len(self.quotas)), self.quotas)
        rank = np.concatenate([np.arange(q) for q in self.quotas])
        due = (2 * rank + 1) / (2 * self.quotas[source])  # equal rationals give equal floats
        order = np.lexsort((source, due))
        self._source = source[order]
        self._rank = rank[order]

    def locate(self, i: int) -> tuple[int, int]:
        """(source s, j): global sequence i is the j-th sequence drawn from source s."""
        cycle, r = divmod(int(i), self.period)
        s = int(self._source[r])
        return s, cycle * int(self.quotas[s]) + int(self._rank[r])


# ---------------------------------------------------------------------------------------------
# One source: its documents, shuffled per epoch and cut into windows


class _SourceStream:
    """Windows of seq_len tokens over one source's documents, reshuffled every epoch."""

    def __init__(self, prefix: str, index: int, seq_len: int, seed: int):
        require_indexed(prefix)
        if bin_path(prefix).stat().st_size == 0:  # (megatron-core cannot memory-map an empty file)
            raise ValueError(f"data source {prefix!r} holds no tokens; re-run `moe-lc prepare-data` on non-empty inputs")
        self.prefix, self.index, self.seq_len, self.seed = prefix, index, seq_len, seed
        self.dataset = _megatron.open_indexed(prefix)
        self.doc_lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.num_tokens = int(self.doc_lengths.sum())
        if self.num_tokens == 0:
            raise ValueError(f"data source {prefix!r} holds no tokens; re-run `moe-lc prepare-data` on non-empty inputs")
        self.windows_per_epoch = math.ceil(self.num_tokens / seq_len)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, start offset of each document in the stream (+ total), window order)."""
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, self.index, epoch])
            doc_order = rng.permutation(len(self.doc_lengths))
            offsets = np.zeros(len(doc_order) + 1, dtype=np.int64)
            np.cumsum(self.doc_lengths[doc_order], out=offsets[1:])
            window_order = rng.permutation(self.windows_per_epoch)
            self._epochs[epoch] = (doc_order, offsets, window_order)
            while len(self._epochs) > 2:  # neighbouring epochs are enough for sequential and DP access
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def locate(self, j: int) -> tuple[int, int]:
        epoch, k = divmod(j, self.windows_per_epoch)
        return epoch, int(self.epoch_layout(epoch)[2][k])

    def read(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the epoch's stream (clipped to its end)."""
        doc_order, offsets, _ = self.epoch_layout(epoch)
        stop = min(stop, self.num_tokens)
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop, side="left"))
        pieces = []
        for k in range(first, last):
            lo = max(start, int(offsets[k])) - int(offsets[k])
            hi = min(stop, int(offsets[k + 1])) - int(offsets[k])
            if hi > lo:
                pieces.append(self.dataset.get(int(doc_order[k]), offset=lo, length=hi - lo))
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# The dataset


class PackedDataset:
    """Global sequence index -> Sample, deterministic in (sources, seq_len, seed); never ends.

    eod_id defaults to the one recorded in the sources' `.meta.json`; pad_id (the filler of an
    epoch's last, partial window; never a target) defaults to eod_id.
    """

    def __init__(
        self,
        sources: Sequence[Union[DataSource, str]],
        seq_len: int,
        seed: int = 0,
        eod_id: Optional[int] = None,
        pad_id: Optional[int] = None,
    ):
        if isinstance(sources, (str, DataSource)):
            sources = [sources]
        self.sources = [s if isinstance(s, DataSource) else DataSource(str(s)) for s in sources]
        if not self.sources:
            raise ValueError("the data mixture is empty: give at least one DataSource(prefix, weight)")
        if not isinstance(seq_len, (int, np.integer)) or seq_len <= 1:
            raise ValueError(f"seq_len must be an integer > 1 (an input and its next-token label), got {seq_len!r}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.schedule = BlendSchedule([s.weight for s in self.sources])
        self.eod_id = self._agree_on_eod(eod_id)
        self.pad_id = self.eod_id if pad_id is None else int(pad_id)
        self._streams = [_SourceStream(str(s.prefix), k, self.seq_len, self.seed) for k, s in enumerate(self.sources)]

    def _agree_on_eod(self, eod_id: Optional[int]) -> int:
        for src in self.sources:
            require_indexed(src.prefix)
            meta = read_meta(src.prefix)
            recorded = None if meta is None else meta.get("eod_id")
            if recorded is None:
                continue
            if eod_id is None:
                eod_id = int(recorded)
            elif int(recorded) != int(eod_id):
                raise ValueError(
                    f"tokenizer mismatch: {src.prefix} was prepared with eod_id={recorded} but eod_id={eod_id} is in use "
                    "(another source or the tokenizer); prepare every source with the same tokenizer"
                )
        if eod_id is None:
            raise ValueError("eod_id is unknown: the sources have no .meta.json (made outside moe-lc); pass eod_id=...")
        return int(eod_id)

    @property
    def sequences_per_epoch(self) -> list[int]:
        """Windows in one epoch of each source."""
        return [s.windows_per_epoch for s in self._streams]

    def locate(self, i: int) -> Location:
        if i < 0:
            raise IndexError(f"sequence index must be >= 0, got {i}")
        s, j = self.schedule.locate(i)
        epoch, window = self._streams[s].locate(j)
        return Location(s, epoch, window)

    def __getitem__(self, i: int) -> Sample:
        s, epoch, window = self.locate(int(i))
        T = self.seq_len
        stream = self._streams[s]
        start = window * T
        tokens = stream.read(epoch, start, start + T + 1)  # one extra: the last position's label
        n_real = min(T, len(tokens))

        input_ids = np.full(T, self.pad_id, dtype=np.int64)
        input_ids[:n_real] = tokens[:n_real]
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        labels[: len(tokens) - 1] = tokens[1:]
        is_eod = tokens[:n_real] == self.eod_id
        labels[:n_real][is_eod] = IGNORE_INDEX  # the next document is not predictable from this one

        cuts = np.concatenate([[0], np.flatnonzero(is_eod) + 1, [n_real, T]])
        cu_seqlens = np.unique(cuts).astype(np.int32)
        return Sample(torch.from_numpy(input_ids), torch.from_numpy(labels), torch.from_numpy(cu_seqlens), s)

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.prefix}(w={s.weight:g}, {n} seq/epoch)" for s, n in zip(self.sources, self.sequences_per_epoch))
        return f"PackedDataset(seq_len={self.seq_len}, seed={self.seed}, sources=[{parts}])"


def collate(samples: Sequence[Sample]) -> Batch:
    """Concatenate samples into one packed row; each sample's cu_seqlens shifted by its offset."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    input_ids = torch.cat([s.input_ids for s in samples]).unsqueeze(0)
    labels = torch.cat([s.labels for s in samples]).unsqueeze(0)
    cu, offset = [samples[0].cu_seqlens[:1]], 0
    for s in samples:
        cu.append(s.cu_seqlens[1:] + offset)
        offset += int(s.input_ids.numel())
    cu_seqlens = torch.cat(cu).to(torch.int32)
    return Batch(input_ids, labels, cu_seqlens, int((labels != IGNORE_INDEX).sum()))
