"""The embedded default corpus: the Python standard library's own source, tokenized on first use.

Every machine that runs moe-lc has it, so the smoke recipe and the tests train on real text
with no download and nothing large committed. Content is deterministic for a given Python
installation: the stdlib's `.py` files (test and site-packages directories excluded) in sorted
order, capped at `max_bytes`, one document per file, byte tokenizer. Built once into the cache
directory (`$MOE_LC_CACHE`, else `~/.cache/moe_lc`) under a name that encodes the Python
version and the file list, so a different Python gets its own corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator, Optional, Union

from moe_lc.data.prepare import encode_documents, idx_path, iter_documents, require_indexed, write_indexed
from moe_lc.data.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 2**20
CORPUS_VERSION = 1  # bump when the recipe below changes
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def cache_root(cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """`cache_dir` if given, else `$MOE_LC_CACHE`, else `~/.cache/moe_lc`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MOE_LC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moe_lc"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """The stdlib `.py` files of the corpus: sorted by relative path, taken until `max_bytes`."""
    root = stdlib_root()
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]  # never walk into site-packages
        candidates += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in candidates:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise RuntimeError(f"no Python source files found under {root}; cannot build the default corpus")
    return chosen


def corpus_name(files: list[Path], max_bytes: int) -> str:
    """Cache name: Python version + recipe version + a digest of the chosen files and their sizes."""
    root = stdlib_root()
    digest = hashlib.sha256(f"{CORPUS_VERSION}:{max_bytes}".encode())
    for p in files:
        digest.update(f"{p.relative_to(root).as_posix()}:{p.stat().st_size}\n".encode())
    v = sys.version_info
    return f"stdlib-py{v.major}.{v.minor}.{v.micro}-byte-v{CORPUS_VERSION}-{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An inter-process lock (flock) so concurrent first users build the corpus once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builders may race, which the atomic renames make harmless
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def default_corpus(cache_dir: Optional[Union[str, Path]] = None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Prefix of the default corpus `.bin`/`.idx`, building it first if the cache lacks it."""
    files = stdlib_source_files(max_bytes)
    directory = cache_root(cache_dir) / "corpus"
    prefix = directory / corpus_name(files, max_bytes)
    if idx_path(prefix).is_file():  # the .idx is renamed into place last
        return str(prefix)
    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(directory / f"{prefix.name}.lock"):
        if not idx_path(prefix).is_file():  # another process may have built it meanwhile
            _build(prefix, files)
    require_indexed(prefix)
    return str(prefix)


def _build(prefix: Path, files: list[Path]) -> None:
    tok = ByteTokenizer()
    nbytes = sum(p.stat().st_size for p in files)
    log.info("building the default corpus: %d stdlib files (%.1f MB) -> %s", len(files), nbytes / 1e6, prefix)
    start = time.perf_counter()
    texts = (t for t in iter_documents(files) if t)
    docs, tokens = write_indexed(
        prefix,
        (doc for text in texts for doc in encode_documents(tok, [text])),
        tok.describe(),
        extra_meta={"corpus": "python-stdlib", "corpus_version": CORPUS_VERSION, "python": sys.version.split()[0],
                    "stdlib_root": str(stdlib_root()), "files": len(files)},
    )
    log.info("default corpus ready: %d documents, %d tokens in %.1fs", docs, tokens, time.perf_counter() - start)
