"""Launch choices of a kernel family as ``"key=value,..."`` text: what an environment variable
(``MOE_LC_KDA_TUNING``, ``MOE_LC_SHORT_CONV_TUNING``) or a benchmark's ``--tuning`` gives, so that a
choice can be tried in a whole training step without editing the defaults."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence


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
