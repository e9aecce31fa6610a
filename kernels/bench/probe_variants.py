"""Device probe: time the forward prep alone and forward / forward+backward under TUNING variants.

    python kernels/bench/probe_variants.py [--shapes B8_T4K,B1_T64K] [--variants 'a=1,b=2;...']
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, "kernels/bench")
import bench_kda as b  # noqa: E402
from moe_lc_kernels import kda as K  # noqa: E402
from moe_lc_kernels import kda_triton as kt  # noqa: E402


def apply(variant: str, base: dict) -> None:
    K.TUNING.clear()
    K.TUNING.update(base)
    K.TUNING.update(K.parse_tuning(variant))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B8_T4K,B1_T64K")
    p.add_argument("--variants", default="")
    p.add_argument("--budget-s", type=float, default=200)
    args = p.parse_args()
    dev = torch.device("cuda")
    base = dict(K.TUNING)
    start = time.time()
    for name in args.shapes.split(","):
        B, T, H, docs = b.SHAPES[name]
        x, cu = b.make_inputs(B, T, H, 128, docs, dev, torch.bfloat16, 7)
        flat = [t.detach().reshape(B * T, *t.shape[2:]).contiguous() for t in (x["q"], x["k"], x["v"], x["z"], x["beta"])]
        lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
        plan = K.build_plan(lens, dev, None)
        flags = K._Flags(True, True, True, 128 ** -0.5, -5.0)
        cfg = K._config(flat[0], flat[2])
        for variant in ["", *filter(None, args.variants.split(";"))]:
            if time.time() - start > args.budget_s:
                print("budget spent", flush=True)
                return 0
            apply(variant, base)
            try:
                prep = b.time_fn(lambda: K._prep(kt, *flat, x["A_log"].detach(), x["dt_bias"].detach(), plan, flags,
                                                 cfg), warmup=5, rep=30)
                with torch.no_grad():
                    fwd = b.time_fn(lambda: b.ours(x, cu), warmup=5, rep=30)
                run = b.fwd_bwd(b.ours, x, cu)
                run.do = torch.randn_like(x["v"])
                fb = b.time_fn(run, warmup=5, rep=30)
                print(f"{name} [{variant or 'default'}]: prep {prep:.3f} ms, fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} [{variant or 'default'}]: FAILED {exc!r}"[:600], flush=True)
        del x, flat
        torch.cuda.empty_cache()
    apply("", base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
