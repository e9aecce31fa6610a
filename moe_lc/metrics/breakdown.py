"""Where a training step's time goes, by model component, read from the PyTorch profiler.

Forward: every component module runs inside a profiler range ``moe_lc::<component>`` (forward
hooks; nothing in the model changes). Backward: autograd nodes carry the sequence number of the
forward op that created them, so a backward kernel is charged to the component whose range held
that forward op. A kernel is charged to the innermost component; NCCL kernels are
"communication"; whatever has no component is "other". On a GPU the times are kernel (device)
times; on a CPU they are the ops' own CPU times.

Components: kda, mla, attn_res (depth mixing), router_dispatch (router, balancer, latent
projections, sort, gather, combine), experts (routed expert GEMMs and activation),
shared_experts (their activation and output projection: their input projection is stacked into
the router's GEMM where the weights allow), dense_ffn, norms, loss (LM head and cross-entropy,
MTP), plus the regions the step loop opens itself with :func:`region`: optimizer, data (uploads,
waiting for the prepared batches, and the preparation itself on its own thread), router_dispatch
(the balancer update).

:func:`idle_share`: the share of the profiled window in which the device ran nothing, i.e. the
time the step's kernels waited for the host to queue them (or for a read back).

:func:`host_breakdown`: the host's wall time per component (Python, launches and dispatch
included, which op times leave out): where to cut when the GPU waits for the host.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.profiler import record_function

from moe_lc.model.attn_res import DepthMixer
from moe_lc.model.ffn import GatedFFN
from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import LatentMoE, RoutedExperts
from moe_lc.model.norm import RMSNorm

PREFIX = "moe_lc::"
# the names a range may carry; the project's torch.library ops (``moe_lc::sum_token_rows``, ...)
# share the prefix and are ops inside a component, not components
COMPONENTS = frozenset({"kda", "mla", "attn_res", "router_dispatch", "experts", "shared_experts", "dense_ffn",
                        "norms", "loss", "optimizer", "data"})
COMMUNICATION = "communication"
OTHER = "other"
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# CUPTI's marker for the host blocking on a full launch queue: it shows as a kernel, but it is the
# host waiting (measured: 594 ms of "kernel time" in a k3-small step's optimizer, whose kernels ran 49)
NOT_DEVICE_WORK = frozenset({"Command Buffer Full"})


def component_of(module: nn.Module, parent: Optional[nn.Module]) -> Optional[str]:
    """The component a module's work is charged to (None: its parent's)."""
    if isinstance(module, KDAttention):
        return "kda"
    if isinstance(module, GatedMLA):
        return "mla"
    if isinstance(module, DepthMixer):
        return "attn_res"
    if isinstance(module, LatentMoE):
        return "router_dispatch"
    if isinstance(module, RoutedExperts):
        return "experts"
    if isinstance(module, GatedFFN):
        return "shared_experts" if isinstance(parent, LatentMoE) else "dense_ffn"
    if isinstance(module, RMSNorm) and not isinstance(parent, (KDAttention, GatedMLA, LatentMoE, DepthMixer)):
        return "norms"
    return None


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """A profiler range for work outside the model (``optimizer``, ``data``, ``loss``)."""
    if name not in COMPONENTS:
        raise ValueError(f"profiler region {name!r} is not a component; use one of {sorted(COMPONENTS)}")
    with record_function(PREFIX + name):
        yield


_MISSING = object()


def _charge_calls(owner: Any, attr: str, name: str, undo: list[tuple[Any, str, Any]],
                  out_of_graph: bool = False) -> None:
    """Make ``owner.attr(...)`` run inside the component's profiler range (``out_of_graph``: left out of
    any compiled graph, like the hooks), noting in ``undo`` how to put the attribute back."""
    fn = getattr(owner, attr)

    def charged(*args: Any, **kwargs: Any) -> Any:
        with region(name):
            return fn(*args, **kwargs)
    undo.append((owner, attr, vars(owner).get(attr, _MISSING)))
    setattr(owner, attr, torch.compiler.disable(charged) if out_of_graph else charged)


@contextlib.contextmanager
def component_ranges(model: nn.Module) -> Iterator[None]:
    """Open a ``moe_lc::<component>`` profiler range around every component module's forward."""
    handles = []
    open_ranges: dict[int, list[Any]] = defaultdict(list)

    # The hooks of a compiled module run inside its compiled call: traced, a range is dropped and
    # every depth of ``open_ranges`` is a new guard (Dynamo recompiled up to its limit in the profiled
    # step). Left out of the graph, each is one break before and one after the module's forward.
    def enter(name: str, key: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any) -> None:
            r = record_function(PREFIX + name)
            r.__enter__()
            open_ranges[key].append(r)
        return hook

    def leave(key: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            open_ranges[key].pop().__exit__(None, None, None)
        return hook

    parents = {id(child): mod for mod in model.modules() for child in mod.children()}
    lm_head = getattr(model, "lm_head", None)
    undo: list[tuple[Any, str, Any]] = []
    if getattr(model, "lm_loss", None) is not None:  # the cross-entropy runs outside the LM head module
        _charge_calls(model, "lm_loss", "loss", undo)
    for module in model.modules():
        name = "loss" if module is lm_head else component_of(module, parents.get(id(module)))
        if name is None:
            continue
        handles.append(module.register_forward_pre_hook(enter(name, id(module))))
        handles.append(module.register_forward_hook(leave(id(module))))
        if name == "experts" and isinstance(module, RoutedExperts):
            # a compiled MoE layer makes the step's weight copies before its graph, outside this module's call
            _charge_calls(module, "prepare_step_weights", name, undo)
        if name == "shared_experts":
            # LatentMoE stacks their input projection into its own GEMM (router_dispatch) and calls
            # ``from_gate_in`` for the rest, which the module's hooks do not see
            _charge_calls(module, "from_gate_in", name, undo, out_of_graph=True)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, attr, own in reversed(undo):
            if own is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


def _own_component(event: Any) -> Optional[str]:
    name = event.name
    component = name[len(PREFIX):] if name.startswith(PREFIX) else None
    return component if component in COMPONENTS else None


def _innermost(event: Any) -> Optional[str]:
    e = event
    while e is not None:
        c = _own_component(e)
        if c is not None:
            return c
        e = e.cpu_parent
    return None


def _backward_seq(event: Any) -> Optional[tuple[int, int]]:
    """(forward thread, sequence number) of the autograd node an event runs under, if any."""
    e = event
    while e is not None:
        if e.name.startswith(BACKWARD_NODE) and e.sequence_nr >= 0:
            return e.fwd_thread, e.sequence_nr
        e = e.cpu_parent
    return None


def _forward_owners(events: Any) -> dict[tuple[int, int], str]:
    """(thread, sequence number) of each forward op run inside a component -> that component: what
    a backward node, which carries its forward op's sequence number, is charged to."""
    owners: dict[tuple[int, int], str] = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE):
            owner = _innermost(e)
            if owner is not None:
                owners.setdefault((e.thread, e.sequence_nr), owner)
    return owners


def _charged(events: Any, device: bool) -> Iterator[tuple[str, str, float]]:
    """(component, kernel or op name, microseconds) for every timed kernel (GPU) or op (CPU)."""
    forward_owner = _forward_owners(events)
    for e in events:
        if e.name in NOT_DEVICE_WORK:
            continue
        if device:
            timed = [(k.name, k.duration) for k in e.kernels if k.name not in NOT_DEVICE_WORK]
        elif e.device_type == torch.autograd.DeviceType.CPU:
            timed = [(e.name, e.self_cpu_time_total)]
        else:
            timed = []
        if not timed:
            continue
        owner = _innermost(e)
        if owner is None:
            seq = _backward_seq(e)
            owner = forward_owner.get(seq) if seq is not None else None
        for name, us in timed:
            yield COMMUNICATION if "nccl" in name.lower() else owner or OTHER, name, us


def breakdown(events: Any, device: bool) -> dict[str, float]:
    """Milliseconds per component from a profiler's ``events()``; ``device``: kernel times (GPU)."""
    totals: dict[str, float] = defaultdict(float)
    for owner, _, us in _charged(events, device):
        totals[owner] += us / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def profiled_kernels(events: Any) -> Iterator[tuple[str, float]]:
    """(name, microseconds) of every kernel, copy and memset a profiler's ``events()`` launched."""
    for e in events:
        if e.name not in NOT_DEVICE_WORK:
            yield from ((k.name, k.duration) for k in e.kernels if k.name not in NOT_DEVICE_WORK)


def kernel_table(rows: Iterable[tuple[str, str, float]]) -> dict[str, dict[str, tuple[float, int]]]:
    """(group, kernel, microseconds) rows summed as {group: {kernel: (milliseconds, launches)}}, each
    group's kernels largest first."""
    table: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for group, name, us in rows:
        cell = table[group][name]
        cell[0] += us / 1e3
        cell[1] += 1
    return {g: {k: (ms, n) for k, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])}
            for g, kernels in table.items()}


def kernel_lines(kernels: dict[str, tuple[float, int]], rows: int, name_width: int) -> list[str]:
    """The ``rows`` largest of one group's kernels (``kernel_table``), one line each."""
    return [f"  {ms:9.2f} ms {n:6d}x  {name[:name_width]}" for name, (ms, n) in list(kernels.items())[:rows]]


def kernels_by_component(events: Any, device: bool) -> dict[str, dict[str, tuple[float, int]]]:
    """Per component, each kernel's (milliseconds, launches), largest first: what a component's
    time is made of (its GEMMs against its copies and elementwise kernels)."""
    table = kernel_table(_charged(events, device))
    return dict(sorted(table.items(), key=lambda kv: -sum(ms for ms, _ in kv[1].values())))


def format_kernels_by_component(table: dict[str, dict[str, tuple[float, int]]], rows: int = 15,
                                name_width: int = 90) -> str:
    """``kernels_by_component`` as text: each component's total, then its ``rows`` largest kernels."""
    lines = []
    for component, kernels in table.items():
        total = sum(ms for ms, _ in kernels.values())
        lines.append(f"{component}: {total:.1f} ms in {sum(n for _, n in kernels.values())} launches")
        lines += kernel_lines(kernels, rows, name_width)
        lines.append("")
    return "\n".join(lines)


def idle_share(events: Any, device: bool) -> float:
    """Share of the profiled window (first to last event) in which nothing ran: no kernel, copy or
    fill on a GPU (``device``); on a CPU no ``aten::`` op on any thread. A profiler range
    (``record_function``: the components' ranges, the profiler's own step) shows on the GPU's
    timeline too, over the whole of its work, and is not work: counted, the GPU looked busy 99.7%
    of a k3-small step whose kernels ran less than half of it."""
    spans, starts, ends = [], [], []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        starts.append(start)
        ends.append(end)
        if (device and e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                and e.name not in NOT_DEVICE_WORK):
            spans.append((start, end))
        elif not device and e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"):
            spans.append((start, end))
    if not starts or max(ends) <= min(starts):
        return 0.0
    busy, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return max(0.0, 1.0 - busy / (max(ends) - min(starts)))


def host_breakdown(events: Any) -> dict[str, float]:
    """Host wall milliseconds per component from a profiler's ``events()``: each component range's
    duration and each backward node's, the node charged to the component of the forward op that made
    it, each less the ranges and nodes nested in it (a checkpoint's recompute runs forward ranges and
    nodes inside a node). Unlike :func:`breakdown` this counts the Python between ops (a Triton
    launch, a compiled region's guards): the host's share of a step that waits for it. A node whose
    forward ran outside every component is "other"."""
    forward_owner = _forward_owners(events)

    def charged(e: Any) -> Optional[str]:  # the component a range or node bills, None: neither
        own = _own_component(e)
        if own is not None:
            return own
        if e.name.startswith(BACKWARD_NODE):
            return forward_owner.get((e.fwd_thread, e.sequence_nr), OTHER) if e.sequence_nr >= 0 else OTHER
        return None

    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        name = charged(e)
        if name is None:
            continue
        ms = (e.time_range.end - e.time_range.start) / 1e3
        totals[name] += ms
        up = e.cpu_parent
        while up is not None and charged(up) is None:
            up = up.cpu_parent
        if up is not None:
            totals[charged(up)] -= ms
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
