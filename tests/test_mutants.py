"""The mutation check's list stays in sync with the code (cheap; the check itself is slow and runs
by hand: python3 tests/mutation/mutate.py, docs/testing.md)."""

from __future__ import annotations

from mutation.mutants import MUTANTS
from mutation.mutate import mutated_text


def test_every_mutant_snippet_is_in_the_code_once_and_the_mutant_still_compiles():
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), "mutant names must be unique"
    for m in MUTANTS:
        assert m.replacement != m.original, m.name
        compile(mutated_text(m), m.path, "exec")  # a syntax error would be "killed" by any test
