"""The routed experts' grouped GEMMs in bf16 against float8 (``float8.experts=true``), per GEMM.

`moe-lc bench --trace` gives the dense GEMMs' float8 speed-up from the profiler's shape table; the
experts' float8 path is one op of several kernels (row-wise scales, casts, the scaled grouped GEMM,
and the padding of each expert's rows to multiples of 16), so it is timed here on its own, at a
preset's expert shapes, as training runs it: fp32 master weights, bf16 activations, the bf16 path
casting the stacked weights to bf16 as autocast does.

    python benchmarks/bench_expert_gemms.py [--preset k3-small] [--tokens 8192] [--repeats 20]
    python benchmarks/bench_expert_gemms.py --stacking --tokens 16384      # bf16 only, no torchao needed
    python benchmarks/bench_expert_gemms.py --orientations --tokens 16384  # bf16 only

Rows: each of the three GEMMs forward, and forward + backward (dx and dW), then the whole GLU
(three GEMMs, SiTU, and for float8 the padding) forward + backward; milliseconds of GPU time per
call, from CUDA events around back-to-back calls. The router's counts are drawn at random around
the balanced load (Quantile Balancing keeps them near it). Needs a GPU with FP8 tensor cores and
torchao.

``--stacking`` instead times, in bf16, the gate and input GEMMs as two grouped GEMMs or as one over
the weights stacked ([E, 2h, l], what the training step runs), with the weights stored [E, N, K]
(passed transposed) or [E, K, N], and the output GEMM, against a dense GEMM of the stacked shape:
ms and TFLOP/s forward and forward + backward.

``--orientations`` times, in bf16, each of the six grouped GEMMs a training step runs per MoE layer
(``moe_lc/ops/grouped_experts.py``: the stacked gate/input and the output GEMM, each forward, input
gradient and weight gradient) as the step calls it, beside the same product asked for the other way
round: the weight gradient transposed (``x^T dy`` for ``dy^T x``), the weight operand laid out the
other way. Which of them CUTLASS's tiles fit (an 896-wide side is 3.5 tiles of 256) is what decides.

``--batched`` times the stacked gate/input GEMM and the output GEMM as ``torch._grouped_mm`` runs them
against a batched GEMM (``torch.bmm``) over every expert's rows padded to one capacity: the largest
count of the draw (no row dropped), that rounded up to 128, and 1.25x the mean. TFLOP/s count only
the rows routed (the padding is work the batched GEMM wastes). A probe of whether a capacity layout
of the permuted tokens would pay (docs/performance.md §12.21): it would need the permutation to
write [E, C, d] with zeroed padding.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from moe_lc.ops.grouped_experts import expert_offsets, grouped_glu_mm
from moe_lc.ops.grouped_experts_float8 import (float8_grouped_mm, float8_unsupported_reason, pad_groups,
                                               padded_grouped_glu)
from moe_lc.ops.situ_glu import glu_activation
from moe_lc.presets import get_preset


def gpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """Milliseconds of GPU time per call of ``fn`` over ``repeats`` back-to-back calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def forward_backward(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    def call() -> None:
        for t in leaves:
            t.grad = None
        y = fn()
        y.backward(torch.ones_like(y))
    return call


def balanced_counts(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Random counts near rows / experts (multinomial over uniform experts), summing to ``rows``."""
    return torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts)


def padded_grouped_glu_one(inp: torch.Tensor, w: torch.Tensor, gmm, offsets: torch.Tensor) -> torch.Tensor:
    """One float8 grouped GEMM as the experts' path runs it: rows padded per expert, then the GEMM."""
    padded, padded_ends, new_index = pad_groups(inp, offsets)
    return gmm(padded, w.transpose(-2, -1), padded_ends).index_select(0, new_index)


def stacking_table(experts: int, width: int, hidden: int, rows: int, offsets: torch.Tensor, repeats: int) -> None:
    """The gate and input GEMMs split or stacked, per weight layout (bf16; see the module docstring)."""
    dev, bf16 = offsets.device, torch.bfloat16
    x = torch.randn(rows, width, device=dev, dtype=bf16, requires_grad=True)
    h_in = torch.randn(rows, hidden, device=dev, dtype=bf16, requires_grad=True)
    grads = {n: torch.randn(rows, n, device=dev, dtype=bf16) for n in (hidden, 2 * hidden, width)}

    def weight(n_out: int, n_in: int, stored_nk: bool) -> torch.Tensor:
        """[E, n_in, n_out] as the GEMM takes it: a transposed view of [E, n_out, n_in], or stored so."""
        shape = (experts, n_out, n_in) if stored_nk else (experts, n_in, n_out)
        w = (torch.randn(*shape, device=dev) * n_in ** -0.5).to(bf16).requires_grad_(True)
        return w.transpose(-2, -1) if stored_nk else w

    def gemm(inp, w):
        return torch._grouped_mm(inp, w, offs=offsets)

    print(f"{'weights':<8} {'GEMM':<22} {'fwd ms':>8} {'f+b ms':>8} {'fwd TFLOP/s':>12} {'f+b TFLOP/s':>12}")
    one = 2 * rows * width * hidden
    for stored_nk in (True, False):
        gate, inp_w = weight(hidden, width, stored_nk), weight(hidden, width, stored_nk)
        stacked, out = weight(2 * hidden, width, stored_nk), weight(width, hidden, stored_nk)
        cases = {
            "gate + input, split": (lambda: (gemm(x, gate), gemm(x, inp_w)), [grads[hidden]] * 2, 2 * one),
            "gate + input, stacked": (lambda: (gemm(x, stacked),), [grads[2 * hidden]], 2 * one),
            "output": (lambda: (gemm(h_in, out),), [grads[width]], one),
        }
        for name, (fn, cotangents, flops) in cases.items():
            fwd = gpu_ms(fn, repeats)
            both = gpu_ms(lambda: torch.autograd.backward(list(fn()), cotangents), repeats)
            print(f"{'[E,N,K]' if stored_nk else '[E,K,N]':<8} {name:<22} {fwd:8.3f} {both:8.3f} "
                  f"{flops / fwd / 1e9:12.1f} {3 * flops / both / 1e9:12.1f}")
    a = torch.randn(rows, width, device=dev, dtype=bf16)
    b = torch.randn(width, 2 * hidden, device=dev, dtype=bf16)
    dense = gpu_ms(lambda: a @ b, repeats)
    print(f"dense [{rows}, {width}] x [{width}, {2 * hidden}]: {dense:.3f} ms, "
          f"{2 * rows * width * 2 * hidden / dense / 1e9:.1f} TFLOP/s")


def orientations_table(experts: int, width: int, hidden: int, rows: int, offsets: torch.Tensor,
                       repeats: int) -> None:
    """The six grouped GEMMs of a MoE layer's step, each as the step runs it and the other way round."""
    dev, bf16 = offsets.device, torch.bfloat16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=bf16)

    def gmm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: torch._grouped_mm(a, b, offs=offsets)

    x, dy, h, dout = rand(rows, width), rand(rows, 2 * hidden), rand(rows, hidden), rand(rows, width)
    w_gi, w_o = rand(experts, 2 * hidden, width), rand(experts, width, hidden)  # as stored: [E, N, K]
    w_gi_t, w_o_t = w_gi.transpose(-2, -1).contiguous(), w_o.transpose(-2, -1).contiguous()  # [E, K, N]
    cases = [  # (GEMM, how, call, FLOPs)
        ("gate/input forward", "x W^T, W [E,N,K] (the step)", gmm(x, w_gi.transpose(-2, -1)), width * 2 * hidden),
        ("gate/input forward", "x W, W stored [E,K,N]", gmm(x, w_gi_t), width * 2 * hidden),
        ("gate/input dx", "dy W, W [E,N,K] (the step)", gmm(dy, w_gi), width * 2 * hidden),
        ("gate/input dx", "dy W, W stored [E,K,N]", gmm(dy, w_gi_t.transpose(-2, -1)), width * 2 * hidden),
        ("gate/input dW", "dy^T x -> [E,2h,l] (the step)", gmm(dy.t(), x), width * 2 * hidden),
        ("gate/input dW", "x^T dy -> [E,l,2h]", gmm(x.t(), dy), width * 2 * hidden),
        ("output forward", "h W^T, W [E,N,K] (the step)", gmm(h, w_o.transpose(-2, -1)), width * hidden),
        ("output forward", "h W, W stored [E,K,N]", gmm(h, w_o_t), width * hidden),
        ("output dh", "dout W, W [E,N,K] (the step)", gmm(dout, w_o), width * hidden),
        ("output dh", "dout W, W stored [E,K,N]", gmm(dout, w_o_t.transpose(-2, -1)), width * hidden),
        ("output dW", "dout^T h -> [E,l,h] (the step)", gmm(dout.t(), h), width * hidden),
        ("output dW", "h^T dout -> [E,h,l]", gmm(h.t(), dout), width * hidden),
    ]
    print(f"{'GEMM':<20} {'how':<32} {'ms':>7} {'TFLOP/s':>8}")
    for name, how, call, per_row in cases:
        ms = gpu_ms(call, repeats)
        print(f"{name:<20} {how:<32} {ms:7.3f} {2 * rows * per_row / ms / 1e9:8.1f}")


def batched_table(experts: int, width: int, hidden: int, counts: torch.Tensor, repeats: int,
                  dev: torch.device) -> None:
    """Grouped against capacity-padded batched GEMMs, stacked gate/input and output (bf16, [E, N, K] weights)."""
    bf16 = torch.bfloat16
    rows = int(counts.sum())
    offsets = expert_offsets(counts, dev)
    mean, largest = rows / experts, int(counts.max())
    capacities = {"largest count": largest, "largest, to 128": -(-largest // 128) * 128,
                  "1.25x the mean": int(1.25 * mean)}
    print(f"counts: mean {mean:.0f}, largest {largest} ({largest / mean:.3f}x the mean)")
    print(f"{'GEMM':<24} {'layout':<26} {'fwd ms':>8} {'f+b ms':>8} {'fwd TFLOP/s':>12} {'f+b TFLOP/s':>12}")
    for name, n_in, n_out in (("stacked gate + input", width, 2 * hidden), ("output", hidden, width)):
        w = (torch.randn(experts, n_out, n_in, device=dev) * n_in ** -0.5).to(bf16).requires_grad_(True)
        flops = 2 * rows * n_in * n_out
        x = torch.randn(rows, n_in, device=dev, dtype=bf16, requires_grad=True)
        dy = torch.randn(rows, n_out, device=dev, dtype=bf16)
        cases = {"grouped": (lambda x=x, w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets), x, dy)}
        for label, cap in capacities.items():
            xb = torch.randn(experts, cap, n_in, device=dev, dtype=bf16, requires_grad=True)
            cases[f"batched, {label} ({cap})"] = (lambda xb=xb, w=w: torch.bmm(xb, w.transpose(-2, -1)), xb,
                                                  torch.randn(experts, cap, n_out, device=dev, dtype=bf16))
        for label, (fn, inp, cot) in cases.items():
            fwd = gpu_ms(fn, repeats)
            both = gpu_ms(lambda fn=fn, cot=cot: torch.autograd.backward([fn()], [cot]), repeats)
            print(f"{name:<24} {label:<26} {fwd:8.3f} {both:8.3f} {flops / fwd / 1e9:12.1f} "
                  f"{3 * flops / both / 1e9:12.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-small")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--stacking", action="store_true", help="the gate and input GEMMs split or stacked (bf16)")
    p.add_argument("--batched", action="store_true", help="grouped against capacity-padded batched GEMMs (bf16)")
    p.add_argument("--orientations", action="store_true", help="each of a layer's six grouped GEMMs, both ways round")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_expert_gemms.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    moe = get_preset(args.preset).moe
    E, d, h, rows = moe.num_routed, moe.latent_dim, moe.expert_hidden, args.tokens * moe.top_k
    counts = balanced_counts(rows, E, torch.Generator().manual_seed(0))
    offsets = expert_offsets(counts, dev)
    header = (f"{args.preset} routed experts: {E} experts, {rows} rows ({args.tokens} tokens x top-{moe.top_k}), "
              f"{torch.cuda.get_device_name(dev)}; ms of GPU time per call")
    if args.stacking:
        print(header)
        stacking_table(E, d, h, rows, offsets, args.repeats)
        return 0
    if args.orientations:
        print(header)
        orientations_table(E, d, h, rows, offsets, args.repeats)
        return 0
    if args.batched:
        print(header)
        batched_table(E, d, h, counts, args.repeats, dev)
        return 0
    x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w_gate, w_in = (torch.randn(E, h, d, device=dev) * d ** -0.5 for _ in range(2))
    w_out = torch.randn(E, d, h, device=dev) * h ** -0.5
    for w in (w_gate, w_in, w_out):
        w.requires_grad_(True)
    reason = float8_unsupported_reason(x, w_gate)
    if reason is not None:
        print(f"bench_expert_gemms.py: {reason}", file=sys.stderr)
        return 2
    fp8 = float8_grouped_mm()
    hidden_in = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def bf16_gemm(inp, w):  # autocast's cast of the fp32 master weights, then the grouped GEMM
        return lambda: torch._grouped_mm(inp, w.to(torch.bfloat16).transpose(-2, -1), offs=offsets)

    def fp8_gemm(inp, w):  # the float8 path pads every expert's rows to multiples of 16 first
        return lambda: padded_grouped_glu_one(inp, w, fp8, offsets)

    act = lambda a, c: glu_activation(a, c, moe.activation, moe.situ_beta1, moe.situ_beta2)  # noqa: E731
    gemms = {
        f"gate  [{rows}, {d}] x [{E}, {d}, {h}]": (x, w_gate),
        f"in    [{rows}, {d}] x [{E}, {d}, {h}]": (x, w_in),
        f"out   [{rows}, {h}] x [{E}, {h}, {d}]": (hidden_in, w_out),
    }
    print(header)
    print(f"{'GEMM':<40} {'bf16 fwd':>9} {'fp8 fwd':>9} {'x':>6} {'bf16 f+b':>9} {'fp8 f+b':>9} {'x':>6}")
    for name, (inp, w) in gemms.items():
        leaves = [inp, w]
        fwd = [gpu_ms(make(inp, w), args.repeats) for make in (bf16_gemm, fp8_gemm)]
        both = [gpu_ms(forward_backward(make(inp, w), leaves), args.repeats) for make in (bf16_gemm, fp8_gemm)]
        print(f"{name:<40} {fwd[0]:9.3f} {fwd[1]:9.3f} {fwd[0] / fwd[1]:6.2f} {both[0]:9.3f} {both[1]:9.3f} "
              f"{both[0] / both[1]:6.2f}")
    leaves = [x, w_gate, w_in, w_out]
    bf16_glu = lambda: grouped_glu_mm(x, offsets, *(w.to(torch.bfloat16) for w in (w_gate, w_in, w_out)), act)  # noqa: E731
    fp8_glu = lambda: padded_grouped_glu(x, offsets, w_gate, w_in, w_out, act, fp8)  # noqa: E731
    glu = [gpu_ms(forward_backward(fn, leaves), args.repeats) for fn in (bf16_glu, fp8_glu)]
    print(f"{'whole GLU (3 GEMMs, ' + moe.activation + '), fwd+bwd':<40} {'':>9} {'':>9} {'':>6} {glu[0]:9.3f} "
          f"{glu[1]:9.3f} {glu[0] / glu[1]:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
