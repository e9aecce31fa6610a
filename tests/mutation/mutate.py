"""Mutation check: does the fast test suite notice when a formula of the model is wrong?

For every mutant in ``tests/mutation/mutants.py`` (or those named with ``--only``): copy the
repository (the files git tracks plus untracked ones it does not ignore) to a temporary folder,
apply the one edit, run the fast model/ops tests (or the mutant's own ``tests``) there with a
timeout, and report whether some test failed (killed) or all passed (survived). The unmutated copy runs first and must pass.

    python3 tests/mutation/mutate.py                 # all mutants, a table at the end
    python3 tests/mutation/mutate.py --only router-softmax attnres-query-sign
    python3 tests/mutation/mutate.py --check         # only that every snippet is still in the code

Exit status: 0 when every mutant was killed, 1 when one survived, 2 on a snippet out of sync.
Slow (each mutant runs pytest: up to ~1.5 min for a survivor on two cores): not part of the CI
suite; tests/test_mutants.py checks the snippets on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `mutation.mutants`

from mutation.mutants import MUTANTS, Mutant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Reference tests first: they kill most mutants within seconds (pytest -x stops at the first failure).
FAST_TESTS = (
    "tests/test_reference_layers.py",
    "tests/test_reference_model.py",
    "tests/test_model.py",
    "tests/test_kda_projections.py",
    "tests/test_kda_op.py",
    "tests/test_short_conv.py",
    "tests/test_balancing.py",
    "tests/test_data_packing.py",
    "tests/test_accounting.py",
    "tests/test_linear_cross_entropy.py",
    "tests/test_depth_mixture.py",
    "tests/test_grouped_experts.py",
    "tests/test_routing.py",
    "tests/test_situ_glu.py",
    "tests/test_token_permutation.py",
    "tests/test_accumulate.py",
    "tests/test_attention_op.py",
)


class MutantOutOfSync(ValueError):
    """A mutant's snippet is not (exactly once) in its file: the code changed under the list."""


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    killer: str  # the first failing test, "timeout", or "" for a survivor
    seconds: float


def mutated_text(mutant: Mutant, root: Path = ROOT) -> str:
    """The mutant's file with its one edit applied."""
    path = root / mutant.path
    if not path.is_file():
        raise MutantOutOfSync(f"mutant {mutant.name!r}: {mutant.path} does not exist; update tests/mutation/mutants.py")
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        where = "is not in" if count == 0 else f"occurs {count} times in"
        raise MutantOutOfSync(f"mutant {mutant.name!r}: its snippet {where} {mutant.path}; update "
                              f"tests/mutation/mutants.py to the current code: {mutant.original!r}")
    return text.replace(mutant.original, mutant.replacement)


def copy_repository(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files), plus an import shim
    for the two packages that live under other folder names (moe_lc_kernels, moe_lc_recipes)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shim = dest / ".mutation-shim"
    shim.mkdir()
    (shim / "moe_lc_kernels").symlink_to(dest / "kernels")
    (shim / "moe_lc_recipes").symlink_to(dest / "recipes")


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """(passed, first failing test or "timeout") of pytest -x over ``tests`` in the copy."""
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{copy / '.mutation-shim'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timeout"
    if proc.returncode == 0:
        return True, ""
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    return False, failed.group(1) if failed else f"pytest exit {proc.returncode}: {proc.stdout[-300:]}"


@contextlib.contextmanager
def repository_copy():
    with tempfile.TemporaryDirectory(prefix="moe-lc-mutant-") as tmp:
        copy_repository(Path(tmp))
        yield Path(tmp)


def run_mutant(mutant: Mutant, tests: tuple[str, ...], timeout: float) -> Outcome:
    with repository_copy() as copy:
        (copy / mutant.path).write_text(mutated_text(mutant))
        start = time.monotonic()
        passed, killer = run_tests(copy, tests, timeout)
        return Outcome(mutant, not passed, killer, time.monotonic() - start)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | file | what it breaks | result | first failing test |", "|---|---|---|---|---|"]
    for o in outcomes:
        result = "killed" if o.killed else "**survived**"
        lines.append(f"| `{o.mutant.name}` | `{o.mutant.path}` | {o.mutant.breaks} | {result} | "
                     f"{'`' + o.killer + '`' if o.killer else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--check", action="store_true", help="only check that every snippet is in the code")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's test run (default 600)")
    parser.add_argument("--tests", nargs="+", help="test files to run per mutant (default: the mutant's own, "
                                                  "else the fast tests)")
    args = parser.parse_args(argv)

    names = {m.name for m in MUTANTS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        print(f"unknown mutant(s) {unknown}; see tests/mutation/mutants.py", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    try:
        for m in chosen:
            mutated_text(m)
    except MutantOutOfSync as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(chosen)} mutants, every snippet found once")
        return 0

    tests_of = {m.name: tuple(args.tests) if args.tests else (m.tests or FAST_TESTS) for m in chosen}
    every_test = tuple(dict.fromkeys(t for tests in tests_of.values() for t in tests))
    with repository_copy() as copy:
        passed, failure = run_tests(copy, every_test, args.timeout)
    if not passed:
        print(f"the unmutated tests fail ({failure}): fix them before judging mutants", file=sys.stderr)
        return 2
    outcomes = []
    for i, m in enumerate(chosen, 1):
        outcome = run_mutant(m, tests_of[m.name], args.timeout)
        outcomes.append(outcome)
        status = f"killed by {outcome.killer}" if outcome.killed else "SURVIVED"
        print(f"[{i}/{len(chosen)}] {m.name}: {status} ({outcome.seconds:.0f} s)", flush=True)
    print()
    print(table(outcomes))
    survivors = [o.mutant.name for o in outcomes if not o.killed]
    print(f"\n{len(outcomes) - len(survivors)} of {len(outcomes)} killed" + (f"; survived: {survivors}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
