"""The text `moe-lc plan --gpus N` prints for each stage's recommendation."""

from __future__ import annotations

from moe_lc.plan.hardware import HBM_FRACTION, LINK_FRACTION, Cluster
from moe_lc.plan.memory import GiB, MemoryBreakdown
from moe_lc.plan.search import MIN_CP_TOKENS, Candidate, Recommendation
from moe_lc.plan.step_time import StepTime

TERM_NAMES = {
    "host": "the GPU waiting for the host", "bubble": "pipeline bubble", "tp": "TP collectives",
    "ep": "EP all-to-all", "cp": "CP gathers",
    "pp": "PP transfers", "fsdp": "FSDP all-gathers", "dp_sync": "gradient sync", "optimizer": "optimizer step",
}
MEMORY_BOUND = 0.9  # a layout using this share of the usable memory or more is bound by memory
INDENT = " " * 8  # under "best"
LABEL = " " * 12  # under a line's label ("memory GiB", "time s", "binds")
CONTINUED = INDENT + LABEL


def assumptions(cluster: Cluster) -> list[str]:
    r = cluster.rates
    return [
        f"cluster: {cluster.describe()}",
        f"time model: of the {cluster.gpu.bf16_peak / 1e12:.0f} TFLOP/s bf16 peak, dense GEMMs at {r.dense_gemm:.0%}, "
        f"grouped {r.grouped_gemm:.0%}, attention {r.attention:.0%}, KDA {r.kda:.1%}; memory-bound kernels "
        f"{r.memory_passes:g} passes over the kept activations at {HBM_FRACTION:.0%} of HBM (measured on an H200); "
        f"the host {cluster.host_layer_s * 1e3:.0f} ms a layer and micro-batch (measured on H100 machines), which "
        "the GPU waits for where a micro-batch's kernels take less;",
        f"  links at {LINK_FRACTION:.0%} (assumed), TP, EP, CP and PP communication exposed, FSDP's overlapped with "
        "compute, no per-message latency",
        "memory model: one-GPU peaks within 11% of those measured on an H200; multi-GPU buffers not measured "
        "(docs/parallelism.md, Planning a layout)",
    ]


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def memory_lines(mem: MemoryBreakdown) -> list[str]:
    buffers = ", ".join(f"{k} {_gib(v)}" for k, v in mem.buffers.items())
    return [f"memory GiB  weights {_gib(mem.weights)}, grads {_gib(mem.gradients)}, optimizer {_gib(mem.optimizer)}, "
            f"accumulation {_gib(mem.accumulation)}, activations {_gib(mem.activations)}, backward "
            f"{_gib(mem.backward)}, logits {_gib(mem.logits)},",
            f"{LABEL}buffers {_gib(sum(mem.buffers.values()))} ({buffers}) => {_gib(mem.training_peak)} "
            f"(pipeline stage {mem.stage}); optimizer step {_gib(mem.optimizer_step)}"]


def largest_memory_terms(mem: MemoryBreakdown, count: int = 2) -> str:
    terms = {"weights": mem.weights, "gradients": mem.gradients, "optimizer state": mem.optimizer,
             "gradient accumulation": mem.accumulation, "activations": mem.activations, "backward": mem.backward,
             **{f"{k} buffers": v for k, v in mem.buffers.items()}}
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {_gib(value)}" for name, value in top)


def time_lines(t: StepTime) -> list[str]:
    comm = ", ".join(f"{name} {getattr(t, term):.3g}" for term, name in (
        ("tp", "tp"), ("ep", "ep"), ("cp", "cp"), ("pp", "pp"), ("fsdp", "fsdp"), ("dp_sync", "dp sync")))
    return [f"time s      compute {t.compute:.3g} (recompute {t.recompute:.3g}), host {t.host:.3g}, "
            f"bubble {t.bubble:.3g}, {comm},",
            f"{LABEL}optimizer {t.optimizer:.3g} => {t.step:.3g} (pipeline stage {t.stage} sets the pace)"]


def limits(c: Candidate, cluster: Cluster) -> str:
    """What binds a layout: its largest overhead and, near the limit, its memory."""
    name, share = c.time.largest_overhead()
    used = c.memory.total / (cluster.usable_gib * GiB)
    text = f"{TERM_NAMES[name]} {share:.0%} of the step"
    if name == "host":  # a micro-batch the host issues slower than the GPU runs it: give the GPU more per launch
        text += " (more rows a micro-batch would hide it)"
    return text + (f", memory {used:.0%} of usable" if used >= MEMORY_BOUND else "")


def summary(c: Candidate, cluster: Cluster) -> str:
    return (f"{c.layout}, {c.policy.describe()}: {c.time.step:.3g} s/step, MFU {c.time.mfu(cluster):.0%}, "
            f"{_gib(c.memory.total)} GiB")


def recommendation_lines(rec: Recommendation, cluster: Cluster, runners_up: int) -> list[str]:
    shape = rec.shape
    tokens = shape.sequences_per_step * shape.seq_len
    lines = [f"{rec.stage}: seq_len {shape.seq_len}, {shape.sequences_per_step} sequences ({tokens / 1e6:.2f}M tokens) "
             f"per step, micro_batch {shape.micro_batch}, {rec.steps} steps",
             f"  {rec.considered} layouts x policies priced, {len(rec.fitting)} layouts fit in "
             f"{cluster.usable_gib:.1f} GiB"]
    best = rec.best
    if rec.smallest is None:
        lines.append(f"  no layout of {cluster.gpus} GPUs runs this stage: dp = GPUs / (pp x cp x tp) must divide its "
                     f"{shape.sequences_per_step} sequences per step in micro-batches of {shape.micro_batch}, with tp "
                     f"<= {cluster.gpus_per_node} (a node), cp <= seq_len / {MIN_CP_TOKENS} and the model's "
                     "divisibility rules; choose a GPU count with more factors of two")
        return lines
    if best is None:
        s = rec.smallest
        lines += [f"  no layout fits; the least memory: {summary(s, cluster)}",
                  *(INDENT + line for line in memory_lines(s.memory)),
                  f"{INDENT}its largest terms: {largest_memory_terms(s.memory, 3)}; use more GPUs or GPUs with "
                  "more memory"]
        return lines
    lines += [f"  best  {summary(best, cluster)}", *(INDENT + line for line in memory_lines(best.memory)),
              *(INDENT + line for line in time_lines(best.time)), f"{INDENT}binds       {limits(best, cluster)}"]
    if rec.faster_rejected:
        nearest = min(rec.faster_rejected, key=lambda c: c.memory.total)
        lines += [f"{CONTINUED}{len(rec.faster_rejected)} faster layouts do not fit; the nearest: {nearest.layout}, "
                  f"{nearest.policy.describe()},",
                  f"{CONTINUED}{nearest.time.step:.3g} s/step, {_gib(nearest.memory.total)} GiB "
                  f"({largest_memory_terms(nearest.memory)})"]
    if rec.more_rows is not None:
        gain = 1 - rec.more_rows.time.step / best.time.step
        lines.append(f"{CONTINUED}micro_batch {2 * rec.shape.micro_batch} (curriculum.stages.{rec.stage}.micro_batch): "
                     f"{rec.more_rows.time.step:.3g} s/step ({gain:.0%} less), MFU {rec.more_rows.time.mfu(cluster):.0%}, "
                     f"{_gib(rec.more_rows.memory.total)} GiB")
    for i, c in enumerate(rec.runners_up(runners_up), start=2):
        slower = c.time.step / best.time.step - 1
        lines.append(f"  {i}.    {summary(c, cluster)}; +{slower:.1%}; {limits(c, cluster)}")
    hours = rec.steps * best.time.step / 3600
    lines.append(f"  stage time {hours:,.1f} h ({hours / 24:,.1f} days) on {cluster.gpus} GPUs")
    return lines
