"""Time the model's KDA layer (``moe_lc.model.kda.KDAttention``) forward+backward on one GPU, per op
backend, as a training step runs it: projections, short convolutions, L2 norm and gate in PyTorch,
then ``chunk_kda``.

    python kernels/bench/bench_layer.py [--shapes B8_T4K,B1_T64K] [--d-model 2048] [--backends triton,fla]

``triton (gate read)`` times the triton backend with the gate's recorded floor ignored, so that the
bounded-gate check reads ``g.min()`` back to the host on every call: the cost of that stream sync.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import torch

sys.path.insert(0, "kernels/bench")
import bench_kda as b  # noqa: E402

from moe_lc.config import KDAConfig  # noqa: E402
from moe_lc.model.kda import KDAttention  # noqa: E402


@contextmanager
def gate_floors_ignored():
    import moe_lc_kernels.kda as kernels_kda

    saved = kernels_kda.known_gate_floor
    kernels_kda.known_gate_floor = lambda g: None
    try:
        yield
    finally:
        kernels_kda.known_gate_floor = saved


def time_layer(layer: KDAttention, x: torch.Tensor, cu_seqlens) -> float:
    grad = torch.randn_like(x)

    def step():
        layer(x, cu_seqlens).backward(grad)

    return b.time_fn(step, warmup=5, rep=30)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B8_T4K,B1_T64K")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--backends", default="triton,fla")
    args = p.parse_args()
    dev = torch.device("cuda")
    print("| shape | backend | layer f+b ms |\n|---|---|---|")
    for name in args.shapes.split(","):
        batch, seq_len, heads, docs = b.SHAPES[name]
        torch.manual_seed(0)
        layer = KDAttention(args.d_model, KDAConfig(num_heads=heads, head_dim=128)).to(dev, torch.bfloat16)
        x = torch.randn(batch, seq_len, args.d_model, device=dev, dtype=torch.bfloat16, requires_grad=True)
        _, cu = b.make_inputs(batch, seq_len, heads, 8, docs, dev, torch.bfloat16, 7)
        runs = [(backend, None) for backend in args.backends.split(",")]
        if "triton" in args.backends.split(","):
            runs.append(("triton", "gate read"))
        for backend, variant in runs:
            layer.cfg.backend = backend
            try:
                if variant:
                    with gate_floors_ignored():
                        ms = time_layer(layer, x, cu)
                else:
                    ms = time_layer(layer, x, cu)
                label = f"{backend} ({variant})" if variant else backend
                print(f"| {name} | {label} | {ms:.2f} |", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"| {name} | {backend} | FAILED {exc!r} |"[:400], flush=True)
        del layer, x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
