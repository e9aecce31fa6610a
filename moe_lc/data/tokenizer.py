"""Tokenizers: text <-> token ids, plus the two special ids the data pipeline needs.

Every document written to `.bin`/`.idx` ends with `eod_id` (end of document): packing cuts
documents at EOD tokens to build `cu_seqlens`. `pad_id` fills the tail of the last, partial
sequence of an epoch (its labels are always ignored).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; EOD = 256, PAD = 257 (vocab 258, fits the tiny preset).

    Needs no files, so the default corpus and the tests work on any machine.
    """

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod_id(self) -> int:
        return 256

    @property
    def pad_id(self) -> int:
        return 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte tokens; special ids are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eod_id": self.eod_id, "pad_id": self.pad_id}


# Special-token spellings used by common tokenizer files, most specific first.
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<eod>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` package (extra: `moe-lc[hf]`).

    EOD is the first special token found among the usual spellings (`<|endoftext|>`, `</s>`,
    ...) unless `eod_token` names it; PAD likewise, falling back to EOD (padding is never a
    target, so sharing the id is harmless).
    """

    def __init__(self, path: Union[str, Path], eod_token: Optional[str] = None, pad_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:
            raise ImportError(
                "a tokenizer.json needs the Hugging Face `tokenizers` package: pip install 'moe-lc[hf]' "
                "(or use the built-in byte tokenizer: --tokenizer byte)"
            ) from err
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path} (give a tokenizer.json path or 'byte')")
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust side raises a bare Exception
            raise ValueError(f"{self.path} is not a valid Hugging Face tokenizer.json: {err}") from err
        self.name = f"hf:{self.path.name}"
        self._sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self._eod = self._special_id(eod_token, _EOD_NAMES, "eod_token")
        if self._eod is None:
            raise ValueError(
                f"{self.path} has none of the usual end-of-document tokens {list(_EOD_NAMES)}; "
                "name yours with eod_token=... (CLI: --eod-token)"
            )
        pad = self._special_id(pad_token, _PAD_NAMES, "pad_token")
        self._pad = self._eod if pad is None else pad

    def _special_id(self, explicit: Optional[str], candidates: Sequence[str], what: str) -> Optional[int]:
        if explicit is not None:
            tid = self._tok.token_to_id(explicit)
            if tid is None:
                raise ValueError(f"{what}={explicit!r} is not in the vocabulary of {self.path}")
            return tid
        for name in candidates:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod

    @property
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many documents at once (the Rust side runs them in parallel)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def describe(self) -> dict:
        return {
            "tokenizer": self.name,
            "tokenizer_file": str(self.path.resolve()),
            "tokenizer_sha256": self._sha256,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
        }


def load_tokenizer(spec: Union[str, Path, Tokenizer] = "byte", eod_token: Optional[str] = None) -> Tokenizer:
    """`"byte"` -> ByteTokenizer; a path to a tokenizer.json -> HFTokenizer; a tokenizer -> itself."""
    if not isinstance(spec, (str, Path)):
        if not isinstance(spec, Tokenizer):
            raise TypeError(f"expected 'byte', a tokenizer.json path or a Tokenizer, got {type(spec).__name__}")
        return spec
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"unknown tokenizer {str(spec)!r}: give 'byte' or the path of a Hugging Face tokenizer.json"
        )
    return HFTokenizer(path, eod_token=eod_token)


def describe_tokenizer(tok: Tokenizer) -> dict:
    """The tokenizer facts stored in `<prefix>.meta.json` (name, vocab size, special ids)."""
    if hasattr(tok, "describe"):
        return dict(tok.describe())  # type: ignore[attr-defined]
    return {"tokenizer": getattr(tok, "name", type(tok).__name__), "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id, "pad_id": tok.pad_id}


__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "describe_tokenizer"]

