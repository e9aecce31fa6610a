"""Check and time chunked KDA on one GPU: ours (Triton), fla 0.6.0 (when installed), torch reference.

Run from the repository root with the package installed (``pip install -e .``; optionally
``pip install fla-core==0.6.0`` for the baseline):

    python benchmarks/bench_kda.py [--out DIR] [--no-torch] [--no-check] [--shapes NAME,...]
                                   [--variants 'key=value,...;...'] [--seg-sweep] [--fla-fuzz N] [--keep-states]

Everything runs with the raw-projection API (in-kernel L2 norm, bounded gate, beta sigmoid), bf16
inputs, H=16 and d=128 unless the shape says otherwise. Per shape it
1. times forward and forward+backward with ``triton.testing.do_bench`` (median) and prints ms,
   tokens/s, the ratio to fla and the fraction of the memory/compute floor, where the floor uses
   the copy bandwidth and bf16 matmul rate measured at the start of the same run;
2. checks ours (free memory poisoned with NaN first) against a reference: the fp32 torch chunk
   reference at the benchmark shapes, and the float64 one on a fuzz of small random cases
   (lengths, documents, initial states, segmentations), forward output, final state and every
   gradient;
3. optionally times launch-choice variants (``--variants``, TUNING overrides of
   ``moe_lc_kernels.kda``, each against the defaults in the same run) and segment sizes
   (``--seg-sweep``).
Results, the launch choices used and every compiled kernel's registers / spills / shared memory go
to ``DIR/bench_kda.json`` as well. ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import time

import torch

from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import chunk_kda as reference_chunk_kda
from moe_lc.ops.kda import kda_gate
from moe_lc_kernels.kda import CHUNK, TUNING, chunk_kda_fused
from moe_lc_kernels.tuning import launch_choices

LOWER_BOUND = -5.0
SHAPES = {  # name: (B, T, H, per-document lengths or None)
    "B8_T4K": (8, 4096, 16, None),
    "B2_T16K": (2, 16384, 16, None),
    "B1_T64K": (1, 65536, 16, None),
    "B1_T256K": (1, 262144, 16, None),
    "B2_T8K_H64": (2, 8192, 64, None),
    "B1_T32K_H64": (1, 32768, 64, None),
    "varlen_64K": (1, 65536, 16, "random"),
    # k3-small-8k's micro-batch: two 8K rows packed flat, as one or two documents each
    "rows_2x8K": (1, 16384, 16, [8192, 8192]),
    "rows_4docs": (1, 16384, 16, [7772, 420, 5788, 2404]),
}


# ----------------------------------------------------------------------------- inputs
def make_inputs(batch, seq_len, heads, dim, docs, device, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rnd(batch, seq_len, heads, dim), rnd(batch, seq_len, heads, dim), rnd(batch, seq_len, heads, dim)
    z = rnd(batch, seq_len, heads, dim, scale=2.0)
    beta = rnd(batch, seq_len, heads)
    a_log = (0.5 * torch.randn(heads, generator=gen)).to(device).requires_grad_()
    dt_bias = torch.randn(heads * dim, generator=gen).to(device).requires_grad_()
    cu = None
    if docs == "random":
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, seq_len), 23))
        cu = DocumentBounds.from_host([0, *cuts, seq_len], device)
    elif docs is not None:
        cu = DocumentBounds.from_host([0, *torch.tensor(docs).cumsum(0).tolist()], device)
    return dict(q=q, k=k, v=v, z=z, beta=beta, A_log=a_log, dt_bias=dt_bias), cu


def num_seqs(batch, cu):
    return batch if cu is None else cu.num_docs


# ----------------------------------------------------------------------------- implementations
def ours(x, cu, h0=None, final=False, segment_chunks=None, keep_states=False):
    return chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"], LOWER_BOUND,
                           initial_state=h0, output_final_state=final, seq_bounds=None if cu is None else cu.host,
                           segment_chunks=segment_chunks, keep_states=keep_states)


def fla_fn():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as exc:  # noqa: BLE001
        print(f"fla not available: {exc!r}")
        return None

    def run(x, cu, h0=None, final=False):
        return fla_chunk_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], initial_state=h0, output_final_state=final,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=LOWER_BOUND, A_log=x["A_log"], dt_bias=x["dt_bias"],
                             cu_seqlens=None if cu is None else cu.cu_seqlens.long())

    return run


def reference(x, cu, h0=None, dtype=torch.float64):
    """The moe_lc.ops.kda torch chunk reference on upcast inputs, same gate/norm formulas."""
    up = {n: t.to(dtype) for n, t in x.items()}
    qn = up["q"] / torch.sqrt((up["q"] ** 2).sum(-1, keepdim=True) + 1e-6)
    kn = up["k"] / torch.sqrt((up["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    g = kda_gate(up["z"], up["A_log"], up["dt_bias"], lower_bound=LOWER_BOUND)
    return reference_chunk_kda(qn, kn, up["v"], g, torch.sigmoid(up["beta"]),
                               initial_state=None if h0 is None else h0.to(dtype), output_final_state=True,
                               docs=cu, backend="torch")


# ----------------------------------------------------------------------------- checks
def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")  # NaN also marks an element the kernels never wrote (see poison_free_memory)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def poison_free_memory(nbytes):
    """Fill the caching allocator's free blocks with NaN, so outputs the kernels never write show up."""
    torch.cuda.synchronize()
    blocks = [torch.full((nbytes // 4 // 8,), float("nan"), device="cuda") for _ in range(8)]
    del blocks


def check(x, cu, h0, ref_dtype, seg=None, keep_states=False):
    """Max relative error over o, final state and all gradients (ours vs reference)."""
    params = list(x.values()) + ([h0] if h0 is not None else [])
    poison_free_memory(24 * sum(t.numel() * t.element_size() for t in params))
    o, s = ours(x, cu, h0, True, seg, keep_states)
    do = torch.randn_like(o)
    ds = torch.randn_like(s)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (s * ds).sum(), params)
    ro, rs = reference(x, cu, h0, ref_dtype)
    rgrads = torch.autograd.grad((ro * do.to(ref_dtype)).sum() + (rs * ds.to(ref_dtype)).sum(), params)
    names = list(x.keys()) + (["h0"] if h0 is not None else [])
    errs = {"o": rel(o, ro), "final_state": rel(s, rs)}
    errs.update({f"d{n}": rel(a, b) for n, a, b in zip(names, grads, rgrads)})
    return errs


def fla_errors(fla):
    """fla's errors against the same float64 reference (the baseline's own accuracy)."""

    def run(x, cu, h0):
        params = list(x.values()) + ([h0] if h0 is not None else [])
        o, s = fla(x, cu, h0, True)
        gen = torch.Generator(device="cpu").manual_seed(5)
        do = torch.randn(o.shape, generator=gen).to(o.device)
        ds = torch.randn(s.shape, generator=gen).to(o.device)
        grads = torch.autograd.grad((o.float() * do).sum() + (s.float() * ds).sum(), params, allow_unused=True)
        ro, rs = reference(x, cu, h0, torch.float64)
        rgrads = torch.autograd.grad((ro * do.double()).sum() + (rs * ds.double()).sum(), params)
        names = list(x.keys()) + (["h0"] if h0 is not None else [])
        errs = {"o": rel(o, ro), "final_state": rel(s, rs)}
        errs.update({f"d{n}": (rel(a, b) if a is not None else float("inf")) for n, a, b in zip(names, grads, rgrads)})
        return errs

    return run


def fuzz(device, trials, seed=1, fla_check=None, fla_trials=2, keep_states=False):
    """Random shapes, lengths, documents, states and segmentations against the float64 reference."""
    rng = random.Random(seed)
    worst = 0.0
    rows = []
    for t in range(trials):
        torch.manual_seed(1000 + seed + t)  # initial states and cotangents too: reruns see the same case
        heads = rng.choice([1, 2, 4])
        dim = rng.choice([64, 128])
        n_docs = rng.choice([1, 1, 2, 5])
        lens = [rng.randint(1, 700) for _ in range(n_docs)]
        total = sum(lens)
        docs = lens if n_docs > 1 else None
        x, cu = make_inputs(1, total, heads, dim, docs, device, torch.bfloat16, seed + t)
        h0 = torch.randn(num_seqs(1, cu), heads, dim, dim, device=device, requires_grad=True) if rng.random() < 0.5 else None
        seg = rng.choice([0, 1, 2, 3])
        try:
            errs = check(x, cu, h0, torch.float64, seg, keep_states)
        except Exception as exc:  # noqa: BLE001
            print(f"fuzz {t}: FAILED {exc!r}"[:2000], flush=True)
            errs = {"error": float("inf")}
        bad = max(errs.values())
        worst = max(worst, bad) if not math.isnan(bad) else float("nan")
        rows.append(dict(lens=lens, heads=heads, dim=dim, h0=h0 is not None, seg=seg, max_rel=bad))
        print(f"fuzz {t}: lens={lens} H={heads} d={dim} h0={h0 is not None} seg={seg} max rel {bad:.2e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in errs.items())})", flush=True)
        if fla_check is not None and t < fla_trials:
            fla_errs = fla_check(x, cu, h0)
            rows[-1]["fla"] = fla_errs
            print(f"  fla on the same inputs: max rel {max(fla_errs.values()):.2e} "
                  f"({', '.join(f'{k} {v:.1e}' for k, v in fla_errs.items())})", flush=True)
    return worst, rows


# ----------------------------------------------------------------------------- timing
def ceilings(device):
    from triton.testing import do_bench

    n = 1 << 30  # 2 GiB bf16 copy: bytes read + written
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    bandwidth = 2 * a.numel() * 2 / (ms * 1e-3)
    del a, b
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    w = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: m @ w, warmup=50, rep=200, return_mode="median")
    flops = 2 * 8192**3 / (ms * 1e-3)
    return bandwidth, flops


def floor_ms(batch, seq_len, heads, dim, backward, bandwidth, flops):
    """Fewest bytes (inputs read once, outputs written once, bf16) and fewest matmul FLOPs."""
    tokens = batch * seq_len
    tensors = 5 + (9 if backward else 0)  # fwd: q k v z -> o; bwd: q k v z do -> dq dk dv dz
    bytes_ = tokens * heads * dim * 2 * tensors
    c = CHUNK
    per_chunk = 2 * (c * c * dim / 2 * 2 + c * c * dim + 3 * c * dim * dim + c * c * dim / 2)
    work = per_chunk * tokens / c * heads * (3 if backward else 1)
    return max(bytes_ / bandwidth, work / flops) * 1e3, ("memory" if bytes_ / bandwidth > work / flops else "compute")


def time_fn(fn, warmup=25, rep=100):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_once(fn):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def fwd_bwd(fn, x, cu):
    params = list(x.values())

    def run():
        o, _ = fn(x, cu)
        torch.autograd.grad(o, params, run.do)

    run.do = None
    return run


def bench_shape(name, impls, bandwidth, flops, device, with_torch):
    batch, seq_len, heads, docs = SHAPES[name]
    dim = 128
    x, cu = make_inputs(batch, seq_len, heads, dim, docs, device, torch.bfloat16, 7)
    tokens = batch * seq_len
    result = {"shape": name, "B": batch, "T": seq_len, "H": heads, "docs": None if cu is None else cu.num_docs}
    for label, fn in impls.items():
        if fn is None or (label == "torch" and not with_torch):
            continue
        started = time.time()
        print(f"bench {name} {label}: timing (first calls compile)", flush=True)
        if label != "torch":
            with torch.no_grad():
                fwd_ms = time_fn(lambda: fn(x, cu))
            print(f"bench {name} {label}: forward timed after {time.time() - started:.0f} s", flush=True)
        o, _ = fn(x, cu)
        run = fwd_bwd(fn, x, cu)
        run.do = torch.randn_like(o)
        del o
        if label == "torch":  # seconds per call at long T: one warm-up, one timed run
            fwd_ms = time_once(lambda: fn(x, cu))
            fb_ms = time_once(run)
        else:
            fb_ms = time_fn(run)
        result[label] = {"fwd_ms": fwd_ms, "fwdbwd_ms": fb_ms}
        print(f"bench {name} {label}: fwd {fwd_ms:.2f} ms, fwd+bwd {fb_ms:.2f} ms [{time.time() - started:.0f} s]",
              flush=True)  # per row, so that a run cut short by a time limit still reports what it timed
        torch.cuda.empty_cache()
    for kind, backward in (("fwd_ms", False), ("fwdbwd_ms", True)):
        fl, bound = floor_ms(batch, seq_len, heads, dim, backward, bandwidth, flops)
        result[f"floor_{kind}"] = fl
        result[f"floor_{kind}_bound"] = bound
    result["tokens"] = tokens
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-torch", action="store_true", help="skip timing the torch reference")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--fuzz", type=int, default=12)
    parser.add_argument("--seg-sweep", action="store_true", help="time segment lengths at the long shapes")
    parser.add_argument("--variants", default="", help="';'-separated TUNING overrides to time, e.g. "
                        "'bwd_prec=tf32x3;prep_warps=4,prep_bk=32'")
    parser.add_argument("--seg-shapes", default="B1_T64K")
    parser.add_argument("--fla-fuzz", type=int, default=0, help="fuzz cases also checked with fla (fla re-autotunes for "
                        "every new head count / dim: minutes each on a fresh machine)")
    parser.add_argument("--fuzz-variant", default="", help="TUNING override for a second, shorter fuzz")
    parser.add_argument("--keep-states", action="store_true", help="ours with keep_states (the forward keeps the "
                        "per-chunk states; activation_checkpointing.kda_states) in the table, checks and fuzz")
    parser.add_argument("--variant-shapes", default="B8_T4K,B1_T64K")
    parser.add_argument("--check-shapes", default="B8_T4K,B2_T16K,B1_T64K,B1_T256K,B2_T8K_H64,varlen_64K")
    parser.add_argument("--budget-s", type=float, default=480, help="skip the checks, fuzz and sweeps that would "
                        "start after this many seconds (the timing table always runs first)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    import triton

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "tuning": dict(TUNING)}  # the launch choices the table ran with (MOE_LC_KDA_TUNING included)
    try:
        import fla

        report["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        report["fla"] = None
    print(report, flush=True)
    started = time.time()

    def in_budget(phase: str) -> bool:
        """Whether to start ``phase``; the report so far is written either way."""
        save(args.out, report)
        if time.time() - started < args.budget_s:
            return True
        print(f"skipping {phase}: {time.time() - started:.0f} s of the {args.budget_s:.0f} s budget spent", flush=True)
        return False

    bandwidth, flops = ceilings(device)
    report.update(copy_bandwidth_TBps=bandwidth / 1e12, bf16_matmul_TFLOPs=flops / 1e12)
    print(f"measured ceilings: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)

    impls = {"ours": functools.partial(ours, keep_states=args.keep_states), "fla": fla_fn(), "torch": lambda x, cu: reference(x, cu, None, torch.float32)}
    results = []
    for name in args.shapes.split(","):
        if not name or not in_budget(f"timing {name}"):
            continue
        try:
            r = bench_shape(name, impls, bandwidth, flops, device, not args.no_torch)
        except Exception as exc:  # noqa: BLE001
            print(f"bench {name}: FAILED {exc!r}"[:2000], flush=True)
            continue
        results.append(r)
        print(json.dumps(r), flush=True)
        print_table([r])
    report["results"] = results
    if not args.no_check and in_budget("checks"):
        report["checks"] = {}
        for name in args.check_shapes.split(","):
            if not name:
                continue
            batch, seq_len, heads, docs = SHAPES[name]
            x, cu = make_inputs(batch, seq_len, heads, 128, docs, device, torch.bfloat16, 3)
            h0 = torch.randn(num_seqs(batch, cu), heads, 128, 128, device=device, requires_grad=True)
            t0 = time.time()
            errs = check(x, cu, h0, torch.float32, keep_states=args.keep_states)
            report["checks"][name] = errs
            print(f"check {name} vs fp32 torch reference: max rel {max(errs.values()):.2e} "
                  f"({', '.join(f'{k} {v:.1e}' for k, v in errs.items())}) [{time.time() - t0:.0f} s]", flush=True)
            del x, h0
            torch.cuda.empty_cache()

    if not args.no_check and in_budget("fuzz"):
        t0 = time.time()
        fla = fla_fn()
        worst, rows = fuzz(device, args.fuzz, fla_check=fla_errors(fla) if fla is not None else None,
                           fla_trials=args.fla_fuzz, keep_states=args.keep_states)
        if args.fuzz_variant:
            from moe_lc_kernels import kda as kda_mod

            with launch_choices(kda_mod.TUNING, kda_mod.parse_tuning(args.fuzz_variant)):
                print(f"fuzz with {args.fuzz_variant}:", flush=True)
                report["fuzz_variant"] = fuzz(device, 4)
        report["fuzz"] = {"worst_rel": worst, "trials": rows}
        print(f"fuzz worst rel vs float64: {worst:.2e} ({time.time() - t0:.0f} s)", flush=True)
    if args.variants and in_budget("variants"):
        from moe_lc_kernels import kda as kda_mod

        rows = []
        timed = functools.partial(ours, keep_states=args.keep_states)
        for variant in ["", *args.variants.split(";")]:
            with launch_choices(kda_mod.TUNING, kda_mod.parse_tuning(variant)):
                for name in args.variant_shapes.split(","):
                    batch, seq_len, heads, docs = SHAPES[name]
                    x, cu = make_inputs(batch, seq_len, heads, 128, docs, device, torch.bfloat16, 7)
                    with torch.no_grad():
                        f_ms = time_fn(lambda: timed(x, cu))
                    run = fwd_bwd(timed, x, cu)
                    run.do = torch.randn_like(x["v"])
                    fb_ms = time_fn(run)
                    rows.append(dict(variant=variant or "default", shape=name, fwd_ms=f_ms, fwdbwd_ms=fb_ms))
                    print(f"variant [{variant or 'default'}] {name}: fwd {f_ms:.2f} ms fwd+bwd {fb_ms:.2f} ms",
                          flush=True)
        report["variants"] = rows

    if args.seg_sweep and in_budget("seg sweep"):
        sweep = []
        for name in args.seg_shapes.split(","):
            batch, seq_len, heads, docs = SHAPES[name]
            x, cu = make_inputs(batch, seq_len, heads, 128, docs, device, torch.bfloat16, 7)
            for seg in (0, 16, 32, 64, None):
                fn = lambda x, cu, seg=seg: ours(x, cu, segment_chunks=seg)  # noqa: E731
                with torch.no_grad():
                    f_ms = time_fn(lambda: fn(x, cu))
                run = fwd_bwd(fn, x, cu)
                run.do = torch.randn_like(x["v"])
                fb_ms = time_fn(run)
                sweep.append(dict(shape=name, segment_chunks=seg, fwd_ms=f_ms, fwdbwd_ms=fb_ms))
                print(f"seg sweep {name} seg={seg}: fwd {f_ms:.2f} ms fwd+bwd {fb_ms:.2f} ms", flush=True)
        report["seg_sweep"] = sweep

    try:
        report["kernels"] = kernel_resources()
        for name, meta in report["kernels"].items():
            print(f"{name}: {meta}")
    except Exception as exc:  # noqa: BLE001
        print(f"kernel resource report failed: {exc!r}")
    save(args.out, report)
    print_table(results)


def save(out_dir: str, report: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_kda.json"), "w") as f:
        json.dump(report, f, indent=1)


def kernel_resources():
    """Registers, spills and shared memory of every compiled kernel (from Triton's caches)."""
    from moe_lc_kernels import kda_triton as kt

    out = {}
    for name in dir(kt):
        fn = getattr(kt, name)
        caches = getattr(fn, "device_caches", None)
        if not name.endswith("_kernel") or not caches:
            continue
        for cache in caches.values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for i, compiled in enumerate(getattr(kernels, "values", lambda: [])()):
                meta = {a: getattr(compiled, a, None) for a in ("n_regs", "n_spills")}
                meta["shared"] = getattr(getattr(compiled, "metadata", None), "shared", None)
                meta["num_warps"] = getattr(getattr(compiled, "metadata", None), "num_warps", None)
                out[f"{name}[{i}]"] = meta
    return out


def print_table(results):
    cols = ("shape", "impl", "fwd ms", "fwd+bwd ms", "Mtok/s f+b", "vs fla f+b", "vs fla fwd", "floor f+b")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        fla = r.get("fla")
        for impl in ("ours", "fla", "torch"):
            if impl not in r:
                continue
            m = r[impl]
            ratio_fb = f"{fla['fwdbwd_ms'] / m['fwdbwd_ms']:.2f}x" if fla else "-"
            ratio_f = f"{fla['fwd_ms'] / m['fwd_ms']:.2f}x" if fla else "-"
            floor = f"{r['floor_fwdbwd_ms'] / m['fwdbwd_ms'] * 100:.1f}% ({r['floor_fwdbwd_ms_bound']})"
            print(f"| {r['shape']} | {impl} | {m['fwd_ms']:.2f} | {m['fwdbwd_ms']:.2f} | "
                  f"{r['tokens'] / m['fwdbwd_ms'] / 1e3:.1f} | {ratio_fb} | {ratio_f} | {floor} |")


if __name__ == "__main__":
    sys.exit(main())
