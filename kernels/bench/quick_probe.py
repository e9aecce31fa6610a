"""Short device probe: which backward variant fits shared memory at d=128, forward timings, checks.

Used when device time is short (no fla: its autotuning takes minutes on a fresh machine).
"""
import sys
import time

import torch

sys.path.insert(0, "kernels/bench")
import bench_kda as b  # noqa: E402
from moe_lc_kernels import kda as K  # noqa: E402

dev = torch.device("cuda")
t_start = time.time()
base = dict(K.TUNING)
working = None
for variant in ("intra_prec=tf32", "intra_prec=tf32,intra_bv=16", "intra_prec=tf32,intra_bv=16,intra_warps=4",
                "intra_bv=16"):
    K.TUNING.clear(); K.TUNING.update(base)
    K.TUNING.update({k: (v if k in K._TEXT_TUNING else int(v)) for k, v in (i.split("=") for i in variant.split(","))})
    x, cu = b.make_inputs(1, 300, 2, 128, [100, 200], dev, torch.bfloat16, 1)
    h0 = torch.randn(2, 2, 128, 128, device=dev, requires_grad=True)
    try:
        errs = b.check(x, cu, h0, torch.float64, 2)
        print(f"bwd variant [{variant}] OK: max rel {max(errs.values()):.2e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in errs.items())})", flush=True)
        working = dict(K.TUNING)
        break
    except Exception as exc:  # noqa: BLE001
        print(f"bwd variant [{variant}] failed: {exc!r}"[:300], flush=True)
K.TUNING.clear(); K.TUNING.update(working or base)
for name in ["B8_T4K", "B2_T16K", "B1_T64K", "B1_T256K", "B2_T8K_H64", "B1_T32K_H64", "varlen_64K"]:
    if time.time() - t_start > 150:
        break
    B, T, H, docs = b.SHAPES[name]
    x, cu = b.make_inputs(B, T, H, 128, docs, dev, torch.bfloat16, 7)
    with torch.no_grad():
        f = b.time_fn(lambda: b.ours(x, cu), warmup=10, rep=40)
        f0 = b.time_fn(lambda: b.ours(x, cu, segment_chunks=0), warmup=10, rep=40)
    fb = float("nan")
    if working is not None:
        run = b.fwd_bwd(b.ours, x, cu)
        run.do = torch.randn_like(x["v"])
        try:
            fb = b.time_fn(run, warmup=10, rep=40)
        except Exception as exc:  # noqa: BLE001
            print(f"  fwd+bwd failed: {exc!r}"[:300])
    fl_f, _ = b.floor_ms(B, T, H, 128, False, 4.27e12, 679e12)
    fl_fb, _ = b.floor_ms(B, T, H, 128, True, 4.27e12, 679e12)
    print(f"{name}: fwd {f:.3f} ms (serial pass {f0:.3f}), fwd+bwd {fb:.3f} ms; floors {fl_f:.3f} / {fl_fb:.3f} ms",
          flush=True)
    del x
    torch.cuda.empty_cache()
x, cu = b.make_inputs(1, 65536, 16, 128, None, dev, torch.bfloat16, 3)
with torch.no_grad():
    o, s = b.ours(x, cu, final=True)
    ro, rs = b.reference(x, cu, None, torch.float32)
print(f"check B1_T64K forward vs fp32 torch reference: o {b.rel(o, ro):.2e} final {b.rel(s, rs):.2e}", flush=True)
