"""benchmarks/bench_ab.py: interleaved `moe-lc bench` runs of several variants, each in its own process:
every variant runs every round in turn, each run's first timed step is dropped from its mean, and
the change is against the first variant's mean; one real run on the CPU with the smoke recipe."""

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


def test_variants_run_interleaved_and_are_compared_on_their_steady_steps(tmp_path, capsys, monkeypatch):
    """A B A B, each run's first timed step dropped from its mean, the change against A's mean."""
    ab = _script()
    calls, times = [], {"a": [[9.0, 2.0, 2.0], [9.0, 2.2, 2.2]], "b": [[9.0, 1.0, 1.2], [9.0, 1.1, 1.1]]}

    def fake_run(shared, overrides, steps, warmup, timeout):
        name = overrides[0].split("=")[1]
        calls.append(name)
        return dict(step_times_s=times[name][sum(c == name for c in calls) - 1], mfu=0.5, peak_memory_gib=1.0)

    monkeypatch.setattr(ab, "run_once", fake_run)
    out = tmp_path / "ab.json"
    assert ab.main(["smoke", "--variant", "a=x=a", "--variant", "b=x=b", "--rounds", "2", "--out", str(out)]) == 0
    assert calls == ["a", "b", "a", "b"]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["a"]["run_means_s"] == pytest.approx([2.0, 2.2]) and rows["a"]["change"] == 0.0
    assert rows["b"]["run_means_s"] == pytest.approx([1.1, 1.1])
    assert rows["b"]["change"] == pytest.approx(1.1 / 2.1 - 1.0)
    assert rows["a"]["spread_s"] == pytest.approx(0.2)
    assert "| b |" in capsys.readouterr().out


def test_a_run_is_a_moe_lc_bench_call_of_its_own(tmp_path, capsys):
    """One real run on the CPU (the smoke recipe): a `moe-lc bench` process whose JSON report comes back."""
    ab = _script()
    out = tmp_path / "ab.json"
    small = ["smoke", "device=cpu", "threads=1", "curriculum.run=[ctx256]",
             "curriculum.stages.ctx256.global_batch_tokens=512", "curriculum.stages.ctx256.micro_batch=2"]
    assert ab.main([*small, "--variant", "unfused=model.moe.fused_projections=false", "--rounds", "1", "--steps", "2",
                    "--warmup", "0", "--out", str(out)]) == 0
    report, = json.loads(out.read_text())["reports"]["unfused"]
    assert len(report["step_times_s"]) == 2 and report["recipe"] == "smoke"
    assert "| unfused |" in capsys.readouterr().out


def test_a_variant_is_name_equals_overrides():
    ab = _script()
    assert ab.parse_variant("base=") == ("base", [])
    assert ab.parse_variant("r=a=1 b=2") == ("r", ["a=1", "b=2"])
    with pytest.raises(Exception, match="NAME=OVERRIDES"):
        ab.parse_variant("no-equals")
