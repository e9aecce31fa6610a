"""`moe-lc report`: plots and the per-stage summary from metrics files written here by hand."""

from __future__ import annotations

import json
from statistics import median

import pytest

from moe_lc.cli import main as cli_main
from moe_lc.report import load_run, render_report, stage_summary
from moe_lc.report.render import average_loads, relative_loads


def _write_run(run_dir, steps=12):
    stages = [("a", 256, 1000.0), ("b", 1024, 700.0), ("c", 4096, 400.0)]
    recs = []
    for step in range(1, steps + 1):
        name, seq, rate = stages[min((step - 1) // 4, 2)]
        recs.append({
            "step": step, "stage": name, "seq_len": seq, "loss": 6.0 - 0.2 * step, "grad_norm": 1.0, "lr": 1e-3,
            "tokens": 512, "tokens_per_s": rate + step, "step_time_s": 512 / (rate + step), "mfu": 0.01 * step,
            "peak_memory_gib": 0.5, "maxvio": 0.1 * step, "maxvio_per_layer": [0.1 * step, 0.05 * step],
            "expert_loads": [[step, 2 * step, 3 * step, 2 * step], [1, 1, 1, 5]],
        })
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
        fh.write(json.dumps({**recs[-1], "loss": 99.0}) + "\n")  # a re-logged step: the last record wins
    evals = [{"step": 4 * (i + 1), "stage": n, "seq_len": s, "loss": 5.0 - i, "passkey_accuracy": 0.5,
              "passkey_loss": 2.0, "buckets": [{"lo": 0, "hi": 64, "tokens": 10, "loss": 5.0},
                                               {"lo": 64, "hi": s, "tokens": 20, "loss": 4.0}]}
             for i, (n, s, _) in enumerate(stages)]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return recs


def test_summary_numbers_are_the_medians_and_extremes_of_the_records(tmp_path):
    recs = _write_run(tmp_path)
    run = load_run(tmp_path)
    assert [r["step"] for r in run.steps] == list(range(1, 13)) and run.steps[-1]["loss"] == 99.0
    summary = stage_summary(run)
    assert [s["stage"] for s in summary] == ["a", "b", "c"]
    for s in summary:
        mine = [r for r in run.steps if r["stage"] == s["stage"]]
        assert s["tokens_per_s"] == median(r["tokens_per_s"] for r in mine[1:])  # warm-up step excluded
        assert s["mfu"] == pytest.approx(median(r["mfu"] for r in mine[1:]))
        assert s["steps"] == 4 and s["tokens"] == 4 * 512
        assert s["max_maxvio"] == max(r["maxvio"] for r in mine)
    assert summary[0]["eval_loss"] == 5.0 and summary[2]["passkey_accuracy"] == 0.5
    assert recs[0]["loss"] == summary[0]["first_loss"]


def test_relative_and_average_loads():
    assert relative_loads([[1, 3], [2, 2]]) == [[0.5, 1.5], [1.0, 1.0]]


def test_average_loads_over_logged_steps(tmp_path):
    _write_run(tmp_path, steps=2)
    avg = average_loads(load_run(tmp_path))
    # steps 1, 2 and the re-logged step 2 collapse to steps 1 and 2
    assert avg == [[1.5, 3.0, 4.5, 3.0], [1.0, 1.0, 1.0, 5.0]]


def test_render_writes_valid_pngs_and_the_cli_matches(tmp_path, capsys):
    _write_run(tmp_path)
    paths = render_report(tmp_path)
    assert sorted(p.name for p in paths) == ["expert_load.png", "loss.png", "loss_by_position.png", "throughput.png"]
    import matplotlib.image as mpimg

    for p in paths:
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 400
    assert json.loads((tmp_path / "report" / "summary.json").read_text())[1]["stage"] == "b"
    assert cli_main(["report", str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "loss.png").exists() and "summary.md" in capsys.readouterr().out


def test_report_of_a_directory_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
