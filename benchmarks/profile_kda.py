"""Per-kernel time breakdown of chunked KDA (ours and fla) with the torch profiler.

Run from the repository root with the package installed (``pip install -e .``; fla optional):

    python benchmarks/profile_kda.py [--shapes B8_T4K,B1_T64K] [--impls ours,fla] [--iters 3] [--budget-s 400]

Prints, per shape and implementation, the CUDA time of every kernel per forward+backward
iteration (averaged over ``--iters``): which kernel the time goes to. Shapes and inputs are those
of ``bench_kda.py`` (same directory); ``--budget-s`` stops before a shape that would start later.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import bench_kda as b  # this script's directory is on sys.path when it runs as a script


def profile(fn, x, cu, iters: int) -> list[tuple[str, float, int]]:
    run = b.fwd_bwd(fn, x, cu)
    run.do = torch.randn_like(x["v"])
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.key and not ev.key.startswith("ProfilerStep"):
            rows.append((ev.key, t / 1e3 / iters, ev.count // iters))
    rows.sort(key=lambda r: -r[1])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B8_T4K,B1_T64K")
    p.add_argument("--impls", default="ours,fla")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=400)
    args = p.parse_args(argv)
    start = time.time()
    impls = {"ours": b.ours, "fla": b.fla_fn() if "fla" in args.impls else None}
    dev = torch.device("cuda")
    for impl in args.impls.split(","):
        fn = impls.get(impl)
        if fn is None:
            continue
        for name in args.shapes.split(","):
            if time.time() - start > args.budget_s:
                print("budget spent, stopping", flush=True)
                return 0
            B, T, H, docs = b.SHAPES[name]
            x, cu = b.make_inputs(B, T, H, 128, docs, dev, torch.bfloat16, 7)
            t0 = time.time()
            rows = profile(fn, x, cu, args.iters)
            total = sum(r[1] for r in rows)
            print(f"== {impl} {name}: fwd+bwd kernel time {total:.2f} ms/iter (first calls {time.time() - t0:.0f} s)",
                  flush=True)
            for key, ms, n in rows[:14]:
                print(f"   {ms:8.3f} ms  x{n:<3d} {key[:110]}", flush=True)
            del x
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
