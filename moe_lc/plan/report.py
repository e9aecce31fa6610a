"""The text `moe-lc plan --gpus N` prints for each stage's recommendation."""

from __future__ import annotations

from moe_lc.plan.hardware import COMPUTE_FRACTION, HBM_FRACTION, LINK_FRACTION, Cluster
from moe_lc.plan.memory import GiB, MemoryBreakdown
from moe_lc.plan.search import MIN_CP_TOKENS, Candidate, Recommendation
from moe_lc.plan.step_time import StepTime

TERM_NAMES = {
    "bubble": "pipeline bubble", "tp": "TP collectives", "ep": "EP all-to-all", "cp": "CP gathers",
    "pp": "PP transfers", "fsdp": "FSDP all-gathers", "dp_sync": "gradient sync", "optimizer": "optimizer step",
}
MEMORY_BOUND = 0.9  # a layout using this share of the usable memory or more is bound by memory


def assumptions(cluster: Cluster) -> list[str]:
    return [
        f"cluster: {cluster.describe()}",
        f"time model: compute at {COMPUTE_FRACTION:.0%} of the {cluster.gpu.bf16_peak / 1e12:.0f} TFLOP/s bf16 peak "
        f"(assumed), links at {LINK_FRACTION:.0%} (assumed), HBM at {HBM_FRACTION:.0%} (measured); TP, EP, CP and PP "
        "communication exposed, FSDP's overlapped with compute",
        "memory model: the fused GPU kernels' activation terms are not calibrated on a GPU yet "
        "(docs/parallelism.md, Planning a layout)",
    ]


def memory_line(mem: MemoryBreakdown) -> str:
    buffers = ", ".join(f"{k} {v / GiB:.1f}" for k, v in mem.buffers.items())
    return (f"memory GiB   weights {mem.weights / GiB:.1f}  grads {mem.gradients / GiB:.1f}  optimizer "
            f"{mem.optimizer / GiB:.1f}  accumulation {mem.accumulation / GiB:.1f}  activations "
            f"{mem.activations / GiB:.1f}  backward {mem.backward / GiB:.1f}  logits {mem.logits / GiB:.1f}  "
            f"buffers {sum(mem.buffers.values()) / GiB:.1f} ({buffers})  => {mem.training_peak / GiB:.1f}; "
            f"optimizer step {mem.optimizer_step / GiB:.1f}  (pipeline stage {mem.stage})")


def largest_memory_terms(mem: MemoryBreakdown, count: int = 2) -> str:
    terms = {"weights": mem.weights, "gradients": mem.gradients, "optimizer state": mem.optimizer,
             "gradient accumulation": mem.accumulation, "activations": mem.activations, "backward": mem.backward,
             **{f"{k} buffers": v for k, v in mem.buffers.items()}}
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {value / GiB:.1f}" for name, value in top)


def time_line(t: StepTime) -> str:
    terms = "  ".join(f"{name} {getattr(t, term):.3g}" for term, name in (
        ("bubble", "bubble"), ("tp", "tp"), ("ep", "ep"), ("cp", "cp"), ("pp", "pp"), ("fsdp", "fsdp"),
        ("dp_sync", "dp sync"), ("optimizer", "optimizer")))
    return (f"time s       compute {t.compute:.3g} (recompute {t.recompute:.3g})  {terms}  => {t.step:.3g}  "
            f"(pipeline stage {t.stage} sets the pace)")


def limits(c: Candidate, cluster: Cluster) -> str:
    """What binds a layout: its largest overhead and, near the limit, its memory."""
    name, share = c.time.largest_overhead()
    used = c.memory.total / (cluster.usable_gib * GiB)
    text = f"largest overhead: {TERM_NAMES[name]} {share:.0%} of the step"
    if used >= MEMORY_BOUND:
        text += f"; memory {used:.0%} of usable"
    return text


def summary(c: Candidate, cluster: Cluster) -> str:
    missing = c.layout.not_implemented()
    marks = f"   [not runnable yet: {', '.join(missing)}]" if missing else ""
    return (f"{c.layout}, {c.policy.describe()}   {c.time.step:.3g} s/step  MFU {c.time.mfu(cluster):.0%}  "
            f"{c.memory.total / GiB:.1f} / {cluster.usable_gib:.1f} GiB{marks}")


def recommendation_lines(rec: Recommendation, cluster: Cluster, runners_up: int) -> list[str]:
    shape = rec.shape
    tokens = shape.sequences_per_step * shape.seq_len
    lines = [f"{rec.stage}: seq_len {shape.seq_len}, {shape.sequences_per_step} sequences ({tokens / 1e6:.2f}M tokens) "
             f"per step, micro_batch {shape.micro_batch}, {rec.steps} steps; {rec.considered} layouts x policies "
             f"priced, {len(rec.fitting)} layouts fit"]
    best = rec.best
    if rec.smallest is None:
        lines.append(f"  no layout of {cluster.gpus} GPUs runs this stage: dp = GPUs / (pp x cp x tp) must divide its "
                     f"{shape.sequences_per_step} sequences per step in micro-batches of {shape.micro_batch}, with tp "
                     f"<= {cluster.gpus_per_node} (a node), cp <= seq_len / {MIN_CP_TOKENS} and the model's "
                     "divisibility rules; choose a GPU count with more factors of two")
        return lines
    if best is None:
        s = rec.smallest
        lines.append(f"  no layout fits {cluster.usable_gib:.1f} GiB per GPU on {cluster.gpus} GPUs; the least memory: "
                     f"{summary(s, cluster)}")
        lines += [f"    {memory_line(s.memory)}",
                  f"    its largest terms: {largest_memory_terms(s.memory, 3)}; use more GPUs or GPUs with more memory"]
        return lines
    lines += [f"  best       {summary(best, cluster)}", f"             {memory_line(best.memory)}",
              f"             {time_line(best.time)}", f"             {limits(best, cluster)}"]
    if rec.faster_rejected:
        nearest = min(rec.faster_rejected, key=lambda c: c.memory.total)
        lines.append(f"             memory binds: {len(rec.faster_rejected)} faster layouts do not fit; the nearest, "
                     f"{nearest.layout}, {nearest.policy.describe()}, {nearest.time.step:.1f} s/step, needs "
                     f"{nearest.memory.total / GiB:.1f} GiB ({largest_memory_terms(nearest.memory)})")
    for i, c in enumerate(rec.runners_up(runners_up), start=2):
        slower = c.time.step / best.time.step - 1
        lines.append(f"  {i}.         {summary(c, cluster)} (+{slower:.1%}); {limits(c, cluster)}")
    hours = rec.steps * best.time.step / 3600
    lines.append(f"  stage time {hours:,.1f} h ({hours / 24:,.1f} days) on {cluster.gpus} GPUs")
    return lines
