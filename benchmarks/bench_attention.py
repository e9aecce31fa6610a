"""Time MLA-shaped attention over packed documents on one GPU, per backend of
``moe_lc.ops.attention``, and check each against an fp32 reference.

Run from the repository root (package installed, or ``PYTHONPATH=.``):

    python benchmarks/bench_attention.py [--out DIR] [--quick] [--heads 8,16] [--shapes T8K_docs8,...]

Inputs: bf16, q/k head size 192 (128 + 64 shared), v 128, scale 192 ** -0.5, B = 1 packed row.
Shapes: T = 8K with 8 documents, T = 64K with 24, T = 64K as one document; document lengths are
random cuts of the row (fixed seed). Per shape and head count it times forward and forward+backward
(``triton.testing.do_bench``, median, after warm-up; the first call compiles flex), the median
forward+backward over ``--fresh`` (3) batches of document lengths not seen before (as in training: a
repeated batch hides per-length setup such as cuDNN's plan for each new sequence length) and the
peak memory of one forward+backward above the inputs, for:

* ``loop``: one SDPA call per document (backend "torch"; on Hopper SDPA runs cuDNN's kernels, which
  build a plan for every new sequence length: ~0.1 s each on an H200 with torch 2.11, with or without
  ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``);
* ``padded``: the loop with each document padded to one of a few lengths (backend "padded"), so
  that cuDNN builds a plan per padded length once rather than one per new document length;
* ``flex``: flex attention with the document BlockMask (built once, outside the timing);
* ``varlen``: varlen_attn (FlashAttention-2, v zero-padded to 192), where torch has it;
* ``sdpa row``: one causal SDPA call over the whole row, documents ignored: a speed reference only
  (it computes attention across documents, so it is not a correct result).

It also times building each backend's mask (once per batch in training), reports which backend
"auto" picks, and, at a small size, each backend's largest error (output and gradients) against the
masked-softmax formula in fp32. A backend that is missing or fails is reported, not fatal. Prints a
table; everything goes to ``DIR/bench_attention.json`` (``DIR`` defaults to ``$OUT``, else ``.``).
``--quick`` times H = 8 only, with shorter timing windows; ``--shapes`` takes any ``T<n>K_docs<count>``
or ``T<n>K_single``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import traceback
from typing import Optional

import torch

from moe_lc.ops import attention as op
from moe_lc.ops.documents import upload

QK_DIM, V_DIM = 192, 128
SCALE = QK_DIM**-0.5
SHAPES = ("T8K_docs8", "T64K_docs24", "T64K_single")  # T<thousands>K_docs<count> or T<thousands>K_single
VARIANTS = ("loop", "padded", "flex", "varlen", "sdpa row")
VARIANT_BACKEND = {"loop": "torch", "padded": "padded", "flex": "flex", "varlen": "varlen", "sdpa row": "torch"}


def parse_shape(name: str) -> tuple[int, int]:
    """(T, documents) from a shape name such as T64K_docs24 or T64K_single."""
    match = re.fullmatch(r"T(\d+)K_(?:docs(\d+)|single)", name)
    if match is None:
        raise ValueError(f"bench_attention: shape {name!r} is not T<n>K_docs<count> or T<n>K_single (e.g. T64K_docs24)")
    return int(match.group(1)) * 1024, int(match.group(2) or 1)


def document_bounds(seq_len: int, documents: int, seed: int = 0) -> list[int]:
    """Boundaries of ``documents`` random-length documents filling the row (each >= 1 token)."""
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(seq_len - 1, generator=gen)[: documents - 1] + 1).sort().values.tolist()
    return [0] + cuts + [seq_len]


def make_inputs(seq_len: int, heads: int, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(dim):
        return torch.randn(1, heads, seq_len, dim, generator=gen).to(device, torch.bfloat16).requires_grad_()

    q, k, v = rnd(QK_DIM), rnd(QK_DIM), rnd(V_DIM)
    return q, k, v, torch.randn(1, heads, seq_len, V_DIM, generator=gen).to(device, torch.bfloat16)


def attention_flops(bounds: list[int], heads: int) -> float:
    """Forward+backward matmul FLOPs of causal attention within the given documents (backward = 2.5 x forward)."""
    pairs = sum((e - s) * (e - s + 1) / 2 for s, e in zip(bounds[:-1], bounds[1:]))
    return 3.5 * 2 * pairs * heads * (QK_DIM + V_DIM)


def call_for(variant: str, bounds: list[int], device):
    """(the attention call, {mask_build_ms, mask_first_build_s}) for one variant, the mask built once."""
    seq_len = bounds[-1]
    if variant == "sdpa row":
        return (lambda q, k, v: op.causal_document_attention(q, k, v, SCALE, backend="torch")), {
            "mask_build_ms": None, "mask_first_build_s": None}
    cu = upload(torch.tensor(bounds, dtype=torch.int32), device)
    build = lambda: op.document_mask(seq_len, cu_seqlens=cu, seq_bounds=bounds, device=device,  # noqa: E731
                                     backend=VARIANT_BACKEND[variant])
    started = time.perf_counter()
    mask = build()  # the first build compiles (flex)
    torch.cuda.synchronize()
    first_build_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(3):
        mask = build()
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - started) / 3 * 1e3
    timing = {"mask_build_ms": build_ms, "mask_first_build_s": first_build_s}
    return (lambda q, k, v: op.causal_document_attention(q, k, v, SCALE, mask=mask)), timing


def time_variant(variant: str, bounds: list[int], heads: int, device, warmup: int, rep: int, fresh: int) -> dict:
    from triton.testing import do_bench

    q, k, v, dout = make_inputs(bounds[-1], heads, device)
    attend, mask_timing = call_for(variant, bounds, device)

    def fwd_bwd():
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    started = time.time()
    fwd_bwd()  # compiles flex for this shape
    compile_s = time.time() - started
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    fwd_ms = do_bench(lambda: attend(q, k, v), warmup=warmup, rep=rep, return_mode="median")
    fb_ms = do_bench(fwd_bwd, warmup=warmup, rep=rep, return_mode="median")
    work = attention_flops(bounds if variant != "sdpa row" else [0, bounds[-1]], heads)
    documents = len(bounds) - 1
    fresh_ms = None if variant == "sdpa row" or documents == 1 else fresh_lengths_ms(
        variant, bounds[-1], documents, (q, k, v, dout), device, fresh)
    return {"fwd_ms": fwd_ms, "fwdbwd_ms": fb_ms, "tflops_fwdbwd": work / (fb_ms * 1e-3) / 1e12,
            "peak_gib": peak_gib, "first_call_s": compile_s, "fwdbwd_fresh_ms": fresh_ms, **mask_timing}


def fresh_lengths_ms(variant: str, seq_len: int, documents: int, tensors, device, calls: int) -> Optional[float]:
    """Median wall time of forward+backward over ``calls`` batches whose document lengths were not
    seen before, as in training (each batch packs new documents): the repeated-batch timing hides
    any per-length setup, such as cuDNN building an attention plan for every new sequence length."""
    if calls < 1:
        return None
    q, k, v, dout = tensors
    attends = [call_for(variant, document_bounds(seq_len, documents, seed=1000 + i), device)[0] for i in range(calls)]
    times = []
    for attend in attends:
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def reference_fp32(q, k, v, bounds):
    """softmax(q k^T * scale + M) v in fp32 from the formula; M from each token's document."""
    seq_len = q.shape[2]
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=q.device),
                                  torch.tensor(bounds, device=q.device).diff())
    i = torch.arange(seq_len, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (doc[:, None] == doc[None, :])
    scores = (q.float() @ k.float().transpose(-1, -2)) * SCALE
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.float()


def accuracy(device, available: dict) -> dict:
    """Largest absolute error (and relative Frobenius error) of output and gradients, per backend."""
    bounds = document_bounds(2048, 6, seed=1)
    q, k, v, dout = make_inputs(2048, 4, device, seed=1)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = reference_fp32(*leaves, bounds)
    ref_all = (ref, *torch.autograd.grad(ref, leaves, dout.float()))
    out = {}
    for variant in ("loop", "flex", "varlen"):
        if available[VARIANT_BACKEND[variant]] is not None:
            out[variant] = {"unavailable": available[VARIANT_BACKEND[variant]]}
            continue
        try:
            attend, _ = call_for(variant, bounds, device)
            o = attend(q, k, v)
            got = (o, *torch.autograd.grad(o, (q, k, v), dout))
            out[variant] = {
                name: {"max_abs": (g.float() - r).abs().max().item(),
                       "rel": ((g.float() - r).norm() / r.norm()).item()}
                for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref_all)
            }
        except Exception as e:  # report and go on: one broken backend must not hide the others
            out[variant] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="H = 8 only, shorter timing windows")
    parser.add_argument("--heads", default="8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="T<n>K_docs<count> or T<n>K_single, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--fresh", type=int, default=3, help="batches of new document lengths to time per case "
                        "(0: skip)")
    parser.add_argument("--budget-s", type=float, default=170, help="skip the timings that would start after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU here; this benchmark times GPU kernels (run it on a GPU machine)")
        return 1
    try:
        import triton.testing  # noqa: F401
    except ImportError:
        print("bench_attention: triton is not installed (do_bench times the runs); pip install triton")
        return 1
    device = torch.device("cuda")
    heads_list = [8] if args.quick else [int(h) for h in args.heads.split(",")]
    warmup, rep = (25, 100) if args.quick else (25, 150)
    try:
        shapes = {name: parse_shape(name) for name in args.shapes.split(",")}
    except ValueError as e:
        print(e)
        return 1
    available = {b: op.backend_unavailable_reason(b, device) for b in ("torch", "padded", "flex", "varlen")}
    report = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "python": platform.python_version(),
        "triton": getattr(sys.modules.get("triton"), "__version__", None), "head_dims": [QK_DIM, V_DIM],
        "available": available, "results": [],
        "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
        "auto": {"documents": op.resolve_backend("auto", device, True),
                 "long documents": op.resolve_backend("auto", device, True,
                                                      mean_document_length=op.PADDED_MIN_MEAN_LENGTH),
                 "no documents": op.resolve_backend("auto", device, False)},
    }
    for b, reason in available.items():
        print(f"bench_attention: {b}: {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"bench_attention: auto picks {report['auto']['documents']} with documents, "
          f"{report['auto']['long documents']} with documents of >= {op.PADDED_MIN_MEAN_LENGTH} tokens on average, "
          f"{report['auto']['no documents']} without", flush=True)
    started = time.time()
    report["accuracy"] = accuracy(device, available)
    print(f"bench_attention: accuracy checked [{time.time() - started:.0f} s]", flush=True)
    for name, (seq_len, documents) in shapes.items():
        bounds = document_bounds(seq_len, documents)
        for heads in heads_list:
            row = {"shape": name, "T": seq_len, "documents": documents, "H": heads, "max_len": max(
                e - s for s, e in zip(bounds[:-1], bounds[1:]))}
            for variant in args.variants.split(","):
                reason = available[VARIANT_BACKEND[variant]]
                if reason is not None:
                    row[variant] = {"unavailable": reason}
                elif time.time() - started > args.budget_s:
                    row[variant] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
                else:
                    try:
                        row[variant] = time_variant(variant, bounds, heads, device, warmup, rep, args.fresh)
                    except Exception as e:  # report and go on (a missing kernel, an OOM, a compile failure)
                        row[variant] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                        traceback.print_exc()
                    torch.cuda.empty_cache()
                print(f"bench_attention: {name} H={heads} {variant}: {summary(row[variant])} "
                      f"[{time.time() - started:.0f} s]", flush=True)
            report["results"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_tables(report)
    return 0


def summary(cell: dict) -> str:
    if "fwdbwd_ms" not in cell:
        return next(f"{k}: {v}" for k, v in cell.items())
    build = "-" if cell["mask_build_ms"] is None else f"{cell['mask_build_ms']:.2f} ms"
    first = "" if cell["mask_first_build_s"] is None else f" (first {cell['mask_first_build_s']:.1f} s)"
    fresh = "" if cell["fwdbwd_fresh_ms"] is None else f" (new lengths {cell['fwdbwd_fresh_ms']:.2f} ms)"
    return (f"fwd {cell['fwd_ms']:.2f} ms, fwd+bwd {cell['fwdbwd_ms']:.2f} ms{fresh} ({cell['tflops_fwdbwd']:.0f} "
            f"TFLOP/s), peak {cell['peak_gib']:.2f} GiB, mask {build}{first}, first call {cell['first_call_s']:.1f} s")


def print_tables(report: dict) -> None:
    cols = ("shape", "H", "variant", "fwd ms", "fwd+bwd ms", "TFLOP/s f+b", "vs loop f+b", "f+b new lengths ms",
            "peak GiB", "mask ms")
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in report["results"]:
        loop = row.get("loop", {}).get("fwdbwd_ms")
        for variant in VARIANTS:
            cell = row.get(variant)
            if cell is None:
                continue
            if "fwdbwd_ms" not in cell:
                print(f"| {row['shape']} | {row['H']} | {variant} | {summary(cell)} |" + " |" * (len(cols) - 4))
                continue
            ratio = f"{loop / cell['fwdbwd_ms']:.2f}x" if loop else "-"
            build = "-" if cell["mask_build_ms"] is None else f"{cell['mask_build_ms']:.2f}"
            fresh = "-" if cell["fwdbwd_fresh_ms"] is None else f"{cell['fwdbwd_fresh_ms']:.2f}"
            print(f"| {row['shape']} | {row['H']} | {variant} | {cell['fwd_ms']:.2f} | {cell['fwdbwd_ms']:.2f} | "
                  f"{cell['tflops_fwdbwd']:.0f} | {ratio} | {fresh} | {cell['peak_gib']:.2f} | {build} |")
    print("\n| backend | out max abs | dq max abs | dk max abs | dv max abs | out rel |\n|---|---|---|---|---|---|")
    for variant, cell in report["accuracy"].items():
        if "out" not in cell:
            print(f"| {variant} | {summary(cell)} | | | | |")
            continue
        print(f"| {variant} | " + " | ".join(f"{cell[n]['max_abs']:.2e}" for n in ("out", "dq", "dk", "dv"))
              + f" | {cell['out']['rel']:.2e} |")


if __name__ == "__main__":
    sys.exit(main())
