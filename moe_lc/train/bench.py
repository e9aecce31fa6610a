"""`moe-lc bench RECIPE`: how fast one stage of a recipe trains on the devices present, and where
the time goes.

The stage (the recipe's first stage that would run, or `--stage NAME`) is built exactly as
`moe-lc train` builds it: the same layout resolved for the world (one process, or every rank
under torchrun), the same model setup, the same data and the same step loop (`run_steps`:
batches prepared ahead, one host read per step). It runs W warm-up steps, then N timed steps,
then, with `--profile`, one profiled step of one micro-batch per rank (after one profiler warm-up
step of the same size: a whole step of many micro-batches has too many events for the profiler to
process in reasonable time; the components' shares are per micro-batch, the optimizer's once per
step as in a step of one micro-batch; a pipeline keeps all its micro-batches). Nothing is written
into run_dir and no checkpoint is read or saved: an existing run is never touched.

Numbers (printed by rank 0; `--json PATH` writes them all):
- step time: wall time of the N timed steps / N; tokens/s: global batch tokens / step time;
- model FLOPs per token: `training_flops_per_token` at the stage's seq_len and the measured keys
  per token (attention within documents), so TFLOP/s per device = tokens/s x FLOPs / devices;
- MFU against the datasheet peak (`device_peak_flops`) and against a bf16 matmul peak measured
  in the same run (`measured_matmul_peak`; fp32 on a CPU);
- peak memory: the largest allocator peak over the ranks (peak RSS on a CPU);
- breakdown: time per model component in the profiled step (`moe_lc.metrics.breakdown`: kernel
  time on a GPU, and the host's wall time beside it, Python and launches included) and the share
  of the step in which the device ran nothing; on a GPU also the idle share of one
  whole step traced with the GPU's activity only (what waits for the host), measured before the
  profiled step, whose components' ranges split the compiled MoE layers' graphs for good;
- plan (on GPUs): `moe-lc plan`'s step time and peak memory for the same stage and layout, and the
  measured / planned ratios, so that every bench run is a calibration point of the planner.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, TextIO

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from moe_lc.config import ConfigError
from moe_lc.metrics import (
    device_memory_bytes, device_peak_flops, measured_matmul_peak, mfu, peak_memory_bytes, reset_peak_memory,
)
from moe_lc.metrics.breakdown import (breakdown, component_ranges, format_kernels_by_component, host_breakdown, idle_share,
                                      kernels_by_component, profiled_kernels)
from moe_lc.metrics.gaps import (device_time_by_launcher, find_gaps, format_device_time_by_launcher, format_gaps,
                                  load_trace)
from moe_lc.metrics.kernel_kinds import device_kernels, format_kinds, kernels_by_kind
from moe_lc.metrics.memory import allocator_counters
from moe_lc.model.accounting import training_flops_per_token
from moe_lc.parallel.compile import compiled_modules
from moe_lc.plan.search import HOST_BOUND_SHARE
from moe_lc.train.attention_plans import describe as describe_prebuild, prebuild_stage_attention_plans
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, plan_curriculum, total_steps
from moe_lc.train.data import build_stage_data
from moe_lc.train.fits import check_state_fits
from moe_lc.train.model_setup import build_model_state, float8_policy
from moe_lc.train.plan import estimate_stage
from moe_lc.train.runtime import Runtime, init_runtime
from moe_lc.train.step import TakenStep, run_steps

GIB = 2**30
PROFILER_WARMUP_STEPS = 1  # the profiler's own start-up cost lands in this step, which is not recorded
PROFILED_STEPS = 1


@dataclass
class Profiled:
    steps: int
    micro_batches: int  # per rank in a profiled step
    step_time_s: float  # mean over the profiled steps (the profiler adds some overhead)
    components_ms: dict[str, float]  # per step: kernel time on a GPU, CPU time of every thread on a CPU
    device_idle_share: float  # share of the profiled window with no kernel or copy running (no op on a CPU)
    # share of one whole step of the timed size with no kernel running, traced with the GPU's activity
    # only (no host-side profiling to slow the host down): how much of a step waits for the host
    full_step_idle_share: Optional[float] = None
    # per step: the host's wall time in each component (Python and launches included), which on a
    # GPU says where the time goes when the kernels wait for the host
    host_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class BenchResult:
    recipe: str
    stage: str
    seq_len: int
    global_batch_tokens: int
    micro_batch: int
    grad_accum: int
    layout: str
    world_size: int
    device_type: str  # cuda | cpu
    device: str
    precision: str
    warmup_steps: int
    steps: int
    step_time_s: float  # mean wall time of a timed step
    step_times_s: list[float]  # each timed step, as the device ran it
    tokens_per_s: float
    tokens_per_s_per_device: float
    keys_per_token: float
    flops_per_token: float
    tflops_per_device: float
    peak_tflops_datasheet: Optional[float]
    peak_tflops_measured: float
    mfu: Optional[float]
    mfu_measured_peak: float
    peak_memory_gib: float
    device_memory_gib: Optional[float]
    first_loss: float
    last_loss: float
    profile: Optional[Profiled] = None
    # CUDA caching allocator per timed step (rank 0): retries (each frees the cache with a device-wide
    # wait), cudaMalloc and cudaFree calls; None on a CPU
    allocator_per_step: Optional[dict[str, float]] = None
    # what `moe-lc plan` predicts for this stage and layout (on GPUs: its models are of the GPU path)
    planned_step_s: Optional[float] = None
    planned_peak_gib: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_bench(
    cfg: TrainConfig, steps: int = 10, warmup: int = 2, profiled: bool = False, json_path: Optional[str] = None,
    stream: Optional[TextIO] = None, trace_dir: Optional[str] = None,
) -> BenchResult:
    """Bench the first stage of `cfg` that would run (set `cfg.curriculum.run` to pick another); rank 0
    prints the report to `stream` (stdout) and writes it as JSON to `json_path`; with ``profiled``,
    every rank writes its profiled step's trace and ops table into ``trace_dir`` when given."""
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps {steps} --warmup {warmup}: time one step or more (--steps N >= 1) after zero "
                          "or more warm-up steps (--warmup W >= 0)")
    cfg.gc.check()
    runtime = init_runtime(cfg.device, cfg.precision, cfg.threads)
    try:
        result = _bench(cfg, runtime, steps, warmup, profiled, trace_dir)
        if runtime.is_main:
            print(format_bench(result), file=stream or sys.stdout)
            if json_path:
                path = Path(json_path)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        return result
    finally:
        runtime.shutdown()


def _compiled_note(model: torch.nn.Module) -> str:
    count = len(compiled_modules(model))
    return f", {count} modules compiled" if count else ""


def _bench(cfg: TrainConfig, runtime: Runtime, steps: int, warmup: int, profiled: bool,
           trace_dir: Optional[str] = None) -> BenchResult:
    device = runtime.device
    torch.manual_seed(cfg.seed)
    plans = plan_curriculum(cfg, runtime.world_size)
    plan = next((p for p in plans if p.run), None)
    if plan is None:
        raise ConfigError("the recipe runs no stage (curriculum.run, max_steps): pick one with --stage NAME")
    check_state_fits(cfg, [plan], device)
    matmul_peak = measured_matmul_peak(device)  # before the model: the device is otherwise idle
    reset_peak_memory(device)
    state = build_model_state(cfg.model, cfg.optim, plan.layout, runtime, cfg.seed, plan.checkpointing, plan.seq_len,
                              float8_policy(cfg), cfg.compile)
    data = build_stage_data(plan, cfg.data, cfg.model.vocab_size, cfg.seed, sync=runtime.rank0_first)
    rows, seconds = prebuild_stage_attention_plans(state.model, plan, runtime)  # not inside a timed step
    if rows and runtime.is_main:
        print(f"bench: {describe_prebuild(rows, seconds)}", file=sys.stderr, flush=True)
    count = warmup + steps
    taken_steps = run_steps(state, data, range(plan.start_step, plan.start_step + count), 0, total_steps(plans),
                            cfg.optim, runtime, gc_every=cfg.gc.every)
    show = _progress(runtime.is_main)
    with contextlib.closing(taken_steps):
        for k in range(warmup):
            show("warm-up", k, warmup, next(taken_steps))
        before = allocator_counters(device)
        t0 = time.perf_counter()
        timed = []
        for k in range(steps):
            timed.append(next(taken_steps))
            show("timed", k, steps, timed[-1])
        wall = time.perf_counter() - t0
        after = allocator_counters(device)
    allocator = None if before is None else {name: (after[name] - before[name]) / steps for name in before}
    profile_result = None
    if profiled:
        # The steps that measure the host's share run first, as training runs: the component ranges of
        # the profiled step below are hooks that break every compiled MoE layer's graph, and Dynamo
        # keeps running the split entry it compiled for them after they are removed (a MoE layer's
        # forward then enters seven compiled regions, not one: docs/performance.md §12.26).
        first = plan.start_step + count
        full_idle = None
        if device.type == "cuda":
            full_data = build_stage_data(plan, cfg.data, cfg.model.vocab_size, cfg.seed, sync=runtime.rank0_first)
            full_steps = run_steps(state, full_data, range(first, first + PROFILER_WARMUP_STEPS + 1), 0, total_steps(plans),
                                   cfg.optim, runtime, gc_every=cfg.gc.every)
            with contextlib.closing(full_steps):
                full_idle = _full_step_idle_share(full_steps, show)
            first += PROFILER_WARMUP_STEPS + 1
            prefix = _trace_prefix(trace_dir, runtime)
            if prefix is not None:
                two = profiling_plan(plan, micro_batches=min(plan.grad_accum, 2))
                gap_data = build_stage_data(two, cfg.data, cfg.model.vocab_size, cfg.seed, sync=runtime.rank0_first)
                gap_steps = run_steps(state, gap_data, range(first, first + PROFILER_WARMUP_STEPS + 1), 0,
                                      total_steps(plans), cfg.optim, runtime, gc_every=cfg.gc.every)
                with contextlib.closing(gap_steps):
                    _write_gaps(gap_steps, show, prefix)
                first += PROFILER_WARMUP_STEPS + 1
        small = profiling_plan(plan)
        small_data = build_stage_data(small, cfg.data, cfg.model.vocab_size, cfg.seed, sync=runtime.rank0_first)
        profiled_steps = run_steps(state, small_data, range(first, first + PROFILER_WARMUP_STEPS + PROFILED_STEPS),
                                   0, total_steps(plans), cfg.optim, runtime, gc_every=cfg.gc.every)
        with contextlib.closing(profiled_steps):
            profile_result = _profile(profiled_steps, state.model, device, show, small.grad_accum,
                                      _trace_prefix(trace_dir, runtime))
        if full_idle is not None:
            profile_result.full_step_idle_share = full_idle
    result = _result(cfg, plan, runtime, timed, wall, warmup, matmul_peak, profile_result)
    planned = (planned_step_and_peak(cfg, plan, result.keys_per_token, torch.cuda.get_device_name(device))
               if device.type == "cuda" else (None, None))
    return replace(result, precision=result.precision + _compiled_note(state.model), allocator_per_step=allocator,
                   planned_step_s=planned[0], planned_peak_gib=planned[1])


def planned_step_and_peak(cfg: TrainConfig, plan: StagePlan, keys_per_token: Optional[float] = None,
                          device_name: Optional[str] = None) -> tuple[float, float]:
    """`moe-lc plan`'s step time (s) and peak memory (GiB) for this stage under its layout and policy, for
    the documents the timed steps had (``keys_per_token``), on the GPU ``device_name`` names (an H100's
    bandwidth and memory; else an H200's): printed beside the measured ones, each bench run is a
    calibration point of the planner."""
    estimate = estimate_stage(cfg, plan, keys_per_token, device_name)
    return estimate.time.step, estimate.memory.total / GIB


def _progress(on: bool):
    """Prints each step as it ends (stderr, rank 0): a long bench shows where it is."""
    def show(phase: str, k: int, n: int, taken: TakenStep) -> None:
        if on:
            print(f"bench: {phase} step {k + 1}/{n}: {taken.time_s:.3f} s, loss {taken.result.loss:.4f}",
                  file=sys.stderr, flush=True)
    return show


def profiling_plan(plan: StagePlan, micro_batches: int = 1) -> StagePlan:
    """The stage with ``micro_batches`` micro-batches per data-parallel rank per step (a pipeline keeps
    its micro-batches, which its schedule needs)."""
    if plan.layout.pp > 1:
        return plan
    return replace(plan, global_batch_tokens=micro_batches * plan.micro_batch * plan.seq_len * plan.layout.dp)


def _trace_prefix(trace_dir: Optional[str], runtime: Runtime) -> Optional[Path]:
    if trace_dir is None:
        return None
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    return Path(trace_dir) / f"rank{runtime.rank}"


def _write_trace(prof: profile, prefix: Path, on_gpu: bool) -> None:
    """The profiled step as a Chrome trace (chrome://tracing, Perfetto) and its ops by self time:
    what the component breakdown sums, op by op and kernel by kernel; and the ops by input shapes
    too, which says which tensors the copies and elementwise kernels move (weights or activations)."""
    prof.export_chrome_trace(f"{prefix}_trace.json")
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=80)
    Path(f"{prefix}_ops.txt").write_text(table + "\n")
    shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=80, max_name_column_width=60,
                                                                 max_shapes_column_width=100)
    Path(f"{prefix}_shapes.txt").write_text(shapes + "\n")


def _profile(taken_steps, model: torch.nn.Module, device: torch.device, show, micro_batches: int,
             trace_prefix: Optional[Path] = None) -> Profiled:
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    plan = schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=PROFILED_STEPS, repeat=1)
    times = []
    with profile(activities=activities, schedule=plan, record_shapes=trace_prefix is not None) as prof, \
            component_ranges(model):
        for k in range(PROFILER_WARMUP_STEPS + PROFILED_STEPS):
            taken: TakenStep = next(taken_steps)
            show("profiled", k, PROFILER_WARMUP_STEPS + PROFILED_STEPS, taken)
            if k >= PROFILER_WARMUP_STEPS:
                times.append(taken.time_s)
            prof.step()
    events = prof.events()
    if trace_prefix is not None:
        _write_trace(prof, trace_prefix, on_gpu)
        table = format_kernels_by_component(kernels_by_component(events, device=on_gpu))
        Path(f"{trace_prefix}_kernels.txt").write_text(table + "\n")
        _write_kinds(profiled_kernels(events), Path(f"{trace_prefix}_trace.json"))
    per_step = {name: ms / PROFILED_STEPS for name, ms in breakdown(events, device=on_gpu).items()}
    host = {name: ms / PROFILED_STEPS for name, ms in host_breakdown(events).items()}
    return Profiled(PROFILED_STEPS, micro_batches, sum(times) / len(times), per_step,
                    idle_share(events, device=on_gpu), host_ms=host)


def _full_step_idle_share(taken_steps, show) -> float:
    """Idle share of the GPU over one whole step, from a trace of its kernels alone (CUPTI): the
    host runs as it does untraced, so the gaps are the host's (launches, Python, host reads)."""
    plan = schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=1, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=plan) as prof:
        for k in range(PROFILER_WARMUP_STEPS + 1):
            show("traced", k, PROFILER_WARMUP_STEPS + 1, next(taken_steps))
            prof.step()
    return idle_share(prof.events(), device=True)


def _write_gaps(taken_steps, show, prefix: Path) -> None:
    """Where the GPU waits for the host in a step of two micro-batches (its start, the seam between
    micro-batches, its end and optimizer), host ops and kernels traced: `moe_lc.metrics.gaps`; and its
    kernel time by the host op that launched each kernel (``*_launchers.txt``)."""
    plan = schedule(wait=0, warmup=PROFILER_WARMUP_STEPS, active=1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=plan) as prof:
        for k in range(PROFILER_WARMUP_STEPS + 1):
            show("gaps traced", k, PROFILER_WARMUP_STEPS + 1, next(taken_steps))
            prof.step()
    trace = Path(f"{prefix}_step_trace.json")
    prof.export_chrome_trace(str(trace))
    events = load_trace(trace)
    gaps, window, busy = find_gaps(events)
    Path(f"{prefix}_gaps.txt").write_text(format_gaps(gaps, window, busy))
    Path(f"{prefix}_launchers.txt").write_text(format_device_time_by_launcher(device_time_by_launcher(events)))
    _write_kinds(device_kernels(events), trace)


def _write_kinds(kernels: Iterable[tuple[str, float]], trace: Path) -> None:
    """A traced step's kernel time by kind (GEMMs, attention, KDA, optimizer, memory-bound), next to its
    trace as ``*_kinds.txt``: the shares a step-time model prices at one rate each."""
    table = kernels_by_kind(kernels)
    trace.with_name(trace.name.replace(".json", "_kinds.txt")).write_text(format_kinds(table) + "\n")


def _max_over_ranks(value: float, runtime: Runtime) -> float:
    if not runtime.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _result(
    cfg: TrainConfig, plan: StagePlan, runtime: Runtime, timed: list[TakenStep], wall: float, warmup: int,
    matmul_peak: float, profiled: Optional[Profiled],
) -> BenchResult:
    device, world = runtime.device, runtime.world_size
    step_time = wall / len(timed)
    tokens_per_s = plan.global_batch_tokens / step_time
    keys = sum(t.result.keys_per_token for t in timed) / len(timed)
    flops_per_token = training_flops_per_token(cfg.model, plan.seq_len, keys)
    datasheet = device_peak_flops(device, cfg.logging.cpu_peak_flops)
    total_memory = device_memory_bytes(device)
    return BenchResult(
        recipe=cfg.recipe,
        stage=plan.name,
        seq_len=plan.seq_len,
        global_batch_tokens=plan.global_batch_tokens,
        micro_batch=plan.micro_batch,
        grad_accum=plan.grad_accum,
        layout=plan.layout.describe(),
        world_size=world,
        device_type=device.type,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} thread(s))",
        precision=runtime.describe_precision(cfg.float8.experts),
        warmup_steps=warmup,
        steps=len(timed),
        step_time_s=step_time,
        step_times_s=[t.time_s for t in timed],
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / world,
        keys_per_token=keys,
        flops_per_token=flops_per_token,
        tflops_per_device=tokens_per_s * flops_per_token / world / 1e12,
        peak_tflops_datasheet=datasheet / 1e12 if datasheet else None,
        peak_tflops_measured=matmul_peak / 1e12,
        mfu=mfu(tokens_per_s, flops_per_token, datasheet, world),
        mfu_measured_peak=mfu(tokens_per_s, flops_per_token, matmul_peak, world),
        peak_memory_gib=_max_over_ranks(peak_memory_bytes(device), runtime) / GIB,
        device_memory_gib=total_memory / GIB if total_memory else None,
        first_loss=timed[0].result.loss,
        last_loss=timed[-1].result.loss,
        profile=profiled,
    )


def _rate(tflops: float) -> str:
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{1e3 * tflops:,.1f} GFLOP/s"


def format_bench(r: BenchResult) -> str:
    """The console report of a bench."""
    def pct(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    datasheet = "unknown device" if r.peak_tflops_datasheet is None else _rate(r.peak_tflops_datasheet)
    memory = f"{r.peak_memory_gib:.2f} GiB" + (f" of {r.device_memory_gib:.1f} GiB" if r.device_memory_gib else "")
    lines = [
        f"moe-lc bench: recipe {r.recipe}, stage {r.stage} (seq_len {r.seq_len}, {r.global_batch_tokens:,} tokens "
        f"per step, micro-batch {r.micro_batch} x {r.grad_accum} accumulation), layout {r.layout}",
        f"  device        {r.world_size} x {r.device}, {r.precision}",
        f"  steps         {r.warmup_steps} warm-up + {r.steps} timed: mean {r.step_time_s:.3f} s "
        f"(min {min(r.step_times_s):.3f}, max {max(r.step_times_s):.3f}), loss {r.first_loss:.4f} -> {r.last_loss:.4f}",
        f"  throughput    {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s_per_device:,.0f} per device)",
        f"  model FLOPs   {r.flops_per_token:.4g} per token ({r.keys_per_token:,.1f} keys per query): "
        f"{_rate(r.tflops_per_device)} per device",
        f"  MFU           {pct(r.mfu)} of the datasheet peak ({datasheet}), {pct(r.mfu_measured_peak)} of the "
        f"measured matmul peak ({_rate(r.peak_tflops_measured)})",
        f"  peak memory   {memory}",
    ]
    if r.planned_step_s is not None and r.planned_peak_gib is not None:
        lines.append(f"  plan          step {r.planned_step_s:.3g} s, peak {r.planned_peak_gib:.2f} GiB (moe-lc plan's "
                     f"models); measured / planned: step {r.step_time_s / r.planned_step_s:.2f}, peak "
                     f"{r.peak_memory_gib / r.planned_peak_gib:.2f}")
    if r.allocator_per_step is not None:
        a = r.allocator_per_step
        lines.append(f"  allocator     {a['num_alloc_retries']:.1f} retries, {a['num_device_alloc']:.1f} cudaMalloc, "
                     f"{a['num_device_free']:.1f} cudaFree a timed step"
                     + ("; retries free the cache and wait for the GPU: PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True, or less memory (docs/training.md)" if a["num_alloc_retries"] else ""))
    if r.profile is not None:
        p = r.profile
        idle = "device idle" if r.device_type == "cuda" else "no op running"
        lines.append(f"  breakdown     {p.steps} profiled step of {p.micro_batches} micro-batch(es) per rank "
                     f"({r.grad_accum} in a timed step), {p.step_time_s:.3f} s, {idle} {pct(p.device_idle_share)} of it")
        if p.full_step_idle_share is not None:
            lines.append(f"  GPU idle      {pct(p.full_step_idle_share)} of a whole step of {r.grad_accum} micro-batch(es) "
                         "(its kernels traced alone): the share that waits for the host"
                         + ("; bound by the host: more rows a micro-batch (micro_batch) give each launch more work"
                            if p.full_step_idle_share >= HOST_BOUND_SHARE else ""))
        step_ms = 1e3 * p.step_time_s
        kind = "kernels" if r.device_type == "cuda" else "op CPU"
        lines.append(f"    {'component':<16} {kind:>10}  {'share':>6}  {'host wall':>10}")
        for name in sorted(set(p.components_ms) | set(p.host_ms), key=lambda n: -p.components_ms.get(n, 0.0)):
            ms, host = p.components_ms.get(name, 0.0), p.host_ms.get(name)
            host_text = f"{host:>7.1f} ms" if host is not None else f"{'':>10}"
            lines.append(f"    {name:<16} {ms:>7.1f} ms  {100 * ms / step_ms:5.1f}%  {host_text}")
    return "\n".join(lines)
