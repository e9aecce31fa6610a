"""Device probe: the d=128 backward against float64 (small) and fp32 (B8_T4K) references."""
import sys
import time

import torch

sys.path.insert(0, "kernels/bench")
import bench_kda as b  # noqa: E402

dev = torch.device("cuda")
for seed, (T, H, docs, seg) in enumerate([(300, 2, [100, 200], 2), (700, 4, None, 0), (1000, 1, [1, 63, 64, 65, 807], 3)]):
    x, cu = b.make_inputs(1, T, H, 128, docs, dev, torch.bfloat16, 11 + seed)
    h0 = torch.randn(b.num_seqs(1, cu), H, 128, 128, device=dev, requires_grad=True)
    t0 = time.time()
    try:
        errs = b.check(x, cu, h0, torch.float64, seg)
        print(f"d=128 bwd T={T} H={H} docs={docs} seg={seg}: max rel {max(errs.values()):.2e} "
              f"({', '.join(f'{k} {v:.1e}' for k, v in errs.items())}) [{time.time() - t0:.0f} s]", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"d=128 bwd FAILED: {exc!r}"[:1500], flush=True)
        sys.exit(0)
x, cu = b.make_inputs(8, 4096, 16, 128, None, dev, torch.bfloat16, 3)
h0 = torch.randn(8, 16, 128, 128, device=dev, requires_grad=True)
errs = b.check(x, cu, h0, torch.float32)
print(f"B8_T4K vs fp32 reference: max rel {max(errs.values()):.2e} ({', '.join(f'{k} {v:.1e}' for k, v in errs.items())})",
      flush=True)
