"""Time the AttnRes depth mixture forward+backward on one GPU: the reference eager, the reference
under ``torch.compile``, and the fused Triton kernels.

    python benchmarks/bench_depth_mixture.py [--tokens 16384] [--d 2048] [--sources 2,4,7]
                                             [--variants 'key=value,...;...'] [--no-compile]

The k3-small case: N tokens of width d, S sources, source 0 (the embedding) fp32 and the rest
(block sums) bf16, so the mixture and its gradient are fp32; query and norm weight fp32 [d].
Timing: forward, and forward+backward (what a training step runs; the backward is their
difference), each the median of ``triton.testing.do_bench`` (CUDA events per call after a warm-up
of --warmup-ms, calls for --rep-ms, L2 cleared between calls). GB/s is against the bytes
each pass must move at least: forward, every source read once, the mixture written once (and a,
r: fp32 [S, N] each); backward, the output gradient and every source read once, every source
gradient written once (and a, r read). The copy bandwidth of one large tensor, measured in the
same run, is the ceiling to read it against. Every Triton variant is checked against the eager
reference: the largest absolute difference of the output and of each gradient, relative to the
reference's largest element (both compute in fp32; the bf16 source gradients may differ by a
bf16 rounding, 2^-8 relative).

``--pre-norm``: instead, the mixture followed by the sublayer's RMSNorm (gain and eps 1e-6), as a
decoder layer runs it on the bf16 stream (every source bf16): the Triton mixture then the norm
eager, then the norm compiled (as ``compile.targets`` "norms" runs it), against the norm in the
mixture's kernels (``attn_res.fused_norm``); each checked against the first.

``--variants``: ';'-separated overrides of moe_lc_kernels.depth_mixture.TUNING, each timed as
another Triton row (with ``--pre-norm``, another row of the norm in the mixture's kernels; e.g.
'fwd_resident_max_d=0,bwd_resident_max_d=0' for the tiled kernels, 'fwd_rows=8,fwd_warps=8;l2_budget=16777216';
``programs=none`` sizes the grid from the L2 budget or, for the resident kernels, from ``*_resident_per_sm``). ``--device cpu`` is a smoke run of this script's logic (tiny sizes,
Triton's interpreter, wall-clock timing, no compile): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from torch import Tensor, nn

EPS = 1e-6


def parse_variant(text: str, known: dict) -> dict:
    """'key=value,...' as TUNING overrides: ints, or none for an optional entry."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"bench_depth_mixture: variant item {item!r}: expected key=value with key one of "
                             f"{sorted(known)}")
        out[key] = None if value.lower() == "none" else int(value)
    return out


def make_inputs(S: int, N: int, d: int, device: torch.device, seed: int = 0):
    """S sources [N, d] (source 0 fp32, the rest bf16), a trained-looking query and gain, an fp32 gradient."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    sources = [rnd(N, d).float()] + [rnd(N, d, scale=1.0 + i).bfloat16() for i in range(1, S)]
    sources = [v.requires_grad_() for v in sources]
    query = rnd(d, scale=0.05).requires_grad_()
    gain = (1 + rnd(d, scale=0.1)).requires_grad_()
    return sources, query, gain, rnd(N, d)


class ReferenceMixture(nn.Module):
    """The reference Function inside a module, for ``torch.compile`` (as the attn_res target compiles it)."""

    def forward(self, sources: list[Tensor], query: Tensor, gain: Tensor) -> Tensor:
        from moe_lc.ops.depth_mixture import depth_mixture_reference

        return depth_mixture_reference(sources, query, gain, EPS)


def variant_call(name: str) -> Callable[[list[Tensor], Tensor, Tensor], Tensor]:
    from moe_lc.ops.depth_mixture import depth_mixture, depth_mixture_reference

    if name == "reference eager":
        return lambda s, q, g: depth_mixture_reference(s, q, g, EPS)
    if name == "reference compiled":
        return torch.compile(ReferenceMixture())
    return lambda s, q, g: depth_mixture(s, q, g, EPS, backend="triton")


def timer(device: torch.device, warmup_ms: int, rep_ms: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn: ``triton.testing.do_bench`` on a GPU (CUDA events per call after a
    warm-up, L2 cleared between calls), the wall clock of a few calls elsewhere (the smoke run)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def wall_ms(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall_ms


def pass_bytes(sources: list[Tensor], out_dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes each pass must move at least (module docstring)."""
    n, S = sources[0].numel(), len(sources)
    src = sum(v.numel() * v.element_size() for v in sources)
    out = n * torch.empty((), dtype=out_dtype).element_size()
    scalars = 2 * S * (n // sources[0].shape[-1]) * 4
    return src + out + scalars, out + 2 * src + scalars


def copy_gbps(device: torch.device, time_ms: Callable[[Callable[[], object]], float], nbytes: int) -> float:
    """Read+write bandwidth of one device-to-device copy of ``nbytes``: the ceiling for the passes."""
    x = torch.empty(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / time_ms(lambda: y.copy_(x)) / 1e6


def run_once(call, sources, query, gain, grad) -> list[Tensor]:
    out = call(sources, query, gain)
    return [out.detach(), *torch.autograd.grad(out, [*sources, query, gain], grad)]


def relative_diffs(got: list[Tensor], ref: list[Tensor]) -> dict[str, float]:
    names = ["h", *(f"dv{i}" for i in range(len(got) - 3)), "dq", "dg"]
    return {name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for name, a, b in zip(names, got, ref)}


def time_variant(call, inputs, time_ms, gb: tuple[int, int]) -> dict:
    sources, query, gain, grad = inputs

    def fwd():
        return call(sources, query, gain)

    def fwd_bwd():
        torch.autograd.grad(call(sources, query, gain), [*sources, query, gain], grad)

    f_ms, fb_ms = time_ms(fwd), time_ms(fwd_bwd)
    b_ms = max(fb_ms - f_ms, 1e-9)
    return dict(fwd_ms=f_ms, bwd_ms=b_ms, fwd_bwd_ms=fb_ms, fwd_gbps=gb[0] / f_ms / 1e6, bwd_gbps=gb[1] / b_ms / 1e6,
                fwd_bwd_gbps=(gb[0] + gb[1]) / fb_ms / 1e6)


def print_table(rows: list[dict], copy: Optional[float]) -> None:
    if copy is not None:
        print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    head = f"{'S':>3} {'variant':<34} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd GB/s':>9} {'bwd GB/s':>9} " \
           f"{'f+b GB/s':>9}  max rel diff vs eager"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "failed" in r:
            print(f"{r['S']:>3} {r['variant']:<34} failed: {r['failed']}")
            continue
        diff = "" if not r.get("diff") else " ".join(f"{k} {v:.1e}" for k, v in r["diff"].items())
        print(f"{r['S']:>3} {r['variant']:<34} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['fwd_gbps']:9.0f} {r['bwd_gbps']:9.0f} {r['fwd_bwd_gbps']:9.0f}  {diff}")


def measured_row(S: int, name: str, call, inputs, reference: list[Tensor], time_ms, gb: tuple[int, int],
                 overrides: dict) -> dict:
    """One table row: ``call`` checked against ``reference`` and timed with ``overrides`` in TUNING (restored
    after); a launch choice that fails is a row saying so, not the end of the run."""
    import moe_lc_kernels.depth_mixture as kernels
    from moe_lc_kernels.tuning import launch_choices

    row = dict(S=S, variant=name)
    with launch_choices(kernels.TUNING, overrides):
        try:
            row["diff"] = relative_diffs(run_once(call, *inputs), reference)
            row.update(time_variant(call, inputs, time_ms, gb))
        except Exception as e:  # one bad launch choice must not lose the other rows
            row["failed"] = f"{type(e).__name__}: {e}"[:200]
    return row


def pre_norm_rows(S: int, N: int, d: int, device: torch.device, time_ms, compile_norm: bool,
                  variants: list[tuple[str, dict]]) -> list[dict]:
    """The mixture and its pre-norm, apart (eager, compiled norm) and in one set of kernels (``--pre-norm``),
    the last once more for each of ``variants`` (TUNING overrides)."""
    from moe_lc.model.norm import RMSNorm
    from moe_lc.ops.depth_mixture import depth_mixture

    sources, query, gain, grad = make_inputs(S, N, d, device)
    sources = [v.detach().bfloat16().requires_grad_() for v in sources]
    grad = grad.bfloat16()
    norm = RMSNorm(d, EPS).to(device)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(d, device=device))
    compiled = torch.compile(norm) if compile_norm else None  # the same module and weights, compiled
    calls = {"mixture, then the norm eager": lambda s, q, g: norm(depth_mixture(s, q, g, EPS, backend="triton"))}
    if compiled is not None:
        calls["mixture, then the norm compiled"] = lambda s, q, g: compiled(depth_mixture(s, q, g, EPS, backend="triton"))
    calls["the norm in the mixture's kernels"] = lambda s, q, g: depth_mixture(
        s, q, g, EPS, backend="triton", out_norm=(norm.weight, EPS))
    inputs = (sources, query, gain, grad)
    reference = run_once(calls["mixture, then the norm eager"], *inputs)
    gb = pass_bytes(sources, torch.bfloat16)
    fused = "the norm in the mixture's kernels"
    runs = [(name, call, {}) for name, call in calls.items()]
    runs += [(f"{fused} [{label}]", calls[fused], overrides) for label, overrides in variants if label]
    return [measured_row(S, name, call, inputs, reference, time_ms, gb, overrides) for name, call, overrides in runs]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--sources", default="2,4,7", help="comma-separated source counts")
    parser.add_argument("--variants", default="", help="';'-separated TUNING overrides, each another Triton row")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled reference")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--pre-norm", action="store_true", help="time the mixture with its pre-norm, apart and fused")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import
    elif not torch.cuda.is_available():
        print("bench_depth_mixture: no CUDA device (use --device cpu for a smoke run of the logic)", file=sys.stderr)
        return 2
    import moe_lc_kernels.depth_mixture as kernels

    started = time.perf_counter()
    device = torch.device(args.device)
    defaults = dict(kernels.TUNING)
    variants = [("", {})] + [(text.strip(), parse_variant(text, defaults)) for text in args.variants.split(";")
                             if text.strip()]
    time_ms = timer(device, args.warmup_ms, args.rep_ms)
    copy = copy_gbps(device, time_ms, 1 << 30) if device.type == "cuda" else None
    names = ["reference eager"] + ([] if args.no_compile or device.type != "cuda" else ["reference compiled"])
    rows = []
    if args.pre_norm:
        compile_norm = not args.no_compile and device.type == "cuda"
        for S in (int(s) for s in args.sources.split(",")):
            rows += pre_norm_rows(S, args.tokens, args.d, device, time_ms, compile_norm, variants)
        print(f"N = {args.tokens} tokens, d = {args.d}, every source bf16, then an RMSNorm; GB/s against the "
              f"mixture's own bytes; TUNING {defaults}")
        print_table(rows, copy)
        print(f"{time.perf_counter() - started:.0f} s in all (compilations included)")
        return 1 if any("failed" in r for r in rows) else 0
    for S in (int(s) for s in args.sources.split(",")):
        inputs = make_inputs(S, args.tokens, args.d, device)
        gb = pass_bytes(inputs[0], torch.float32)
        reference = run_once(variant_call("reference eager"), *inputs)
        for name in names:
            rows.append(dict(S=S, variant=name, **time_variant(variant_call(name), inputs, time_ms, gb)))
        for label, overrides in variants:
            rows.append(measured_row(S, "triton" + (f" [{label}]" if label else ""), variant_call("triton"), inputs,
                                     reference, time_ms, gb, overrides))
        del inputs, reference
    print(f"N = {args.tokens} tokens, d = {args.d}, source 0 fp32, the rest bf16; TUNING defaults {defaults}")
    print_table(rows, copy)
    print(f"{time.perf_counter() - started:.0f} s in all (compilations included)")
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
