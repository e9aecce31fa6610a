"""Launch choices of a kernel family as ``"key=value,..."`` text: what an environment variable
(``MOE_LC_KDA_TUNING``, ``MOE_LC_SHORT_CONV_TUNING``) or a benchmark's ``--tuning`` gives, so that a
choice can be tried in a whole training step without editing the defaults."""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, MutableMapping, Optional, Sequence


def parse_launch_choices(text: str, known: Mapping[str, object], family: str,
                         text_choices: Optional[Mapping[str, Sequence[str]]] = None) -> dict:
    """``"key=value,..."`` as entries of ``known`` (integers, or one of ``text_choices[key]`` for the
    keys listed there); an unknown key or a malformed item is an error that lists the keys."""
    text_choices = text_choices or {}
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"{family} tuning item {item!r}: expected key=value with key one of {sorted(known)}")
        if key in text_choices:
            if value not in text_choices[key]:
                raise ValueError(f"{family} tuning item {item!r}: {key} is one of {tuple(text_choices[key])}")
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"{family} tuning item {item!r}: {key} takes an integer") from None
    return out


@contextlib.contextmanager
def launch_choices(table: MutableMapping[str, object], overrides: Mapping[str, object]) -> Iterator[None]:
    """Inside, ``table`` (a kernel family's ``TUNING``) with ``overrides`` applied; afterwards exactly what it
    was, whatever the block raised: a benchmark's variants must not leak into the next one."""
    saved = dict(table)
    table.update(overrides)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)
