"""RunLog: messages on the console beside the progress line (every progress mode) and in
train.log, step and eval records in the JSONL files, nothing at all on other ranks; and a run
without the tensorboard package, which says so once and trains."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from moe_lc.metrics import read_jsonl
from moe_lc.report import load_run
from moe_lc.train.main import run_train_cli
from moe_lc.train.recipes import compose_recipe
from moe_lc.train.runlog import TENSORBOARD_MISSING, RunLog

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (.*)$")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _cfg(tmp_path, progress: str, *more: str):
    return compose_recipe("smoke", [f"run_dir={tmp_path}", f"logging.progress={progress}", "logging.every=2",
                                    "logging.tensorboard=false", *more])


def _record(step: int, loss: float) -> dict:
    return {"step": step, "stage": "ctx256", "loss": loss, "tokens_per_s": 1500.0, "lr": 1e-3}


def _write_steps(log: RunLog, steps: range) -> None:
    for step in steps:
        log.step(_record(step, 2.0 / step), eta_s=10.0)
        if step == 2:
            log.message("checkpoint step 2")


def _log_lines(tmp_path) -> list[str]:
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert all(TIMESTAMPED.match(line) for line in lines), lines
    return [TIMESTAMPED.match(line).group(1) for line in lines]


@pytest.mark.parametrize("mode", ["lines", "none", "auto"])
def test_messages_and_plain_progress_lines(tmp_path, mode):
    out = io.StringIO()  # not a terminal: auto means lines
    with RunLog.open(_cfg(tmp_path, mode), 4, out, metrics_after=0) as log:
        log.warning("no valid checkpoint")
        _write_steps(log, range(1, 5))
        log.end_steps()
        log.message("done")
    progress = ["[ctx256] step 2/4 |##########----------| loss 1.0000  1.5K tok/s  ETA 10s",
                "[ctx256] step 4/4 |####################| loss 0.5000  1.5K tok/s  ETA 10s"]
    shown = progress if mode != "none" else []
    assert out.getvalue().splitlines() == ["warning: no valid checkpoint", *shown[:1], "checkpoint step 2",
                                           *shown[1:], "done"]
    assert _log_lines(tmp_path) == ["warning: no valid checkpoint", "checkpoint step 2", "done"]


def test_a_message_clears_the_live_bar_and_the_last_bar_stays(tmp_path):
    tty = Tty()
    with RunLog.open(_cfg(tmp_path, "auto"), 4, tty, metrics_after=0) as log:
        _write_steps(log, range(1, 4))
        log.end_steps()
        log.message("done")
    bar = [f"[ctx256] step {s}/4 |{'#' * (5 * s)}{'-' * (20 - 5 * s)}| loss {2.0 / s:.4f}  1.5K tok/s  ETA 10s"
           for s in (1, 2, 3)]
    width = len(bar[1])
    assert tty.getvalue() == (
        f"\r{bar[0]}\r{bar[1]}"  # the live line, redrawn in place
        + "\r" + " " * width + "\r" + "checkpoint step 2\n"  # cleared for a message of its own
        + f"\r{bar[2]}\n"  # end_steps keeps the last state of the bar
        + "done\n"
    )
    assert _log_lines(tmp_path) == ["checkpoint step 2", "done"]


def test_step_and_eval_records_are_appended_and_read_as_trained(tmp_path):
    cfg = _cfg(tmp_path, "none")
    with RunLog.open(cfg, 4, io.StringIO(), metrics_after=0) as log:
        _write_steps(log, range(1, 5))
        log.eval({"step": 4, "stage": "ctx256", "loss": 1.5})
    first = log.launch
    assert [(r["step"], r["launch"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, first), (2, first),
                                                                                      (3, first), (4, first)]
    assert read_jsonl(tmp_path / "eval.jsonl") == [{"step": 4, "stage": "ctx256", "loss": 1.5, "launch": first}]
    assert json.loads((tmp_path / "config.json").read_text())["run_dir"] == str(tmp_path)
    # resumed from step 2: the redone step 3 is appended; the report reads the run as trained
    with RunLog.open(cfg, 4, io.StringIO(), metrics_after=2) as log:
        log.step(_record(3, 9.0), eta_s=1.0)
    second = log.launch
    assert second != first
    raw = [(r["step"], r["loss"], r["launch"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert raw == [(1, 2.0, first), (2, 1.0, first), (3, 2.0 / 3, first), (4, 0.5, first), (3, 9.0, second)]
    launches = read_jsonl(tmp_path / "launches.jsonl")
    assert [(r["launch"], r["start_step"]) for r in launches] == [(first, 0), (second, 2)]
    run = load_run(tmp_path)
    assert [(r["step"], r["loss"]) for r in run.steps] == [(1, 2.0), (2, 1.0), (3, 9.0)]
    assert sorted(r["step"] for r in run.redone) == [3, 4] and run.evals == [] and run.launches == [first, second]
    # a launch with nothing to train touches no metric file
    (tmp_path / "config.json").unlink()
    with RunLog.open(cfg, 4, io.StringIO(), metrics_after=None) as log:
        log.message("nothing to train")
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 5 and not (tmp_path / "config.json").exists()


def test_other_ranks_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with RunLog.silent() as log:
        log.message("hello")
        log.warning("careful")
        log.step(_record(1, 2.0), eta_s=1.0)
        log.eval({"step": 1, "loss": 1.0})
        log.end_steps()
        log.report()
    assert capsys.readouterr() == ("", "")
    assert list(tmp_path.iterdir()) == []


ONE_STAGE = [
    "curriculum.run=[ctx256]",
    "curriculum.stages.ctx256.steps=2",
    "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2",
    "eval.sequences=1",
    "eval.passkey_documents=0",
    "logging.progress=lines",
    "logging.tensorboard=true",
    "report.at_end=false",
]


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_run_without_tensorboard_says_so_once_and_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert run_train_cli([*ONE_STAGE, f"run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.count(TENSORBOARD_MISSING) == 1 and "done: step 2/" in out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [2]
    assert not (tmp_path / "tensorboard").exists()
    assert TENSORBOARD_MISSING in (tmp_path / "train.log").read_text()
