"""benchmarks/bench_ab.py: interleaved `moe-lc bench` runs of several variants, each in its own process.

On the CPU with the smoke recipe: every variant runs every round in turn, each run's first timed
step is dropped from its mean, and the change is against the first variant's mean."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("bench_ab", REPO / "benchmarks" / "bench_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants_run_interleaved_and_are_compared_on_their_steady_steps(tmp_path, capsys):
    ab = _script()
    out = tmp_path / "ab.json"
    small = ["smoke", "device=cpu", "threads=1", "curriculum.run=[ctx256]",
             "curriculum.stages.ctx256.global_batch_tokens=512", "curriculum.stages.ctx256.micro_batch=2"]
    assert ab.main([*small, "--variant", "base=", "--variant", "unfused=model.moe.fused_projections=false",
                    "--rounds", "2", "--steps", "3", "--warmup", "0", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| base |" in table and "| unfused |" in table
    saved = json.loads(out.read_text())
    rows = {r["variant"]: r for r in saved["rows"]}
    for name in ("base", "unfused"):
        reports = saved["reports"][name]
        assert len(reports) == 2 and all(len(r["step_times_s"]) == 3 for r in reports)
        means = [sum(r["step_times_s"][1:]) / 2 for r in reports]
        assert rows[name]["run_means_s"] == pytest.approx(means)
        assert rows[name]["mean_s"] == pytest.approx(sum(means) / 2)
    assert rows["base"]["change"] == 0.0
    assert rows["unfused"]["change"] == pytest.approx(rows["unfused"]["mean_s"] / rows["base"]["mean_s"] - 1.0)


def test_a_variant_is_name_equals_overrides():
    ab = _script()
    assert ab.parse_variant("base=") == ("base", [])
    assert ab.parse_variant("r=a=1 b=2") == ("r", ["a=1", "b=2"])
    with pytest.raises(Exception, match="NAME=OVERRIDES"):
        ab.parse_variant("no-equals")
