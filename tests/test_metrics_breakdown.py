"""The per-component breakdown charges forward and backward work to the module that did it."""

import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from toolchain import needs_cxx

from moe_lc.metrics.breakdown import (OTHER, breakdown, component_ranges, format_kernels_by_component,
                                      kernels_by_component, region)
from moe_lc.model.attn_res import DepthMixer
from moe_lc.model.init import build_model
from moe_lc.presets import get_preset


def _profiled_step(model=None):
    cfg = get_preset("tiny")
    model = model or build_model(cfg, device=torch.device("cpu"), seed=0, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    with profile(activities=[ProfilerActivity.CPU]) as prof, component_ranges(model):
        out = model(ids, labels=ids, return_logits=False)
        out.loss.backward()
        with region("optimizer"):
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-1e-3)
    return prof.events()


def test_every_component_of_the_tiny_model_is_charged_and_nothing_is_lost():
    events = _profiled_step()
    parts = breakdown(events, device=False)
    for name in ("kda", "mla", "attn_res", "router_dispatch", "experts", "shared_experts", "dense_ffn", "loss",
                 "optimizer"):
        assert parts.get(name, 0.0) > 0.0, (name, parts)
    own = sum(e.self_cpu_time_total for e in events if e.device_type == torch.autograd.DeviceType.CPU) / 1e3
    assert abs(sum(parts.values()) - own) <= 1e-6 * own


def test_kernels_by_component_sum_to_the_breakdown_and_name_the_ops():
    events = _profiled_step()
    parts = breakdown(events, device=False)
    table = kernels_by_component(events, device=False)
    assert set(table) == set(parts)
    for component, kernels in table.items():
        assert abs(sum(ms for ms, _ in kernels.values()) - parts[component]) <= 1e-9 * max(parts[component], 1.0)
        times = [ms for ms, _ in kernels.values()]
        assert times == sorted(times, reverse=True)
    # the experts' grouped GEMMs (one mm per expert on the CPU reference) are charged to the experts
    assert any(name.startswith("aten::mm") or name.startswith("aten::bmm") for name in table["experts"])
    text = format_kernels_by_component(table, rows=3)
    assert text.splitlines()[0].startswith(next(iter(table)) + ":")
    assert "attn_res:" in text


def test_backward_nodes_are_charged_to_their_forward_component():
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with region("kda"):
            y = lin(x).relu()
        y.sum().backward()
    events = prof.events()
    backward_mm = [e for e in events if e.name == "aten::mm"]
    assert backward_mm, "the linear's backward runs aten::mm"
    parts = breakdown(events, device=False)
    mm_time = sum(e.self_cpu_time_total for e in backward_mm) / 1e3
    assert parts["kda"] >= mm_time  # the backward matmuls are the forward's component's, not OTHER's
    assert parts.get(OTHER, 0.0) < parts["kda"]


def test_compiled_modules_keep_their_ranges():
    """Regional compilation compiles the AttnRes mixers with their hooks: a range opened inside a
    compiled call would be dropped (and each module's hook compiled anew, up to Dynamo's limit)."""
    torch._dynamo.reset()
    model = build_model(get_preset("tiny"), device=torch.device("cpu"), seed=0, dtype=torch.float32)
    mixers = [m for m in model.modules() if isinstance(m, DepthMixer)]
    for mixer in mixers:
        mixer.compile(backend="eager")  # Dynamo's tracing without Inductor's code generation
    _profiled_step(model)  # the compiles
    events = _profiled_step(model)
    ranges = [e for e in events if e.name == "moe_lc::attn_res"]
    assert len(ranges) == len(mixers), (len(ranges), len(mixers))
    assert breakdown(events, device=False).get("attn_res", 0.0) > 0.0
    torch._dynamo.reset()


@needs_cxx
def test_a_compiled_moe_layers_weight_copies_are_the_experts():
    """A compiled MoE layer makes the step's copies of the experts' weights before entering its graph,
    outside the experts' own call: they (and their backward, which adds into the fp32 gradients) are
    still charged to the experts, not to the router and dispatch around them."""
    from moe_lc.model.moe import reuse_weight_casts
    from moe_lc.parallel.compile import RegionalCompile, apply_compile

    torch._dynamo.reset()
    cfg = get_preset("tiny")
    model = build_model(cfg, device=torch.device("cpu"), seed=0, dtype=torch.float32)
    for experts in (m for m in model.modules() if type(m).__name__ == "RoutedExperts"):
        experts.backend = "grouped"  # the stacked copies are made for the grouped GEMM
    apply_compile(model, RegionalCompile(enabled=True, targets=["moe"]))
    ids = torch.randint(0, cfg.vocab_size, (2, 64))

    def step():
        with reuse_weight_casts(model), torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, labels=ids, return_logits=False).loss.backward()

    with component_ranges(model):
        step()  # the compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    table = kernels_by_component(prof.events(), device=False)
    casts = {"_StackedCastAccumulatingInFp32", "_StackedCastAccumulatingInFp32Backward"}
    assert casts <= set(table["experts"]), sorted(table["experts"])
    assert not casts & set(table.get("router_dispatch", {}))
    torch._dynamo.reset()


def test_idle_share_counts_kernels_not_the_ranges_over_them():
    """On a GPU the components' ranges and the profiler's step show on the device timeline too,
    spanning the kernels; only the kernels are work: here 4 of the 10 us window, twice overlapping."""
    from types import SimpleNamespace

    from moe_lc.metrics.breakdown import idle_share

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [event("ProfilerStep#1", 0, 10, cpu, True), event("ProfilerStep#1", 0, 10, cuda, True),
              event("moe_lc::kda", 1, 9, cuda, True), event("kernel_a", 2, 4, cuda), event("kernel_b", 3, 5, cuda),
              event("kernel_c", 7, 8, cuda), event("aten::mm", 1, 2, cpu),
              event("Command Buffer Full", 5, 7, cuda)]  # the host waiting on the launch queue
    assert idle_share(events, device=True) == 1.0 - 4 / 10
    assert idle_share(events, device=False) == 1.0 - 1 / 10


def test_the_launch_queue_marker_is_not_charged_as_kernel_time():
    """CUPTI reports the host blocking on a full launch queue as a "kernel" of the op that launched
    into it: it is not device work and must not count as the op's component's time."""
    from types import SimpleNamespace

    def kernel(name, us):
        return SimpleNamespace(name=name, duration=us)

    optimizer = SimpleNamespace(name="moe_lc::optimizer", cpu_parent=None, sequence_nr=-1, kernels=[])
    step = SimpleNamespace(name="aten::_fused_adamw_", cpu_parent=optimizer, sequence_nr=-1,
                           kernels=[kernel("multi_tensor_apply_kernel", 35_000.0), kernel("Command Buffer Full", 590_000.0)])
    marker = SimpleNamespace(name="Command Buffer Full", cpu_parent=optimizer, sequence_nr=-1,
                             kernels=[kernel("Command Buffer Full", 2_400_000.0)])  # as its own event too
    assert breakdown([optimizer, step, marker], device=True) == {"optimizer": 35.0}


def test_the_projects_custom_ops_are_charged_to_the_component_that_calls_them():
    """The torch.library ops (``moe_lc::sum_token_rows``, ...) share the ranges' prefix: their kernels
    belong to the component around them (router_dispatch), not to a component of their own."""
    from types import SimpleNamespace

    def kernel(name, us):
        return SimpleNamespace(name=name, duration=us)

    dispatch = SimpleNamespace(name="moe_lc::router_dispatch", cpu_parent=None, sequence_nr=-1, kernels=[])
    op = SimpleNamespace(name="moe_lc::sum_token_rows", cpu_parent=dispatch, sequence_nr=-1,
                         kernels=[kernel("sum_rows_kernel", 1_500.0)])
    assert breakdown([dispatch, op], device=True) == {"router_dispatch": 1.5}
    with pytest.raises(ValueError, match="not a component"):
        with region("sum_token_rows"):
            pass


def _sleeping(component: str, seconds: float):
    """An op-free stretch of host time inside a component's range, as a Triton launch or a compiled
    region's guards are: no aten op records it."""
    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(seconds)
            ctx.save_for_backward(x)  # what a checkpoint's backward must recompute
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(seconds)
            (x,) = ctx.saved_tensors
            return grad * torch.ones_like(x)

    def run(x):
        with region(component):
            return Sleep.apply(x)
    return run


def test_host_time_counts_the_time_between_ops_and_charges_the_backward_to_its_forward():
    from moe_lc.metrics.breakdown import host_breakdown

    x = torch.randn(8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = _sleeping("kda", 0.02)(x)
        y.sum().backward()
    events = prof.events()
    host = host_breakdown(events)
    assert host["kda"] >= 40.0, host  # 20 ms forward + 20 ms in the node of the backward
    assert host.get(OTHER, 0.0) < 20.0, host


def test_host_time_of_a_nested_or_recomputed_range_is_counted_once():
    from torch.utils.checkpoint import checkpoint

    from moe_lc.metrics.breakdown import host_breakdown

    inner = _sleeping("experts", 0.03)

    def outer(x):
        with region("router_dispatch"):
            time.sleep(0.01)
            return inner(x * 2)

    x = torch.randn(8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        y = checkpoint(outer, x, use_reentrant=False)  # the backward runs the forward's ranges again
        y.sum().backward()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    host = host_breakdown(prof.events())
    assert host["experts"] >= 90.0, host  # forward, recompute, backward
    assert 20.0 <= host["router_dispatch"] < 60.0, host  # its own 2 x 10 ms, not the experts' inside it
    assert sum(host.values()) <= wall_ms, (host, wall_ms)  # nothing counted twice
