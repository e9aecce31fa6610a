"""The short convolution's Triton kernels at the model's shapes, forward and forward + backward
(docs/performance.md §8).

    python benchmarks/bench_short_conv.py [--tuning bwd_bt=64,bwd_warps=8] [--repeats 20]

Shapes: KDA's stacked q, k, v convolution of one k3-small micro-batch (two 8K rows packed as one
row of 16,384 tokens with documents, 3 x 2048 channels written as three pieces) and the kernels'
older reference shape [8, 4096, 2048] without documents; width 4, SiLU, bf16. Each row gives
milliseconds of GPU time per call and the bytes a pass over the tensors moves per second (forward:
read x, write y; backward: read x and the output gradient, write dx). ``--tuning`` overrides
entries of ``moe_lc_kernels.short_conv.TUNING`` (several sets separated by ``;``, one row each).
Runs against whichever ``moe_lc`` is on the path, so an older tree can be timed with the same script.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_expert_gemms import gpu_ms  # this folder is on sys.path when run as a script
import moe_lc_kernels.short_conv as kernels
from moe_lc_kernels.tuning import launch_choices, parse_launch_choices
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.short_conv import short_conv_pieces

SHAPES = {  # name: (B, T, C, pieces, documents per row)
    "kda_qkv_B1_T16K_C6144_docs": (1, 16384, 6144, 3, 12),
    "B8_T4K_C2048": (8, 4096, 2048, 1, 0),
}


def parse_tunings(text: str) -> list[dict[str, int]]:
    """'a=1,b=2;c=3' -> [{'a': 1, 'b': 2}, {'c': 3}]; '' -> [{}] (the defaults)."""
    try:
        return [parse_launch_choices(part, kernels.TUNING, "short conv") for part in (text or "").split(";")]
    except ValueError as err:
        raise SystemExit(f"bench_short_conv: {err}") from None


def documents(T: int, count: int, seed: int) -> DocumentBounds | None:
    if count <= 1:
        return None
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=gen)[: count - 1].add(1).sort().values
    cu = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([T])]).to("cuda", torch.int32)
    return DocumentBounds.of(cu)


def time_shape(B: int, T: int, C: int, pieces: int, docs: int, repeats: int) -> tuple[float, float, float]:
    """(forward ms, forward + backward ms, GB one pass over [B, T, C] in bf16 moves)."""
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(B, T, C, **cuda, requires_grad=True)
    w = torch.randn(C, 4, device="cuda", requires_grad=True)
    bounds = documents(T, docs, seed=0)
    douts = [torch.randn(B, T, C // pieces, **cuda) for _ in range(pieces)]

    def forward():
        with torch.no_grad():
            return short_conv_pieces(x, w, pieces, bounds, activation="silu", backend="triton")

    def forward_backward():
        out = short_conv_pieces(x, w, pieces, bounds, activation="silu", backend="triton")
        torch.autograd.backward(out, douts)
        x.grad = w.grad = None

    return gpu_ms(forward, repeats), gpu_ms(forward_backward, repeats), x.numel() * 2 / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuning", default="", help="TUNING overrides, e.g. 'bwd_bt=64,bwd_warps=8;fwd_bc=128'")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_short_conv: needs a CUDA GPU", file=sys.stderr)
        return 2
    tunings = parse_tunings(args.tuning)
    names = [s for s in args.shapes.split(",") if s]
    if any(s not in SHAPES for s in names):
        raise SystemExit(f"bench_short_conv: unknown shape in {names}; choose from {list(SHAPES)}")
    defaults = dict(kernels.TUNING)
    print(f"{torch.cuda.get_device_name()}, bf16, width 4, SiLU; defaults {defaults}")
    print("| shape | tuning | fwd ms (TB/s) | bwd ms (TB/s) | fwd + bwd ms |")
    print("|---|---|---|---|---|")
    for name in names:
        for overrides in tunings:
            with launch_choices(kernels.TUNING, overrides):
                fwd, both, gb = time_shape(*SHAPES[name], repeats=args.repeats)
            bwd = both - fwd
            label = ",".join(f"{k}={v}" for k, v in overrides.items()) or "defaults"
            print(f"| {name} | {label} | {fwd:.3f} ({2 * gb / fwd:.2f}) | {bwd:.3f} ({3 * gb / bwd:.2f}) | {both:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
