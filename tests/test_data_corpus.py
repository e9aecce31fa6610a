"""The default corpus: the stdlib's source, built once into the cache, reused, safe under concurrency."""

from __future__ import annotations

import os
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from moe_lc.data import corpus
from moe_lc.data.corpus import DEFAULT_MAX_BYTES, default_corpus, stdlib_source_files


def megatron_dataset(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix), mmap=True)


def eligible_stdlib_files() -> list[str]:
    """Independent listing: every stdlib .py outside test and site-packages dirs, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        if {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(rel):
            dirnames[:] = []
            continue
        out += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def test_default_corpus_is_the_stdlib_text_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LC_CACHE", str(tmp_path / "cache"))
    prefix = default_corpus()
    assert Path(prefix).parent == tmp_path / "cache" / "corpus"

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    names = [p.relative_to(root).as_posix() for p in files]
    assert names == eligible_stdlib_files()[: len(names)]  # a sorted prefix of the eligible files
    assert sum(p.stat().st_size for p in files) <= DEFAULT_MAX_BYTES and len(files) > 100

    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    expected = [t.encode("utf-8") for t in texts if t]
    ds = megatron_dataset(prefix)
    assert len(ds) == len(expected)
    for i, doc in enumerate(expected):
        got = ds[i]
        assert got[-1] == 256 and got[:-1].astype(np.uint8).tobytes() == doc, f"document {i} differs"

    # Second call: served from the cache, nothing rebuilt or rewritten.
    stamps = {p: p.stat().st_mtime_ns for p in Path(prefix).parent.iterdir()}
    monkeypatch.setattr(corpus, "_build", lambda *a: pytest.fail("the cached corpus was rebuilt"))
    assert default_corpus() == prefix
    assert {p: p.stat().st_mtime_ns for p in Path(prefix).parent.iterdir()} == stamps
    # Where the cache lives: an explicit cache_dir, else $MOE_LC_CACHE, else ~/.cache/moe_lc.
    assert corpus.cache_root(tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert corpus.cache_root() == tmp_path / "cache"
    monkeypatch.delenv("MOE_LC_CACHE")
    assert corpus.cache_root() == Path.home() / ".cache" / "moe_lc"


def test_concurrent_first_use_builds_once(tmp_path):
    real_build, calls = corpus._build, []

    def slow_build(prefix, files):
        calls.append(prefix)
        time.sleep(0.3)  # widen the race window
        real_build(prefix, files[:20])

    results = []
    orig = corpus._build
    corpus._build = slow_build
    try:
        threads = [threading.Thread(target=lambda: results.append(default_corpus(tmp_path))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        corpus._build = orig
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1
    leftovers = [p.name for p in (tmp_path / "corpus").iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    assert len(megatron_dataset(results[0])) == 20 - sum(1 for p in stdlib_source_files()[:20] if p.stat().st_size == 0)
