"""Time the LM loss of training (``MoELCModel.chunked_lm_loss``) forward+backward on one GPU, per path.

    python benchmarks/bench_linear_cross_entropy.py [--preset k3-small] [--tokens 16384] [--rep 20] [--out lce.json]

The model's own loss code on its own LM head (the rest of the model stays on the meta device): fp32
head weights under bf16 autocast, the final hidden states [tokens, d] in ``--hidden-dtype`` (bf16: the
final norm's output now that the residual stream runs in autocast's dtype), labels with ~5% ignored.
Variants:

- ``checkpointed chunks``: ``fused_loss=False``, each chunk of ~``loss_chunk_elements`` logits under
  activation checkpointing (its head GEMM run again in backward; eager fp32 cross-entropy);
- ``fused, eager CE``: ``moe_lc.ops.linear_cross_entropy`` with the elementwise part in eager PyTorch;
- ``fused, compiled CE``: the same with it through ``torch.compile``;
- ``fused, triton CE``: the same with it in ``moe_lc_kernels.cross_entropy`` (online logsumexp, the
  gradient written over the logits; what "auto" runs on CUDA).

Per variant: forward+backward wall time (median of ``--rep`` after warm-up, CUDA events), the kernel
time and kernel count of one forward+backward (profiler), the peak memory above what was allocated
before it (the weight, h, labels), and the differences of the loss and of the gradients of h and W
against the checkpointed chunks (max |a - b| and norm-wise relative) and against float64 (the fused op
in float64, which tests/test_linear_cross_entropy.py checks against the formula). The bf16 paths sit
~5e-3 from float64 (bf16 operands, docs/testing.md's 1e-2); a difference between them far above that
is a bug. ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from moe_lc.model.transformer import IGNORE_INDEX, MoELCModel
from moe_lc.ops.linear_cross_entropy import linear_cross_entropy
from moe_lc.presets import get_preset

VARIANTS = {  # name: (fused_loss, loss_backend)
    "checkpointed chunks": (False, "auto"),
    "fused, eager CE": (True, "torch"),
    "fused, compiled CE": (True, "compiled"),
    "fused, triton CE": (True, "triton"),
}
REFERENCE = "checkpointed chunks"


@dataclass
class Row:
    name: str
    fwd_bwd_ms: Optional[float] = None
    kernel_ms: Optional[float] = None
    kernels: Optional[int] = None
    peak_mib: Optional[float] = None
    first_call_s: Optional[float] = None  # includes the compile of the compiled variant
    vs_checkpointed: dict = field(default_factory=dict)
    vs_float64: dict = field(default_factory=dict)
    failed: Optional[str] = None


def head_model(preset: str, device: torch.device) -> MoELCModel:
    """The preset's model on the meta device with a real LM head on ``device`` (init std, fp32)."""
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = MoELCModel(cfg)
    model.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False, device=device)
    with torch.no_grad():
        weight = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) * cfg.init_std
        model.lm_head.weight.copy_(weight)
    return model


def inputs(model: MoELCModel, tokens: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(1, tokens, model.cfg.d_model, device=device, generator=g).to(dtype)
    labels = torch.randint(0, model.cfg.vocab_size, (1, tokens), device=device, generator=g)
    labels[torch.rand(1, tokens, device=device, generator=g) < 0.05] = IGNORE_INDEX
    return h, labels


def step(model: MoELCModel, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward+backward of the loss under bf16 autocast: (loss, dL/dh, dL/dW)."""
    weight = model.lm_head.weight
    weight.grad = None
    x = h.detach().requires_grad_()
    with torch.autocast(h.device.type, dtype=torch.bfloat16):
        loss = model.chunked_lm_loss(x, labels)
    loss.backward()
    return loss.detach(), x.grad, weight.grad


def float64_reference(model: MoELCModel, h: torch.Tensor, labels: torch.Tensor):
    weight = model.lm_head.weight.detach().double().requires_grad_()
    x = h.detach().double().requires_grad_()
    loss = linear_cross_entropy(x, weight, labels, model.cfg.vocab_size, model.loss_chunk_tokens(), backend="torch")
    loss.backward()
    return loss.detach(), x.grad, weight.grad


def differences(got, want) -> dict:
    out = {}
    for name, a, b in zip(("loss", "dh", "dW"), got, want):
        a, b = a.double(), b.double()
        out[name] = {"max_abs": (a - b).abs().max().item(), "rel": ((a - b).norm() / b.norm()).item()}
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], rep: int, device: torch.device) -> float:
    times = []
    for _ in range(rep):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def kernel_time(fn: Callable[[], object], device: torch.device) -> tuple[Optional[float], Optional[int]]:
    """(ms of GPU kernels, their count) of one call, from the profiler (None off CUDA)."""
    if device.type != "cuda":
        return None, None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.self_device_time_total for e in kernels) / 1e3, len(kernels)


def peak_mib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def measure(model: MoELCModel, name: str, h, labels, rep: int, want64, reference) -> tuple[Row, tuple]:
    row = Row(name)
    model.fused_loss, model.loss_backend = VARIANTS[name]
    device = h.device
    run = lambda: step(model, h, labels)  # noqa: E731
    start = time.perf_counter()
    got = run()
    sync(device)
    row.first_call_s = time.perf_counter() - start
    got = tuple(t.clone() for t in got)
    model.lm_head.weight.grad = None
    row.peak_mib = peak_mib(run, device)
    for _ in range(3):
        run()
    row.fwd_bwd_ms = median_ms(run, rep, device)
    row.kernel_ms, row.kernels = kernel_time(run, device)
    row.vs_float64 = differences(got, want64)
    if reference is not None:
        row.vs_checkpointed = differences(got, reference)
    model.lm_head.weight.grad = None
    return row, got


def print_table(rows: list[Row]) -> None:
    def fmt(v, spec):
        return format("-", f">{spec.split('.')[0].rstrip('df')}") if v is None else format(v, spec)

    head = (f"{'variant':<22} {'fwd+bwd ms':>10} {'kernel ms':>9} {'kernels':>7} {'peak MiB':>9} {'1st call s':>10}  "
            f"{'vs checkpointed: loss / dh / dW (max |d|, rel)':<58} {'vs float64 rel: loss / dh / dW'}")
    print(head)
    for r in rows:
        if r.failed:
            print(f"{r.name:<22} FAILED: {r.failed}")
            continue
        ck = " ".join(f"{d['max_abs']:.1e},{d['rel']:.1e}" for d in r.vs_checkpointed.values()) or "-"
        f64 = " ".join(f"{d['rel']:.1e}" for d in r.vs_float64.values())
        print(f"{r.name:<22} {fmt(r.fwd_bwd_ms, '10.2f')} {fmt(r.kernel_ms, '9.2f')} {fmt(r.kernels, '7d')} "
              f"{fmt(r.peak_mib, '9.0f')} {fmt(r.first_call_s, '10.1f')}  {ck:<58} {f64}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="k3-small")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunk-elements", type=int, default=1 << 28, help="MoELCModel.loss_chunk_elements")
    parser.add_argument("--hidden-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rep", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_linear_cross_entropy: needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    model = head_model(args.preset, device)
    model.loss_chunk_elements = args.chunk_elements
    h, labels = inputs(model, args.tokens, getattr(torch, args.hidden_dtype), device)
    print(f"{args.preset}: tokens {args.tokens}, d {model.cfg.d_model}, vocab {model.cfg.vocab_size} "
          f"(head rows {model.cfg.padded_vocab_size}), {model.loss_chunk_tokens()} tokens per chunk, "
          f"h {args.hidden_dtype}, fp32 head under bf16 autocast, {int((labels != IGNORE_INDEX).sum())} label tokens")
    want64 = float64_reference(model, h, labels)
    rows, reference = [], None
    for name in sorted(args.variants, key=lambda n: n != REFERENCE):
        try:
            row, got = measure(model, name, h, labels, args.rep, want64, reference)
            reference = got if name == REFERENCE else reference
        except Exception as err:  # one variant failing still reports the others
            row = Row(name, failed=f"{type(err).__name__}: {err}")
        rows.append(row)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
