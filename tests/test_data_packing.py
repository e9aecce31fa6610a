"""Packing and blending: every token once per epoch, labels, cu_seqlens at EODs, determinism, weights."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from moe_lc.data import IGNORE_INDEX, DataSource, PackedDataset, collate, prepare_data
from moe_lc.data.packing import BlendSchedule
from moe_lc.data.prepare import write_indexed
from moe_lc.data.tokenizer import ByteTokenizer

EOD, PAD = 256, 257


def random_documents(rng, n, max_len):
    """Byte documents of very different lengths (some longer than a sequence), as expected token lists."""
    lengths = np.concatenate([rng.integers(1, 12, size=n // 2), rng.integers(1, max_len, size=n - n // 2)])
    rng.shuffle(lengths)
    return [list(rng.integers(0, 256, size=int(k))) + [EOD] for k in lengths]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three sources of different sizes; returns [(prefix, expected documents)]."""
    root = tmp_path_factory.mktemp("packing")
    rng = np.random.default_rng(1234)
    out = []
    for k, (n_docs, max_len) in enumerate([(40, 200), (25, 90), (9, 300)]):
        docs = random_documents(rng, n_docs, max_len)
        prefix = root / f"src{k}"
        write_indexed(prefix, (np.array(d) for d in docs), ByteTokenizer().describe())
        out.append((str(prefix), docs))
    return out


def gather_epochs(ds, num_sources, epochs):
    """{(source, epoch): {window: sample}} over global indices until every source has `epochs` complete epochs."""
    per = {}
    need = [w * epochs for w in ds.sequences_per_epoch]
    seen = [0] * num_sources
    i = 0
    while any(s < n for s, n in zip(seen, need)):
        loc = ds.locate(i)
        if loc.epoch < epochs:
            bucket = per.setdefault((loc.source, loc.epoch), {})
            assert loc.window not in bucket, f"window {loc.window} of source {loc.source} served twice in epoch {loc.epoch}"
            bucket[loc.window] = ds[i]
            seen[loc.source] += 1
        i += 1
    return per


def check_segments(sample, n_real):
    """cu_seqlens cut exactly after every EOD, at the end of the real tokens and at seq_len."""
    ids, cu = sample.input_ids.numpy(), sample.cu_seqlens.numpy()
    T = len(ids)
    assert sample.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) > 0)
    for a, b in zip(cu[:-1], cu[1:]):
        if a >= n_real:  # the padding tail is one segment of its own
            assert a == n_real and b == T
            continue
        segment = ids[a:b]
        assert b <= n_real
        assert not np.any(segment[:-1] == EOD), "a segment spans a document boundary"
        assert segment[-1] == EOD or b == n_real, "a segment ends before its document's EOD"


@pytest.mark.parametrize("seq_len", [37, 64])
def test_every_token_once_per_epoch_labels_and_cu_seqlens(sources, seq_len):
    weights = [3.0, 1.0, 2.0]
    ds = PackedDataset([DataSource(p, w) for (p, _), w in zip(sources, weights)], seq_len=seq_len, seed=7, eod_id=EOD, pad_id=PAD)
    per = gather_epochs(ds, len(sources), epochs=2)
    for s, (_, docs) in enumerate(sources):
        total = sum(len(d) for d in docs)
        assert total % seq_len != 0  # the final window is partial
        n_windows = math.ceil(total / seq_len)
        assert ds.sequences_per_epoch[s] == n_windows
        for epoch in range(2):
            windows = per[(s, epoch)]
            assert sorted(windows) == list(range(n_windows))
            samples = [windows[w] for w in range(n_windows)]
            real = [min(seq_len, total - w * seq_len) for w in range(n_windows)]
            stream = np.concatenate([smp.input_ids.numpy()[:n] for smp, n in zip(samples, real)])
            # Every document exactly once, intact: the stream splits at EODs into a permutation of the docs.
            cuts = np.flatnonzero(stream == EOD) + 1
            got = sorted(tuple(x) for x in np.split(stream, cuts)[:-1])
            assert len(stream) == total and cuts[-1] == total
            assert got == sorted(tuple(d) for d in docs)
            for w, (smp, n) in enumerate(zip(samples, real)):
                assert smp.source == s and smp.input_ids.dtype == torch.int64 and smp.labels.dtype == torch.int64
                ids, labels = smp.input_ids.numpy(), smp.labels.numpy()
                assert np.all(ids[n:] == PAD) and np.all(labels[n:] == IGNORE_INDEX)
                for t in range(n):
                    pos = w * seq_len + t
                    has_target = pos + 1 < total and stream[pos] != EOD
                    assert labels[t] == (stream[pos + 1] if has_target else IGNORE_INDEX), (s, epoch, w, t)
                check_segments(smp, n)
        first = [per[(s, 0)][w].input_ids for w in range(3)]
        again = [per[(s, 1)][w].input_ids for w in range(3)]
        assert any(not torch.equal(a, b) for a, b in zip(first, again)), "epoch 1 repeats epoch 0's order"


def test_deterministic_random_access(sources):
    srcs = [DataSource(p, w) for (p, _), w in zip(sources, [0.5, 0.25, 0.25])]
    a = PackedDataset(srcs, seq_len=50, seed=3, eod_id=EOD)
    b = PackedDataset(srcs, seq_len=50, seed=3)  # eod_id read from the .meta.json
    idx = list(range(0, 400, 7)) + [10_000, 123_457]
    forward = [a[i] for i in idx]
    backward = [b[i] for i in reversed(idx)][::-1]  # order of access must not matter
    for x, y in zip(forward, backward):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.cu_seqlens, y.cu_seqlens) and x.source == y.source
    c = PackedDataset(srcs, seq_len=50, seed=4, eod_id=EOD)
    assert any(not torch.equal(a[i].input_ids, c[i].input_ids) for i in range(20))
    # DataLoader workers get a pickled copy: it must serve the same samples.
    clone = pickle.loads(pickle.dumps(a))
    assert all(torch.equal(clone[i].input_ids, a[i].input_ids) for i in idx[:10])


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0, 2.0, 2.0, 5.0], [1.0, math.sqrt(2.0), math.pi]])
def test_blend_fractions_follow_weights(weights):
    sched = BlendSchedule(weights)
    w = np.asarray(weights) / sum(weights)
    n = 20_000
    chosen = np.array([sched.locate(i)[0] for i in range(n)])
    counts = np.zeros((n + 1, len(w)))
    counts[1:] = np.cumsum(np.eye(len(w))[chosen], axis=0)
    deviation = np.abs(counts - np.arange(n + 1)[:, None] * w[None, :])
    assert deviation.max() <= len(w) / 2 + 1, "some prefix strays from the weights"
    assert np.all(np.abs(counts[-1] / n - w) < 2e-4)
    # The j-th draw from a source is numbered j: per-source indices are 0, 1, 2, ... with no gaps.
    for s in range(len(w)):
        js = [sched.locate(i)[1] for i in np.flatnonzero(chosen == s)]
        assert js == list(range(len(js)))


def test_blend_fractions_in_a_packed_dataset(sources):
    ds = PackedDataset([DataSource(p, w) for (p, _), w in zip(sources, [0.6, 0.3, 0.1])], seq_len=16, seed=0)
    src = np.array([ds[i].source for i in range(1000)])
    assert np.bincount(src, minlength=3).tolist() == [600, 300, 100]  # exact at a multiple of the period (10)


def test_collate_packs_samples_into_one_row(sources):
    ds = PackedDataset([DataSource(sources[0][0])], seq_len=40, seed=1)
    samples = [ds[i] for i in range(4)]
    batch = collate(samples)
    assert batch.input_ids.shape == (1, 160) and batch.labels.shape == (1, 160)
    assert torch.equal(batch.input_ids[0], torch.cat([s.input_ids for s in samples]))
    expected_cu = sorted({int(c) + 40 * k for k, s in enumerate(samples) for c in s.cu_seqlens})
    assert batch.cu_seqlens.tolist() == expected_cu and batch.cu_seqlens.dtype == torch.int32
    assert batch.num_label_tokens == int(sum((s.labels != IGNORE_INDEX).sum() for s in samples))


def test_bad_inputs_raise_clear_errors(sources, tmp_path):
    prefix = sources[0][0]
    with pytest.raises(FileNotFoundError, match=r"nope\.bin and .*nope\.idx.*moe-lc prepare-data"):
        PackedDataset([DataSource(str(tmp_path / "nope"))], seq_len=16)
    with pytest.raises(ValueError, match="seq_len must be an integer > 1"):
        PackedDataset([DataSource(prefix)], seq_len=1)
    with pytest.raises(ValueError, match="weights must be finite and > 0"):
        PackedDataset([DataSource(prefix, 1.0), DataSource(prefix, 0.0)], seq_len=16)
    with pytest.raises(ValueError, match="weights must be finite and > 0"):
        PackedDataset([DataSource(prefix, float("nan"))], seq_len=16)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        PackedDataset([DataSource(prefix)], seq_len=16, seed=-1)
    with pytest.raises(ValueError, match="mixture is empty"):
        PackedDataset([], seq_len=16)
    with pytest.raises(ValueError, match="tokenizer mismatch.*eod_id=256"):
        PackedDataset([DataSource(prefix)], seq_len=16, eod_id=0)
    empty = tmp_path / "empty"
    write_indexed(empty, [], ByteTokenizer().describe())
    with pytest.raises(ValueError, match="holds no tokens"):
        PackedDataset([DataSource(str(empty))], seq_len=16)


def test_packs_real_prepared_text(tmp_path):
    """End to end on prepare_data output: decoded sample text is the files' text."""
    texts = ["alpha beta gamma\n" * 5, "delta epsilon\n" * 9]
    for k, t in enumerate(texts):
        (tmp_path / f"{k}.txt").write_text(t)
    prefix = tmp_path / "d"
    prepare_data(sorted(tmp_path.glob("*.txt")), prefix)
    ds = PackedDataset([str(prefix)], seq_len=500, seed=0)
    sample = ds[0]
    n = int(sample.cu_seqlens[-2])  # real tokens end (then the padding segment)
    docs = ByteTokenizer().decode(sample.input_ids[:n].tolist())
    assert sorted([docs[: len(texts[0])], docs[len(texts[0]):]]) == sorted(texts) or sorted(
        [docs[: len(texts[1])], docs[len(texts[1]):]]) == sorted(texts)
