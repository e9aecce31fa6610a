"""`moe_lc.metrics.gaps`: the device's idle time charged to the host op that launched the work
after it, on a hand-built trace whose gaps are known by construction."""

from moe_lc.metrics.gaps import device_time_by_launcher, find_gaps, format_device_time_by_launcher, format_gaps


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    return [
        # the optimizer's range on the main thread, an op inside it that launches kernel 1
        _x("user_annotation", "ProfilerStep#3", 0, 200),
        _x("user_annotation", "moe_lc::optimizer", 0, 100),
        _x("cpu_op", "aten::add_", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=1),
        # the backward's thread: an autograd node, its matmul launching kernel 2
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 50, 30, tid=2),
        _x("cpu_op", "aten::mm", 55, 15, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 56, 1, tid=2, corr=2),
        # a host wait, then a launch from the optimizer's range itself (no op around it)
        _x("cuda_runtime", "cudaStreamSynchronize", 81, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 95, 1, corr=3),
        _x("cuda_runtime", "cudaLaunchKernel", 96, 1, corr=4),
        # kernel 0 (launch not traced), kernel 1 after a 25 us gap, kernel 2 after 20, kernel 3
        # after 35 (the wait ended inside it), kernel 4 overlapping kernel 3 (no gap)
        _x("kernel", "k0", 0, 5, tid=7, corr=0),
        _x("kernel", "k1", 30, 10, tid=7, corr=1),
        _x("kernel", "k2", 60, 5, tid=7, corr=2),
        _x("kernel", "k3", 100, 1, tid=7, corr=3),
        _x("gpu_memcpy", "Memcpy HtoD", 100.5, 5, tid=8, corr=4),
        _x("kernel", "Command Buffer Full", 41, 18, tid=7, corr=5),  # the host waiting: not device work
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 300},  # not a span: ignored
    ]


def test_gaps_are_charged_to_the_launching_op_and_its_region():
    gaps, window, busy = find_gaps(_trace())
    assert window == 105.5
    assert busy == 5 + 10 + 5 + 1 + 4.5
    got = [(g.start_us, g.idle_us, g.region, g.launcher, g.after_wait) for g in gaps]
    assert got == [
        (5, 25, "moe_lc::optimizer", "aten::add_", None),
        (40, 20, "backward: MmBackward0", "aten::mm", None),
        (65, 35, "moe_lc::optimizer", "moe_lc::optimizer", "cudaStreamSynchronize"),
    ]
    assert sum(g.idle_us for g in gaps) == window - busy


def test_short_gaps_are_dropped_and_the_report_sums_them():
    gaps, window, busy = find_gaps(_trace(), min_us=22)
    assert [g.idle_us for g in gaps] == [25, 35]
    text = format_gaps(gaps, window, busy)
    assert "idle 0.1 ms (75.8%) in 2 gaps" in text
    assert "moe_lc::optimizer / aten::add_" in text
    assert "[after cudaStreamSynchronize]" in text


def test_a_trace_without_device_work_has_no_gaps():
    assert find_gaps([_x("cpu_op", "aten::add", 0, 5)]) == ([], 0.0, 0.0)


def test_device_time_is_charged_to_the_host_op_that_launched_it():
    table = device_time_by_launcher(_trace())
    assert table == {
        ("(no host op)", "(not found)", "k0"): (5, 1),
        ("moe_lc::optimizer", "aten::add_", "k1"): (10, 1),
        ("backward: MmBackward0", "aten::mm", "k2"): (5, 1),
        ("moe_lc::optimizer", "moe_lc::optimizer", "k3"): (1, 1),
        ("moe_lc::optimizer", "moe_lc::optimizer", "Memcpy HtoD"): (5, 1),
    }
    text = format_device_time_by_launcher(table)
    assert text.splitlines()[0] == "device time 0.0 ms; by region / launching host op / kernel:"
    assert "moe_lc::optimizer / aten::add_ / k1" in text.splitlines()[2]  # the largest first
