"""Host time of the model's KDA layer and of its parts, per call, on one GPU.

`moe-lc bench --profile` measured the KDA layers of k3-small taking ~1.9x their kernel time on the
host (docs/performance.md §12.3), in a step whose GPU waits for the host. This says which part:
the whole layer (with `KDAConfig.fused_projections`, the default: x's six projections as two GEMMs
and q, k, v's convolutions as one; and without, six projections and three convolutions), the
recurrence (`chunk_kda_from_projections`: the fused Triton KDA, also called directly with its
segmented state passes automatic and off), one short convolution and one projection, each timed
from a drained GPU to the return of the call without waiting for its kernels (the host's issue
time), forward and backward, plus the layer's forward and backward under the profiler with the
ops by their own CPU time.

    python benchmarks/host_time_kda.py [--d-model 2048] [--heads 16] [--seq-len 8192] [--docs 8] [--repeats 7]

Run from the repository root with the package installed (or on PYTHONPATH with moe_lc_kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

from moe_lc.config import KDAConfig
from moe_lc.model.kda import KDAttention
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda_projections import chunk_kda_from_projections


def median_ms(run: Callable[[Any], object], repeats: int, prepare: Callable[[], Any] = lambda: None,
              finish: bool = False) -> float:
    """Median milliseconds of ``run(prepare())`` from a drained GPU to its return (the host's issue
    time, its kernels still running) or, with ``finish``, to the end of its kernels."""
    times = []
    for _ in range(repeats):
        prepared = prepare()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(prepared)
        if finish:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(times)


def document_bounds(seq_len: int, docs: int, device: torch.device):
    """``docs`` packed documents of uneven lengths (each a multiple of 64 plus a remainder)."""
    weights = torch.arange(1, docs + 1, dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * seq_len).round().long().tolist()
    bounds = [0] + [c - 7 * (i % 3) for i, c in enumerate(cuts[:-1])] + [seq_len]
    return DocumentBounds.from_host(bounds, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_time_kda.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    six = KDAConfig(num_heads=args.heads, head_dim=128, fused_projections=False)
    layer = KDAttention(args.d_model, six).to(dev)  # fp32 weights
    docs = document_bounds(args.seq_len, args.docs, dev)
    x = torch.randn(1, args.seq_len, args.d_model, device=dev, requires_grad=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    def layer_forward():
        with autocast:
            return layer(x, docs)

    out = layer_forward()
    grad = torch.randn_like(out)

    with autocast:  # the recurrence's inputs, as the layer makes them
        B, T, K = 1, args.seq_len, 128
        (q, k, v), (beta, decay_low, _) = layer.projections(x, docs)
        q, k, v = (t.view(B, T, -1, K) for t in (q, k, v))
        z = layer.decay_up(decay_low).view(B, T, -1, K)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, z, beta)]
    lower = layer.cfg.g_min

    def recurrence():
        o, _ = chunk_kda_from_projections(*leaves, layer.A_log, layer.dt_bias, lower_bound=lower, docs=docs)
        return o

    def fused(segment_chunks):  # the Triton KDA alone, its segmented state passes automatic or off
        from moe_lc_kernels.kda import chunk_kda_fused

        def call():
            o, _ = chunk_kda_fused(*leaves, layer.A_log, layer.dt_bias, lower_bound=lower, seq_bounds=docs.host,
                                   segment_chunks=segment_chunks)
            return o
        return call

    proj_in = layer.q_proj(x).detach().requires_grad_()

    def conv():
        with autocast:
            return layer.q_conv(proj_in, docs, activation="silu", backend="auto")

    def projection():
        with autocast:
            return layer.q_proj(x)

    fused_layer = KDAttention(args.d_model, KDAConfig(num_heads=args.heads, head_dim=128)).to(dev)
    fused_layer.load_state_dict(layer.state_dict())

    def fused_layer_forward():  # two GEMMs and one short convolution (KDAConfig.fused_projections)
        with autocast:
            return fused_layer(x, docs)

    parts = {"layer, six proj.": layer_forward, "layer (fused)": fused_layer_forward, "recurrence": recurrence,
             "kda, segments": fused(None), "kda, no segments": fused(0), "short conv": conv,
             "projection (q)": projection}
    print(f"KDA layer, d_model {args.d_model}, {args.heads} heads of 128, T {args.seq_len}, {args.docs} documents, "
          f"bf16 autocast over fp32 weights, {torch.cuda.get_device_name(dev)}; median of {args.repeats}")
    print(f"{'part':<16} {'fwd host':>9} {'bwd host':>9} {'fwd+bwd GPU':>12}  (ms)")
    for name, fn in parts.items():
        for _ in range(3):  # warm-up: Triton compiles, the allocator's cache
            _fwd_bwd(fn)
        fwd = median_ms(lambda _: fn(), args.repeats)

        def forward_and_seed():
            y = fn()
            return y, torch.ones_like(y)
        bwd = median_ms(lambda pair: pair[0].backward(pair[1]), args.repeats, prepare=forward_and_seed)
        total = median_ms(lambda _: _fwd_bwd(fn), args.repeats, finish=True)
        print(f"{name:<16} {fwd:>9.2f} {bwd:>9.2f} {total:>12.2f}")

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            y = layer_forward()
            y.backward(grad)
        torch.cuda.synchronize()
    print("\nthe layer's forward + backward (2 calls), ops by their own CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    return 0


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> None:
    y = fn()
    y.backward(torch.ones_like(y))


if __name__ == "__main__":
    raise SystemExit(main())
