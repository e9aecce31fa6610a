"""Python's garbage collector on a step schedule (`gc.every`): off between the scheduled steps, a
full collection after every N-th step with its survivors frozen, the collector and the frozen set
restored on leaving; a training run's losses are the same with it as without."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from moe_lc.train.gc_schedule import StepScheduledCollection
from moe_lc.train.main import run_train_cli


class _Node:
    """A cyclic object: freed only by the collector, never by reference counts alone."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


@pytest.fixture
def collector_on():
    """The collector enabled and nothing frozen before the test, and put back as it was after."""
    was = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_a_cycle_lives_until_the_scheduled_step_then_the_state_is_restored(collector_on):
    with StepScheduledCollection(every=3) as schedule:
        assert not gc.isenabled()
        garbage = _cycle()
        for done in (1, 2):
            for _ in range(2000):  # enough allocations that an automatic collection would have run
                _cycle()
            schedule.after_step(done)
            assert garbage() is not None, f"collected after step {done}, before the schedule's step 3"
        schedule.after_step(3)
        assert garbage() is None and schedule.collections == 1
        assert gc.get_freeze_count() > 0  # the first collection's survivors are frozen
        later = _cycle()
        schedule.after_step(6)
        assert later() is None and schedule.collections == 2
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_leaving_restores_a_collector_that_was_off(collector_on):
    gc.disable()
    with StepScheduledCollection(every=1) as schedule:
        schedule.after_step(1)
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_every_zero_leaves_the_collector_alone(collector_on):
    with StepScheduledCollection(every=0) as schedule:
        assert gc.isenabled()
        for done in range(1, 5):
            schedule.after_step(done)
        assert schedule.collections == 0 and gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_an_error_inside_still_restores_the_collector(collector_on):
    with pytest.raises(RuntimeError, match="step failed"):
        with StepScheduledCollection(every=1) as schedule:
            schedule.after_step(1)
            raise RuntimeError("step failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_negative_interval_is_refused(collector_on):
    with pytest.raises(ValueError, match="every=-1"):
        StepScheduledCollection(every=-1)


TINY = ["model=tiny", "curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=3",
        "curriculum.stages.ctx256.global_batch_tokens=512", "curriculum.stages.ctx256.micro_batch=2",
        "eval.sequences=0", "eval.passkey_documents=0",
        "report.at_end=false", "logging.tensorboard=false", "logging.progress=none", "threads=1"]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_with_the_schedule_gives_the_same_losses(tmp_path, shared_corpus_cache, collector_on):
    assert run_train_cli([*TINY, f"run_dir={tmp_path / 'auto'}"]) == 0
    scheduled = []  # full collections that ran while the automatic collector was off: the schedule's

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and not gc.isenabled():
            scheduled.append(info)

    gc.callbacks.append(watch)
    try:
        assert run_train_cli([*TINY, "gc.every=2", f"run_dir={tmp_path / 'scheduled'}"]) == 0
    finally:
        gc.callbacks.remove(watch)
    assert len(scheduled) == 1  # after step 2 of 3
    assert _losses(tmp_path / "scheduled") == _losses(tmp_path / "auto")
    assert len(_losses(tmp_path / "auto")) == 3
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the run left the collector as it found it


def test_a_negative_interval_in_the_config_is_one_line(tmp_path, capsys, collector_on):
    assert run_train_cli([*TINY, "gc.every=-1", f"run_dir={tmp_path / 'bad'}"]) != 0
    err = capsys.readouterr().err
    assert "gc.every=-1 must be >= 0" in err and "Traceback" not in err
