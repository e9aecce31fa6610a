"""Where the GPU waits for the host, from a profiler trace (Chrome trace format, CPU and CUDA).

A gap is a stretch of the device's timeline with no kernel, copy or fill running, ending when
the next one starts. Each gap is charged to the host op that launched the work ending it: the
innermost CPU op around its launch call (found through the launch's correlation id), with the
outermost profiler range around it (``moe_lc::optimizer``, ``moe_lc::data``, ...; the backward's
thread has none, so there it is the autograd node). A gap that follows a host wait (a stream or
device synchronisation, a blocking copy) is marked with it. Tracing the host's ops slows the
host, so the gaps are longer than untraced; where they fall is what this is for.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from moe_lc.metrics.breakdown import BACKWARD_NODE, NOT_DEVICE_WORK

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
WAIT_MIN_US = 50.0  # a copy call this long waited (pageable memory, or device to host)
STEP_PREFIX = "ProfilerStep#"


@dataclass(frozen=True)
class Gap:
    start_us: float
    idle_us: float
    region: str  # outermost named range around the launch, or the backward's autograd node
    launcher: str  # innermost host op around the launch
    after_wait: Optional[str]  # the host wait that ended inside the gap, if any


class _Intervals:
    """One thread's host ops, nested by time: the ops around a point, outermost first."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
        self.starts = [e["ts"] for e in self.events]
        self.parent: list[int] = []
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and self._end(stack[-1]) < e["ts"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def _end(self, i: int) -> float:
        e = self.events[i]
        return e["ts"] + e.get("dur", 0)

    def around(self, t: float) -> list[dict[str, Any]]:
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self._end(i) < t:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.events[i])
            i = self.parent[i]
        return chain[::-1]


def _region(chain: list[dict[str, Any]]) -> str:
    for e in chain:
        if e["cat"] == "user_annotation" and not e["name"].startswith(STEP_PREFIX):
            return e["name"]
    for e in chain:
        if e["name"].startswith(BACKWARD_NODE):
            return "backward: " + e["name"][len(BACKWARD_NODE):]
    return chain[0]["name"] if chain else "(no host op)"


def _is_wait(launch: dict[str, Any]) -> bool:
    """A runtime call in which the host waited for the device: a synchronisation, a long copy."""
    name = launch["name"]
    return "Synchronize" in name or ("cudaMemcpy" in name and launch.get("dur", 0) >= WAIT_MIN_US)


@dataclass
class _Indexed:
    device: list[dict[str, Any]]  # kernels, copies and fills, by start
    launches: dict[Any, dict[str, Any]]  # correlation id -> the runtime call that launched it
    waits: list[dict[str, Any]]  # runtime calls in which the host waited, by end
    threads: dict[Any, _Intervals]  # (pid, tid) -> that thread's host ops

    def chain(self, work: dict[str, Any]) -> tuple[list[dict[str, Any]], Optional[dict[str, Any]]]:
        """The host ops around the launch of ``work``, outermost first, and the launch call."""
        launch = self.launches.get(work.get("args", {}).get("correlation"))
        if launch is None:
            return [], None
        thread = self.threads.get((launch.get("pid"), launch.get("tid")))
        return (thread.around(launch["ts"]) if thread is not None else []), launch


def _index(events: Iterable[dict[str, Any]]) -> _Indexed:
    device, launches, waits = [], {}, []
    host: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in DEVICE_CATEGORIES and e["name"] not in NOT_DEVICE_WORK:
            device.append(e)
        elif cat in LAUNCH_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
            if _is_wait(e):
                waits.append(e)
        elif cat in HOST_CATEGORIES:
            host[(e.get("pid"), e.get("tid"))].append(e)
    device.sort(key=lambda e: e["ts"])
    waits.sort(key=lambda e: e["ts"] + e.get("dur", 0))
    return _Indexed(device, launches, waits, {key: _Intervals(evs) for key, evs in host.items()})


def _launcher(chain: list[dict[str, Any]], launch: Optional[dict[str, Any]]) -> str:
    return chain[-1]["name"] if chain else (launch["name"] if launch else "(not found)")


def find_gaps(events: Iterable[dict[str, Any]], min_us: float = 0.0) -> tuple[list[Gap], float, float]:
    """The device's gaps longer than ``min_us``, with the window (first device start to last device
    end) and the device's busy time in it, both in microseconds."""
    index = _index(events)
    device, waits = index.device, index.waits
    if not device:
        return [], 0.0, 0.0
    wait_ends = [e["ts"] + e.get("dur", 0) for e in waits]
    busy_until = device[0]["ts"]
    busy = 0.0
    gaps = []
    for e in device:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if start > busy_until:
            idle = start - busy_until
            if idle > min_us:
                chain, launch = index.chain(e)
                k = bisect.bisect_left(wait_ends, busy_until)
                wait = waits[k]["name"] if k < len(waits) and wait_ends[k] <= start else None
                gaps.append(Gap(busy_until, idle, _region(chain), _launcher(chain, launch), wait))
        busy += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    return gaps, busy_until - device[0]["ts"], busy


def device_time_by_launcher(events: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], tuple[float, int]]:
    """Device time (us) and count of every (region, launching host op, kernel) in a trace: which host op,
    in which autograd node or named range, launched each kernel (the sums autograd makes of a tensor's
    gradients show as ``backward: <node> / aten::add_``)."""
    index = _index(events)
    table: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in index.device:
        chain, launch = index.chain(e)
        row = table[(_region(chain), _launcher(chain, launch), e["name"])]
        row[0] += e.get("dur", 0)
        row[1] += 1
    return {key: (us, int(n)) for key, (us, n) in table.items()}


def format_device_time_by_launcher(table: dict[tuple[str, str, str], tuple[float, int]], rows: int = 60,
                                   width: int = 150) -> str:
    """``device_time_by_launcher`` as text, the largest first."""
    total = sum(us for us, _ in table.values())
    lines = [f"device time {total / 1e3:.1f} ms; by region / launching host op / kernel:",
             f"{'ms':>8} {'share':>6} {'count':>6}  region / op / kernel"]
    for (region, launcher, kernel), (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{us / 1e3:8.2f} {us / max(total, 1e-9):6.1%} {n:6d}  "
                     f"{f'{region} / {launcher} / {kernel}'[:width]}")
    return "\n".join(lines) + "\n"


def load_trace(path: Union[str, Path]) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def format_gaps(gaps: list[Gap], window_us: float, busy_us: float, rows: int = 25) -> str:
    """Tables of the idle time by region, by launching op, and the largest single gaps."""
    idle = window_us - busy_us
    lines = [f"window {window_us / 1e3:.1f} ms, device busy {busy_us / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
             f"({idle / max(window_us, 1e-9):.1%}) in {len(gaps)} gaps"]

    def table(title: str, key) -> None:
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for g in gaps:
            t = total[key(g)]
            t[0] += g.idle_us
            t[1] += 1
        lines.append(f"\n{title:<72} idle ms  share   gaps")
        for name, (us, n) in sorted(total.items(), key=lambda kv: -kv[1][0])[:rows]:
            lines.append(f"{name[:72]:<72} {us / 1e3:7.1f} {us / max(idle, 1e-9):6.1%} {n:6d}")

    table("by region", lambda g: g.region)
    table("by launching host op (region / op)", lambda g: f"{g.region} / {g.launcher}")
    table("by the host wait before the gap", lambda g: g.after_wait or "(none)")
    lines.append(f"\n{'largest gaps: at ms':<20} {'idle ms':>8}  region / launching op [after wait]")
    origin = gaps[0].start_us if gaps else 0.0
    for g in sorted(gaps, key=lambda g: -g.idle_us)[:rows]:
        wait = f" [after {g.after_wait}]" if g.after_wait else ""
        lines.append(f"{(g.start_us - origin) / 1e3:<20.2f} {g.idle_us / 1e3:8.2f}  {g.region} / {g.launcher}{wait}")
    return "\n".join(lines) + "\n"
