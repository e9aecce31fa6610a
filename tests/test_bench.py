"""`moe-lc bench` on CPU: the smoke recipe's first stage timed and profiled through the trainer's own
step loop; its numbers agree with each other and with the FLOP accounting; run_dir is never
touched; a bad stage name is one line and exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from moe_lc.metrics import device_peak_flops
from moe_lc.model.accounting import training_flops_per_token
from moe_lc.presets import get_preset
from moe_lc.train.main import run_bench_cli

pytestmark = pytest.mark.usefixtures("shared_corpus_cache")

SMALL = ["device=cpu", "curriculum.stages.ctx256.global_batch_tokens=1024", "curriculum.stages.ctx256.micro_batch=2", "threads=1"]


def test_bench_of_the_smoke_recipe_times_and_profiles_its_first_stage(tmp_path, capsys):
    out = tmp_path / "bench.json"
    run_dir = tmp_path / "run"
    trace = tmp_path / "trace"
    args = ["recipe=smoke", *SMALL, f"run_dir={run_dir}", "--steps", "2", "--warmup", "1", "--trace", str(trace),
            "--json", str(out)]  # --trace profiles too
    assert run_bench_cli(args) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert not run_dir.exists()  # no log, no checkpoint, nothing
    assert (r["stage"], r["seq_len"], r["global_batch_tokens"], r["grad_accum"]) == ("ctx256", 256, 1024, 2)
    assert r["steps"] == 2 and len(r["step_times_s"]) == 2 and r["warmup_steps"] == 1
    assert r["tokens_per_s"] == pytest.approx(1024 / r["step_time_s"], rel=1e-12)
    assert 0 < r["keys_per_token"] <= (256 + 1) / 2  # documents end at the sequence end or before
    flops = training_flops_per_token(get_preset("tiny"), 256, r["keys_per_token"])
    assert r["flops_per_token"] == pytest.approx(flops, rel=1e-12)
    assert r["tflops_per_device"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=1e-12)
    peak = device_peak_flops(__import__("torch").device("cpu"))
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / peak, rel=1e-9)
    assert r["mfu_measured_peak"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops_measured"], rel=1e-9)
    assert r["peak_memory_gib"] > 0 and r["device_memory_gib"] is None
    assert r["allocator_per_step"] is None  # the CUDA caching allocator's counts
    profiled = r["profile"]
    for component in ("kda", "mla", "router_dispatch", "experts", "shared_experts", "loss", "optimizer", "data"):
        assert profiled["components_ms"].get(component, 0.0) > 0.0, (component, profiled["components_ms"])
    assert 0.0 <= profiled["device_idle_share"] < 1.0
    for component in ("kda", "experts", "optimizer"):  # the host's wall time too
        assert profiled["host_ms"].get(component, 0.0) > 0.0, (component, profiled["host_ms"])
    assert profiled["full_step_idle_share"] is None  # a GPU measure: the kernels of a whole step
    events = json.loads((trace / "rank0_trace.json").read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::mm") for e in events)
    assert "aten::" in (trace / "rank0_ops.txt").read_text()
    kernels = (trace / "rank0_kernels.txt").read_text()  # each component's own ops, largest first
    assert re.search(r"^experts: [\d.]+ ms in \d+ launches$", kernels, re.M) and "aten::" in kernels, kernels[:2000]
    shapes = (trace / "rank0_shapes.txt").read_text()  # the same ops by their input shapes
    assert "Input Shapes" in shapes and re.search(r"aten::mm .*\[\[\d+, \d+\], \[\d+, \d+\]\]", shapes), shapes[:3000]
    kinds = (trace / "rank0_trace_kinds.txt").read_text()  # a CPU trace has no kernels, only its header
    assert kinds.startswith("kernel time "), kinds
    for line in ("tokens/s", "MFU", "measured matmul peak", "peak memory", "breakdown", "experts", "host wall"):
        assert line in printed, line


def test_an_unknown_stage_is_one_line_naming_the_stages(capsys):
    assert run_bench_cli(["smoke", "--stage", "ctx2k", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ctx2k" in err and "ctx256, ctx1k, ctx4k, ctx16k" in err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_bench_on_a_gpu_reports_how_much_of_a_whole_step_waits_for_the_host(tmp_path, capsys):
    """The tiny model's kernels are microseconds long: its steps are mostly launch overhead, so the
    GPU idles most of a whole step, and the report says so."""
    out = tmp_path / "bench.json"
    args = ["recipe=smoke", "device=cuda", *SMALL[1:], f"run_dir={tmp_path / 'run'}", "--steps", "2", "--warmup", "1",
            "--profile", "--json", str(out)]
    assert run_bench_cli(args) == 0
    r = json.loads(out.read_text())
    idle = r["profile"]["full_step_idle_share"]
    assert 0.3 < idle < 1.0, idle
    assert set(r["allocator_per_step"]) == {"num_alloc_retries", "num_device_alloc", "num_device_free"}
    printed = capsys.readouterr().out
    assert "GPU idle" in printed and "cudaMalloc" in printed
    assert "bound by the host: more rows a micro-batch" in printed


def test_the_plans_step_and_peak_stand_beside_the_measured_ones():
    """On GPUs the bench prints `moe-lc plan`'s step time and peak for the stage it ran, and the
    measured / planned ratios: each run is a calibration point of the planner (k3-small-8k's plan
    here: its memory model's figure of tests/test_plan.py)."""
    from dataclasses import replace

    from moe_lc.train.bench import BenchResult, format_bench, planned_step_and_peak
    from moe_lc.train.curriculum import plan_curriculum
    from moe_lc.train.plan import estimate_stage
    from moe_lc.train.recipes import compose_recipe

    cfg = compose_recipe("k3-small-8k")
    stage = next(p for p in plan_curriculum(cfg, 1) if p.run)
    step, peak = planned_step_and_peak(cfg, stage)
    estimate = estimate_stage(cfg, stage)
    assert step == estimate.time.step > 0 and peak == pytest.approx(estimate.memory.total / 2**30)
    assert 120 < peak < 160  # 128.17 GiB measured on one H200 (docs/performance.md §12.3)
    # a bench on an H100 is compared with the plan for an H100 (its HBM is slower: a longer step)
    assert planned_step_and_peak(cfg, stage, device_name="NVIDIA H200")[0] == step
    assert planned_step_and_peak(cfg, stage, device_name="NVIDIA H100 80GB HBM3")[0] > 1.05 * step
    measured = BenchResult(
        recipe="k3-small-8k", stage=stage.name, seq_len=8192, global_batch_tokens=131072, micro_batch=2,
        grad_accum=8, layout="pp=1", world_size=1, device_type="cuda", device="GPU", precision="bf16", warmup_steps=2,
        steps=1, step_time_s=2 * step, step_times_s=[2 * step], tokens_per_s=1.0, tokens_per_s_per_device=1.0,
        keys_per_token=1.0, flops_per_token=1.0, tflops_per_device=1.0, peak_tflops_datasheet=989.0,
        peak_tflops_measured=790.0, mfu=0.3, mfu_measured_peak=0.4, peak_memory_gib=peak / 2,
        device_memory_gib=139.8, first_loss=1.0, last_loss=1.0)
    assert "plan " not in format_bench(measured)
    line = next(x for x in format_bench(replace(measured, planned_step_s=step, planned_peak_gib=peak)).splitlines()
                if x.strip().startswith("plan"))
    assert f"step {step:.3g} s" in line and "measured / planned: step 2.00, peak 0.50" in line


def test_a_step_bound_by_its_host_is_called_so_with_what_hides_it():
    """From a tenth of a whole step idle (k3-small at one 8K row a micro-batch: 24% on an H100,
    docs/performance.md §12.12) the report names the host and the micro-batch; at 1.6% it does not."""
    from moe_lc.train.bench import BenchResult, Profiled, format_bench

    def report(idle: float) -> str:
        profile = Profiled(steps=1, micro_batches=1, step_time_s=0.2, components_ms={"kda": 50.0},
                           device_idle_share=0.3, full_step_idle_share=idle, host_ms={"kda": 60.0})
        return format_bench(BenchResult(
            recipe="k3-small-8k", stage="ctx8k", seq_len=8192, global_batch_tokens=131072, micro_batch=1,
            grad_accum=16, layout="pp=1", world_size=1, device_type="cuda", device="GPU", precision="bf16",
            warmup_steps=3, steps=4, step_time_s=1.7, step_times_s=[1.7], tokens_per_s=1.0,
            tokens_per_s_per_device=1.0, keys_per_token=1.0, flops_per_token=1.0, tflops_per_device=1.0,
            peak_tflops_datasheet=989.0, peak_tflops_measured=780.0, mfu=0.28, mfu_measured_peak=0.35,
            peak_memory_gib=42.0, device_memory_gib=79.2, first_loss=1.0, last_loss=1.0, profile=profile))

    bound = next(x for x in report(0.24).splitlines() if "GPU idle" in x)
    assert "24.0%" in bound and "bound by the host: more rows a micro-batch (micro_batch)" in bound
    assert "bound by the host" not in report(0.016)
