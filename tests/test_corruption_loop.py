"""Random damage to checkpoints is always caught: ten times, one byte of a random file of the
newest checkpoint is flipped (seeded); the damage is detected, the launch falls back to the
previous checkpoint and keeps the damaged one aside, and a real resume from there logs the
losses of the uninterrupted run bitwise. With every checkpoint damaged the trainer refuses,
listing each one, and the run dir is left exactly as it was (file list and contents)."""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest

from moe_lc.checkpoint import CheckpointManager
from moe_lc.report import load_run
from moe_lc.train.main import run_train_cli
from moe_lc.train.recipes import compose_recipe
from moe_lc.train.resume import find_start

STEPS = 5
FAST = [
    "curriculum.run=[ctx256]",
    f"curriculum.stages.ctx256.steps={STEPS}",
    "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2",
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "checkpoint.every=1",
    "checkpoint.keep_last=10",
    "logging.progress=none",
    "logging.tensorboard=false",
    "report.at_end=false",
    "threads=1",
]
ITERATIONS = 10

pytestmark = [
    pytest.mark.usefixtures("shared_corpus_cache"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # DCP's single-process note, the skipped pointer
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_train_cli([*FAST, f"run_dir={run_dir}"]) == 0
    losses = {r["step"]: r["loss"] for r in load_run(run_dir).steps}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return run_dir, losses


def _flip_a_byte(ckpt: Path, rng: random.Random) -> tuple[Path, bytes]:
    """Flip one random byte of one random file of `ckpt`; returns the file and its new bytes."""
    victim = rng.choice(sorted(p for p in ckpt.rglob("*") if p.is_file()))
    data = bytearray(victim.read_bytes())
    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    victim.write_bytes(bytes(data))
    return victim, bytes(data)


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {p.relative_to(run_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.timeout(120)
def test_random_damage_is_caught_and_the_run_resumes_exactly(reference, tmp_path):
    ref_dir, ref_losses = reference
    rng = random.Random(20240611)
    newest, previous = f"step_{STEPS:08d}", f"step_{STEPS - 1:08d}"
    damaged_files = []
    for i in range(ITERATIONS):
        run_dir = tmp_path / f"iteration_{i}"
        root = run_dir / "checkpoints"
        for name in (previous, newest, "latest"):
            copy = shutil.copytree if name != "latest" else shutil.copy
            copy(ref_dir / "checkpoints" / name, root / name)
        victim, damaged = _flip_a_byte(root / newest, rng)
        rel = victim.relative_to(root / newest)
        damaged_files.append(rel.as_posix())

        start = find_start(compose_recipe("smoke", [*FAST, f"run_dir={run_dir}"]), CheckpointManager(root))
        assert start.resume == root / previous and start.position.step == STEPS - 1, (i, rel)
        assert f"checkpoint {newest} rejected" in start.warning and str(rel.name) in start.warning, start.warning
        (aside,) = (root / "set-aside").iterdir()  # kept for inspection, byte for byte
        assert (aside / newest / rel).read_bytes() == damaged and not (root / newest).exists()
    assert len(set(damaged_files)) >= 3, damaged_files  # the seed reached several kinds of file

    # A real launch: damaged newest checkpoint and a `latest` of garbage bytes; resume=auto
    run_dir = tmp_path / "resumed"
    shutil.copytree(ref_dir, run_dir)
    _flip_a_byte(run_dir / "checkpoints" / newest, rng)
    (run_dir / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    assert run_train_cli([*FAST, f"run_dir={run_dir}"]) == 0
    run = load_run(run_dir)
    assert {r["step"]: r["loss"] for r in run.steps} == ref_losses  # bitwise: the run as if never damaged
    assert [r["step"] for r in run.redone] == [STEPS] and len(run.launches) == 2  # the redone step, kept
    log = (run_dir / "train.log").read_text()
    assert f"checkpoint {newest} rejected" in log and f"resuming at step {STEPS - 1}" in log


@pytest.mark.timeout(60)
def test_with_every_checkpoint_damaged_the_trainer_refuses_and_changes_nothing(reference, tmp_path, capsys):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    rng = random.Random(7)
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    for name in names:
        _flip_a_byte(run_dir / "checkpoints" / name, rng)
    before = _snapshot(run_dir)
    assert run_train_cli([*FAST, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: no valid checkpoint in {run_dir / 'checkpoints'}")
    assert all(f"{name}: " in err for name in names), err
    assert "resume=PATH" in err and "run_dir=" in err and "resume=fresh" in err
    assert _snapshot(run_dir) == before
