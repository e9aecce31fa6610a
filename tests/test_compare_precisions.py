"""benchmarks/compare_precisions.py (the FP8-against-BF16 curves and the resume across precisions)
on the CPU with fp32 against bf16: same batches in both runs, each resume starts from the other
run's checkpoint in its own precision, the numbers it reports are the runs' own, and it fails
when the curves' later-half means differ by more than its tolerance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moe_lc.train.main import run_train_cli

REPO = Path(__file__).resolve().parents[1]
SMALL = ["device=cpu", "threads=1", "curriculum.run=[ctx256]", "curriculum.stages.ctx256.global_batch_tokens=512",
         "curriculum.stages.ctx256.micro_batch=2", "logging.progress=none"]


def _script():
    spec = importlib.util.spec_from_file_location("compare_precisions", REPO / "benchmarks" / "compare_precisions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def script(monkeypatch):
    module = _script()
    launches: list[list[str]] = []

    def in_process(run_dir: Path, overrides: list[str], log: Path) -> None:  # no interpreter start per launch
        launches.append([*overrides, f"run_dir={run_dir}"])
        assert run_train_cli([*overrides, f"run_dir={run_dir}"]) == 0

    monkeypatch.setattr(module, "train", in_process)
    module.launches = launches
    return module


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.usefixtures("shared_corpus_cache")
def test_two_precisions_and_the_resume_across_them(script, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = script.main(["--recipe", "smoke", "--steps", "4", "--resume-at", "2", "--a", "precision=fp32",
                      "--b", "precision=bf16", "--out", str(out), "--window", "2", "--skip", "1", *SMALL])
    assert rc == 0, capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    a, b = _records(out / "a"), _records(out / "b")
    assert summary["steps"] == [1, 2, 3, 4]
    assert summary["loss_a"] == [a[s]["loss"] for s in range(1, 5)]
    assert summary["loss_b"] == [b[s]["loss"] for s in range(1, 5)]
    for s in range(1, 5):  # the same tokens in both: the losses differ by precision alone
        assert (a[s]["tokens"], a[s]["label_tokens"], a[s]["keys_per_token"]) == \
            (b[s]["tokens"], b[s]["label_tokens"], b[s]["keys_per_token"])
        assert a[s]["loss"] != b[s]["loss"]
    # each resume starts from the other run's step 2 and runs in its own precision
    resumed = {r["run"]: r for r in summary["resume"]}
    for name, own in (("a_then_b", a), ("b_then_a", b)):
        got = _records(out / name)
        assert sorted(got) == [3]
        assert resumed[name]["resumed_loss"] == got[3]["loss"] and resumed[name]["continued_loss"] == own[3]["loss"]
        assert got[3]["loss"] != own[3]["loss"]  # the precision changed
        assert resumed[name]["rel_diff"] < 1e-2  # a bf16 rounding of one step, not another state
    a_then_b = next(o for o in script.launches if f"run_dir={out / 'a_then_b'}" in o)
    assert f"resume={out / 'a' / 'checkpoints' / 'step_00000002'}" in a_then_b and "precision=bf16" in a_then_b
    assert not (out / "a" / "checkpoints").exists() and not (out / "b" / "checkpoints").exists()
    assert not list((out / "a_then_b").glob("checkpoints/step_*"))
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rel = [abs(y - x) / x for x, y in zip(summary["loss_a"], summary["loss_b"])]
    assert summary["max_rel_diff_per_step"] == pytest.approx(max(rel), rel=1e-12)
    # the verdict: the means of steps 3-4 (the later half), and the paired differences' standard error
    diffs = [y - x for x, y in zip(summary["loss_a"][2:], summary["loss_b"][2:])]
    mean_a = (summary["loss_a"][2] + summary["loss_a"][3]) / 2
    assert summary["rel_diff_of_later_half_means"] == pytest.approx((diffs[0] + diffs[1]) / 2 / mean_a, rel=1e-12)
    assert summary["rel_diff_of_later_half_means_se"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2 / mean_a,
                                                                       rel=1e-12)


@pytest.mark.usefixtures("shared_corpus_cache")
def test_curves_further_apart_than_the_tolerance_fail(script, tmp_path):
    rc = script.main(["--recipe", "smoke", "--steps", "2", "--a", "precision=fp32", "--b", "precision=bf16",
                      "--out", str(tmp_path / "cmp"), "--window", "1", "--tolerance", "1e-9", *SMALL])
    assert rc == 1
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert abs(summary["rel_diff_of_later_half_means"]) > 1e-9 and summary["resume"] == []
    assert not (tmp_path / "cmp" / "a" / "checkpoints").exists()  # nothing to resume: nothing saved
