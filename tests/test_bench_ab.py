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


def _fake_runs(ab, monkeypatch, times: dict[str, list[list[float]]]) -> list[str]:
    """``run_once`` replaced by reports of the given step times, variant ``x=NAME``'s runs in turn; the
    list of variants in the order they ran."""
    calls: list[str] = []

    def fake_run(shared, overrides, steps, warmup, timeout, profile=False):
        name = overrides[0].split("=")[1]
        calls.append(name)
        report = dict(step_times_s=times[name][sum(c == name for c in calls) - 1], mfu=0.5, peak_memory_gib=1.0)
        if profile:  # as `moe-lc bench --profile` reports it on a GPU; its share here: 1 / the run's first step
            report["profile"] = dict(full_step_idle_share=1.0 / report["step_times_s"][0])
        return report

    monkeypatch.setattr(ab, "run_once", fake_run)
    return calls


def test_variants_run_interleaved_and_are_compared_on_their_steady_steps(tmp_path, capsys, monkeypatch):
    """A B A B, each run's first timed step dropped from its mean, the change against A's mean."""
    ab = _script()
    calls = _fake_runs(ab, monkeypatch, {"a": [[9.0, 2.0, 2.0], [9.0, 2.2, 2.2]], "b": [[9.0, 1.0, 1.2], [9.0, 1.1, 1.1]]})
    out = tmp_path / "ab.json"
    assert ab.main(["smoke", "--variant", "a=x=a", "--variant", "b=x=b", "--rounds", "2", "--out", str(out)]) == 0
    assert calls == ["a", "b", "a", "b"]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["a"]["run_means_s"] == pytest.approx([2.0, 2.2]) and rows["a"]["change"] == 0.0
    assert rows["b"]["run_means_s"] == pytest.approx([1.1, 1.1])
    assert rows["b"]["change"] == pytest.approx(1.1 / 2.1 - 1.0)
    assert rows["a"]["spread_s"] == pytest.approx(0.2)
    # the median of every steady step of the variant, and its change against the first variant's
    assert rows["a"]["median_s"] == pytest.approx(2.1) and rows["b"]["median_s"] == pytest.approx(1.1)
    assert rows["b"]["median_change"] == pytest.approx(1.1 / 2.1 - 1.0)
    assert "| b |" in capsys.readouterr().out


def test_the_median_is_not_moved_by_one_stalled_step(monkeypatch, tmp_path):
    """One steady step stalled 3x (a plan built inside the timed steps) moves the mean, not the median."""
    ab = _script()
    _fake_runs(ab, monkeypatch, {"a": [[9.0, 1.0, 1.0, 1.0], [9.0, 1.0, 1.0, 1.0]],
                                 "b": [[9.0, 1.0, 3.0, 1.0], [9.0, 1.0, 1.0, 1.0]]})
    out = tmp_path / "ab.json"
    assert ab.main(["smoke", "--variant", "a=x=a", "--variant", "b=x=b", "--out", str(out)]) == 0
    b = json.loads(out.read_text())["rows"][1]
    assert b["change"] == pytest.approx(1.0 / 3.0)  # run means 5/3 and 1 against 1
    assert b["median_change"] == 0.0


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


def test_upper_case_words_of_a_variant_go_to_its_environment_not_to_hydra(monkeypatch):
    """MOE_LC_SHORT_CONV_TUNING=bwd_bt=64 is set for that run's process; lower-case words stay overrides."""
    ab = _script()
    assert ab.variant_environment(["model.moe.router_backend=triton", "MOE_LC_KDA_TUNING=ktile_bk=32,kside_bk=32"],
                                  Path("unused")) == (
        ["model.moe.router_backend=triton"], {"MOE_LC_KDA_TUNING": "ktile_bk=32,kside_bk=32"})
    seen = {}

    def fake_subprocess_run(cmd, env, **kwargs):
        seen.update(cmd=cmd, env=env)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(dict(step_times_s=[1.0])))
        return type("Done", (), dict(returncode=0, stderr=""))()

    monkeypatch.setattr(ab.subprocess, "run", fake_subprocess_run)
    monkeypatch.setenv("KEPT_FROM_THE_CALLER", "1")
    ab.run_once(["smoke"], ["x.y=1", "MOE_LC_SHORT_CONV_TUNING=bwd_bt=64"], steps=2, warmup=0, timeout=10)
    assert seen["env"]["MOE_LC_SHORT_CONV_TUNING"] == "bwd_bt=64" and seen["env"]["KEPT_FROM_THE_CALLER"] == "1"
    assert "x.y=1" in seen["cmd"] and not any(w.startswith("MOE_LC_") for w in seen["cmd"])


def test_a_short_conv_launch_choice_from_the_environment_reaches_the_kernels():
    """What such a variant relies on: MOE_LC_SHORT_CONV_TUNING is read when the kernels' module loads."""
    import os
    import subprocess
    import sys

    code = "import moe_lc_kernels.short_conv as s; print(s.TUNING['bwd_bt'], s.TUNING['fwd_bt'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MOE_LC_SHORT_CONV_TUNING": "bwd_bt=64"})
    assert done.stdout.split() == ["64", "64"], done.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MOE_LC_SHORT_CONV_TUNING": "bwd_tile=64"})
    assert bad.returncode != 0 and "short conv tuning item 'bwd_tile=64'" in bad.stderr


def test_a_benchmark_variants_launch_choices_are_undone_even_when_it_fails():
    """launch_choices, how the kernel benchmarks time one variant after another in one process: the
    overrides hold inside the block, and afterwards the table is what it was, also after an exception."""
    from moe_lc_kernels.tuning import launch_choices

    table = dict(fwd_bt=64, bwd_bt=128)
    with launch_choices(table, dict(bwd_bt=64, rows=1)):
        assert table == dict(fwd_bt=64, bwd_bt=64, rows=1)
    assert table == dict(fwd_bt=64, bwd_bt=128)
    with pytest.raises(RuntimeError), launch_choices(table, dict(fwd_bt=32)):
        raise RuntimeError("a launch the GPU refused")
    assert table == dict(fwd_bt=64, bwd_bt=128)


def test_a_tree_word_runs_the_variant_from_that_checkout(tmp_path, monkeypatch):
    """@TREE: the run imports moe_lc, moe_lc_kernels and moe_lc_recipes from TREE (a baseline checkout),
    not from this one; a directory that is not a moe-lc tree is refused in one line."""
    import os
    import subprocess
    import sys

    ab = _script()
    tree = tmp_path / "baseline"
    for folder in ("moe_lc", "kernels", "recipes"):
        (tree / folder).mkdir(parents=True)
        (tree / folder / "__init__.py").write_text(f"WHERE = {folder!r}\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    overrides, env = ab.variant_environment([f"@{tree}", "x.y=1"], scratch)
    assert overrides == ["x.y=1"]
    code = "import moe_lc, moe_lc_kernels, moe_lc_recipes as r; print(moe_lc.WHERE, moe_lc_kernels.WHERE, r.WHERE)"
    # from this repository's root, as the runs start: its own moe_lc/ there must not win over TREE's
    repo_root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=repo_root)
    assert done.stdout.split() == ["moe_lc", "kernels", "recipes"], done.stderr
    with pytest.raises(SystemExit, match="is not a moe-lc tree"):
        ab.variant_environment([f"@{tmp_path / 'scratch'}"], tmp_path)


def test_profiled_runs_add_the_gpus_idle_share(tmp_path, capsys, monkeypatch):
    """--profile: each run's whole-step idle share, averaged per variant, in the table and the JSON."""
    ab = _script()
    _fake_runs(ab, monkeypatch, {"a": [[4.0, 1.0], [5.0, 1.0]], "b": [[10.0, 1.0], [10.0, 1.0]]})
    out = tmp_path / "ab.json"
    assert ab.main(["smoke", "--variant", "a=x=a", "--variant", "b=x=b", "--profile", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["a"]["gpu_idle"] == pytest.approx((0.25 + 0.2) / 2) and rows["b"]["gpu_idle"] == pytest.approx(0.1)
    text = capsys.readouterr().out
    assert "| GPU idle |" in text and text.splitlines()[2].endswith("| 22.5% |")
    _fake_runs(ab, monkeypatch, {"a": [[4.0, 1.0], [5.0, 1.0]], "b": [[10.0, 1.0], [10.0, 1.0]]})
    assert ab.main(["smoke", "--variant", "a=x=a", "--variant", "b=x=b"]) == 0  # without it, no column
    assert "GPU idle" not in capsys.readouterr().out
