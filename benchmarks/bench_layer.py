"""Time the model's KDA layer (``moe_lc.model.kda.KDAttention``) forward+backward on one GPU, as a
training step runs it (projections, short convolutions, KDA, output gate and norm), per op backend
and with the layer's fused paths switched off one by one, as controls in the same run.

Run from the repository root with the package installed (``pip install -e .``; fla optional):

    python benchmarks/bench_layer.py [--shapes B8_T4K,varlen_64K] [--d-model 2048] [--backends triton,fla]
                                     [--profile N]   # the N kernels with the most CUDA time, per shape

Shapes and inputs are those of ``bench_kda.py`` (same directory).

Variants (for the first backend): ``torch conv`` (the short convolutions and SiLU in plain PyTorch),
``unfused norm/gate`` (L2 norm, gate and beta sigmoid in PyTorch, then ``chunk_kda``), ``previous
layer`` (both), ``previous layer, gate read`` (and the bounded-gate check reading g.min() back to the
host: the stream sync that the recorded gate floor avoids).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack, contextmanager

import torch

import bench_kda as b  # this script's directory is on sys.path when it runs as a script
import moe_lc.model.kda as layer_module
from moe_lc.config import KDAConfig
from moe_lc.model.kda import KDAttention
from moe_lc.ops import kda_projections


@contextmanager
def patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def torch_conv():
    return patched(KDAttention, "conv_backend", lambda self: "torch")


def unfused(kda_backend: str):
    def composed(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound=-5.0, scale=None, initial_state=None,
                 output_final_state=False, docs=None, backend="auto"):
        return kda_projections._composed(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound,
                                         q.shape[-1] ** -0.5 if scale is None else scale, initial_state,
                                         output_final_state, docs, kda_backend=kda_backend)

    return patched(layer_module, "chunk_kda_from_projections", composed)


def gate_floors_ignored():
    """The bounded-gate check as it was before the kernels were given the gate's floor: read g.min()."""
    import moe_lc_kernels.kda as kernels_kda

    original = kernels_kda.gate_is_bounded
    return patched(kernels_kda, "gate_is_bounded", lambda g, lower_bound=None: original(g, None))


def variants(backend: str) -> dict:
    return {
        "torch conv": [torch_conv],
        "unfused norm/gate": [lambda: unfused(backend)],
        "previous layer": [torch_conv, lambda: unfused(backend)],
        "previous layer, gate read": [torch_conv, lambda: unfused(backend), gate_floors_ignored],
    }


def check_against_previous(layer: KDAttention, x: torch.Tensor, cu_seqlens, backend: str) -> str:
    """Relative difference of the output and every gradient, fused layer vs the previous layer."""
    grad = torch.randn_like(x)

    def run():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = layer(x, cu_seqlens)
        out.backward(grad)
        return [out.float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]

    fused = run()
    with ExitStack() as stack:
        for patch in variants(backend)["previous layer"]:
            stack.enter_context(patch())
        previous = run()
    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    errs = {n: ((a - b).norm() / b.norm()).item() for n, a, b in zip(names, fused, previous)}
    worst = max(errs, key=errs.get)
    return f"fused vs previous layer: out {errs['out']:.1e}, dx {errs['dx']:.1e}, worst {worst} {errs[worst]:.1e}"


def time_layer(layer: KDAttention, x: torch.Tensor, cu_seqlens) -> float:
    grad = torch.randn_like(x)

    def step():
        layer(x, cu_seqlens).backward(grad)

    return b.time_fn(step, warmup=5, rep=30)


def profile_layer(layer: KDAttention, x: torch.Tensor, cu_seqlens, top: int) -> None:
    grad = torch.randn_like(x)
    for _ in range(2):
        layer(x, cu_seqlens).backward(grad)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            layer(x, cu_seqlens).backward(grad)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    total = sum(e.device_time_total for e in prof.key_averages()) / 3e3
    print(f"layer kernel time {total:.2f} ms per f+b; top {top}:")
    for e in rows:
        print(f"  {e.device_time_total / 3e3:8.3f} ms  x{e.count // 3:<3d} {e.key[:110]}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B8_T4K,varlen_64K")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--backends", default="triton,fla")
    p.add_argument("--profile", type=int, default=0)
    args = p.parse_args()
    dev = torch.device("cuda")
    backends = args.backends.split(",")
    print("| shape | backend | variant | layer f+b ms |\n|---|---|---|---|")
    for name in args.shapes.split(","):
        batch, seq_len, heads, docs = b.SHAPES[name]
        torch.manual_seed(0)
        layer = KDAttention(args.d_model, KDAConfig(num_heads=heads, head_dim=128)).to(dev, torch.bfloat16)
        x = torch.randn(batch, seq_len, args.d_model, device=dev, dtype=torch.bfloat16, requires_grad=True)
        _, cu = b.make_inputs(batch, seq_len, heads, 8, docs, dev, torch.bfloat16, 7)
        layer.cfg.backend = backends[0]
        print(f"{name} {backends[0]}: {check_against_previous(layer, x, cu, backends[0])}", flush=True)
        runs = [(backend, "fused", []) for backend in backends]
        runs += [(backends[0], label, patches) for label, patches in variants(backends[0]).items()]
        for backend, label, patches in runs:
            layer.cfg.backend = backend
            try:
                with ExitStack() as stack:
                    for patch in patches:
                        stack.enter_context(patch())
                    ms = time_layer(layer, x, cu)
                print(f"| {name} | {backend} | {label} | {ms:.2f} |", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"| {name} | {backend} | {label} | FAILED {exc!r} |"[:400], flush=True)
        if args.profile:
            layer.cfg.backend = backends[0]
            profile_layer(layer, x, cu, args.profile)
        del layer, x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
