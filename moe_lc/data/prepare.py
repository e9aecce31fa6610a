"""Text / JSONL files -> Megatron indexed data (`<prefix>.bin` + `<prefix>.idx` + `<prefix>.meta.json`).

Layout (what megatron-core's IndexedDataset reads): one sequence per document, each being the
document's tokens followed by the tokenizer's EOD id. `<prefix>.meta.json` records the
tokenizer (name, vocab size, EOD/PAD ids) so that a model/tokenizer mismatch is caught before
training (`check_vocab`). Files are written under temporary names and renamed into place, the
`.idx` last, so a reader never sees a half-written dataset.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from moe_lc.data import _megatron
from moe_lc.data.tokenizer import ByteTokenizer, Tokenizer, describe_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

META_VERSION = 1
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class PrepareStats:
    """What `prepare_data` wrote."""

    prefix: str
    documents: int = 0
    tokens: int = 0  # EOD tokens included
    files: int = 0
    skipped_empty: int = 0
    tokenizer: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"wrote {self.documents:,} documents, {self.tokens:,} tokens (EOD included) from "
            f"{self.files:,} files to {self.prefix} (.bin/.idx) with tokenizer {self.tokenizer.get('tokenizer')} "
            f"(vocab {self.tokenizer.get('vocab_size')})"
            + (f"; skipped {self.skipped_empty:,} empty documents" if self.skipped_empty else "")
        )


# ---------------------------------------------------------------------------------------------
# Paths, existence and metadata


def bin_path(prefix: Union[str, Path]) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: Union[str, Path]) -> Path:
    return Path(f"{prefix}.idx")


def meta_path(prefix: Union[str, Path]) -> Path:
    return Path(f"{prefix}.meta.json")


def require_indexed(prefix: Union[str, Path]) -> None:
    """Raise a FileNotFoundError naming the missing `.bin`/`.idx` and how to create them."""
    missing = [str(p) for p in (bin_path(prefix), idx_path(prefix)) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"data source {str(prefix)!r}: missing {' and '.join(missing)}. Create it with "
            f"`moe-lc prepare-data FILES... --output-prefix {prefix}` (text or JSONL inputs), "
            "or point the data mixture at an existing .bin/.idx prefix."
        )


def read_meta(prefix: Union[str, Path]) -> Optional[dict]:
    """The `<prefix>.meta.json` written by prepare_data, or None for foreign Megatron data."""
    path = meta_path(prefix)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it and re-run `moe-lc prepare-data`") from err


def check_vocab(prefix: Union[str, Path], model_vocab_size: int, tokenizer: Optional[Tokenizer] = None) -> dict:
    """Fail early if the data's token ids do not fit the model, or were made by another tokenizer.

    Uses `<prefix>.meta.json` when present; for Megatron data made elsewhere (no meta), the
    largest token id in the `.bin` is checked instead. Returns the meta (or a minimal one).
    """
    require_indexed(prefix)
    meta = read_meta(prefix)
    if meta is None:
        ds = _megatron.open_indexed(str(prefix))
        tokens = np.memmap(bin_path(prefix), dtype=ds.index.dtype, mode="r")
        max_id = int(tokens.max()) if tokens.size else -1
        if max_id >= model_vocab_size:
            raise ValueError(
                f"data {prefix} contains token id {max_id} but the model's vocab_size is {model_vocab_size}: "
                "use a model whose vocab_size covers the tokenizer, or re-tokenize the data with "
                "`moe-lc prepare-data --tokenizer ...` using the model's tokenizer"
            )
        return {"vocab_size": max_id + 1, "tokenizer": "unknown"}
    data_vocab = int(meta["vocab_size"])
    if data_vocab > model_vocab_size:
        raise ValueError(
            f"tokenizer/vocab mismatch: {prefix} was tokenized with {meta.get('tokenizer')} (vocab {data_vocab}) "
            f"but the model's vocab_size is {model_vocab_size}; set the model's vocab_size >= {data_vocab} or "
            "re-run `moe-lc prepare-data --tokenizer ...` with the model's tokenizer"
        )
    if tokenizer is not None:
        mine = describe_tokenizer(tokenizer)
        for key in ("tokenizer", "vocab_size", "eod_id", "tokenizer_sha256"):
            if key in meta and key in mine and meta[key] != mine[key]:
                raise ValueError(
                    f"tokenizer mismatch: {prefix} was prepared with {key}={meta[key]!r} but the tokenizer in use "
                    f"has {key}={mine[key]!r}; re-run `moe-lc prepare-data` with this tokenizer or use the original one"
                )
    return meta


# ---------------------------------------------------------------------------------------------
# Reading documents


def expand_inputs(inputs: Sequence[Union[str, Path]]) -> list[Path]:
    """Input paths with directories replaced by their files (recursive, sorted, hidden skipped)."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no input files given: pass text files, JSONL files or directories")
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise ValueError(f"input directory {path} contains no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input not found: {path}")
    return files


def _is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(_JSONL_SUFFIXES)


def _open_text(path: Path) -> io.TextIOBase:
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")


def iter_documents(files: Iterable[Path], json_key: str = "text") -> Iterator[str]:
    """Document texts: a whole text file each, or one per JSONL line (field `json_key`)."""
    for path in files:
        with _open_text(path) as fh:
            if not _is_jsonl(path):
                yield fh.read()
                continue
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
                if not isinstance(record, dict) or json_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"{path}:{lineno}: no field {json_key!r} (found {keys}); choose the text field with --json-key"
                    )
                text = record[json_key]
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: field {json_key!r} is {type(text).__name__}, expected a string")
                yield text


# ---------------------------------------------------------------------------------------------
# Writing


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text followed by EOD, as int64 arrays."""
    eod = np.array([tokenizer.eod_id], dtype=np.int64)
    if isinstance(tokenizer, ByteTokenizer):  # fast path: the bytes are the ids
        ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    elif hasattr(tokenizer, "encode_batch"):
        ids = [np.asarray(x, dtype=np.int64) for x in tokenizer.encode_batch(texts)]  # type: ignore[attr-defined]
    else:
        ids = [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]
    return [np.concatenate([x, eod]) for x in ids]


def write_indexed(
    output_prefix: Union[str, Path], documents: Iterable[np.ndarray], tokenizer_meta: dict, extra_meta: Optional[dict] = None
) -> tuple[int, int]:
    """Write token documents (each already ending in EOD) as `.bin`/`.idx`/`.meta.json`, atomically.

    Returns (documents, tokens). Nothing appears under `output_prefix` unless all of it does.
    """
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    vocab_size = int(tokenizer_meta["vocab_size"])
    dtype = _megatron.optimal_dtype(vocab_size)
    tmp = prefix.with_name(f"{prefix.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    n_docs = n_tokens = 0
    builder = None
    try:
        builder = _megatron.new_builder(str(bin_path(tmp)), dtype=dtype)
        for doc in documents:
            doc = np.asarray(doc)
            if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
                raise ValueError(f"document {n_docs} has token ids outside [0, {vocab_size})")
            builder.add_item(torch.from_numpy(doc.astype(np.int64, copy=False)))
            builder.end_document()
            n_docs += 1
            n_tokens += int(doc.size)
        builder.finalize(str(idx_path(tmp)))
        meta = {"format": "megatron-indexed", "moe_lc_meta_version": META_VERSION, **tokenizer_meta,
                "dtype": np.dtype(dtype).name, "documents": n_docs, "tokens": n_tokens, **(extra_meta or {})}
        meta_path(tmp).write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(bin_path(tmp), bin_path(prefix))
        os.replace(meta_path(tmp), meta_path(prefix))
        os.replace(idx_path(tmp), idx_path(prefix))  # last: its presence means complete
    finally:
        if builder is not None and not builder.data_file.closed:
            builder.data_file.close()
        for p in (bin_path(tmp), idx_path(tmp), meta_path(tmp)):
            p.unlink(missing_ok=True)
    return n_docs, n_tokens


def prepare_data(
    inputs: Sequence[Union[str, Path]],
    output_prefix: Union[str, Path],
    tokenizer: Union[str, Path, Tokenizer] = "byte",
    json_key: str = "text",
    eod_token: Optional[str] = None,
    batch_documents: int = 1024,
) -> PrepareStats:
    """Tokenize text files (one document each) and JSONL files (one document per line) to `.bin`/`.idx`.

    Empty documents are skipped; an input set with no document at all is an error.
    """
    tok = load_tokenizer(tokenizer, eod_token=eod_token)
    files = expand_inputs(inputs)
    stats = PrepareStats(prefix=str(output_prefix), files=len(files), tokenizer=describe_tokenizer(tok))

    def documents() -> Iterator[np.ndarray]:
        batch: list[str] = []
        for text in iter_documents(files, json_key):
            if not text:
                stats.skipped_empty += 1
                continue
            batch.append(text)
            if len(batch) >= batch_documents:
                yield from encode_documents(tok, batch)
                batch.clear()
        if batch:
            yield from encode_documents(tok, batch)

    docs, tokens = write_indexed(output_prefix, _nonempty(documents(), files), stats.tokenizer)
    stats.documents, stats.tokens = docs, tokens
    log.info(stats.summary())
    return stats


def _nonempty(docs: Iterator[np.ndarray], files: Sequence[Path]) -> Iterator[np.ndarray]:
    """Pass documents through; raise if there were none (before anything is renamed into place)."""
    seen = False
    for d in docs:
        seen = True
        yield d
    if not seen:
        shown = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise ValueError(f"no non-empty documents in the inputs ({shown}); nothing to write")
