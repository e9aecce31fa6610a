"""The routed experts' weight gradients of a later micro-batch, at k3-small's shapes: how they run now
(``torch._grouped_mm`` writes them in bf16, ``accumulate_`` adds them into the fp32 ``.grad``) against
one Triton grouped GEMM that adds into the fp32 sum itself (``moe_lc_kernels.grouped_wgrad``).

    python benchmarks/bench_grouped_wgrad.py [--tuning "bm=128,bn=256,warps=8;..."] [--repeats 20]

Shapes: one micro-batch of two 8K rows, top-8 of 64 experts (131,072 rows sorted by expert, counts
drawn around the mean), the stacked gate/input gradient [64, 1792, 1024] and the output one
[64, 1024, 896]. Each row: ms per call, TFLOP/s of the GEMM's 2 T M N, and the largest difference
from the current path's sum (fp32 against bf16-rounded products: ~2^-9 of an entry). ``--tuning``
overrides entries of the kernel's TUNING (sets separated by ``;``, one row each).
"""

from __future__ import annotations

import argparse

import torch

from bench_expert_gemms import gpu_ms  # this folder is on sys.path when run as a script
import moe_lc_kernels.grouped_wgrad as gw
from moe_lc.ops.accumulate import accumulate_
from moe_lc_kernels.tuning import launch_choices, parse_launch_choices

EXPERTS, ROWS = 64, 131072
SHAPES = {"gate_in [64, 1792, 1024]": (1792, 1024), "out [64, 1024, 896]": (1024, 896)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuning", default="", help="TUNING overrides, sets separated by ';' ('' = defaults)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    try:
        tunings = [parse_launch_choices(part, gw.TUNING, "grouped wgrad") for part in args.tuning.split(";")]
    except ValueError as err:
        raise SystemExit(f"bench_grouped_wgrad: {err}") from None
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.distributions.Dirichlet(torch.full((EXPERTS,), 200.0)).sample() * ROWS
    counts = counts.round().long()
    counts[-1] += ROWS - counts.sum()
    ends = counts.cumsum(0).to(torch.int32).cuda()
    print(f"| shape | path | ms | TFLOP/s | max abs diff |\n|---|---|---|---|---|")
    for name, (m, n) in SHAPES.items():
        dy = torch.randn(ROWS, m, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(ROWS, n, device="cuda", generator=g).to(torch.bfloat16)
        grad = torch.zeros(EXPERTS, m, n, device="cuda")
        flops = 2 * ROWS * m * n

        def current() -> None:
            accumulate_(grad, torch._grouped_mm(dy.t(), x, offs=ends))

        ms = gpu_ms(current, args.repeats)
        grad.zero_()
        current()
        want = grad.clone()
        print(f"| {name} | _grouped_mm bf16 + accumulate_ | {ms:.3f} | {flops / ms / 1e9:.0f} | |")
        gemm_ms = gpu_ms(lambda: torch._grouped_mm(dy.t(), x, offs=ends), args.repeats)
        print(f"| {name} | _grouped_mm bf16 alone | {gemm_ms:.3f} | {flops / gemm_ms / 1e9:.0f} | |")
        for tuning in tunings:
            label = ",".join(f"{k}={v}" for k, v in tuning.items()) or "defaults"
            with launch_choices(gw.TUNING, tuning):
                try:
                    ms = gpu_ms(lambda: gw.grouped_wgrad_([grad], dy, x, ends, accumulate=True), args.repeats)
                    grad.zero_()
                    gw.grouped_wgrad_([grad], dy, x, ends, accumulate=True)
                    diff = (grad - want).abs().max().item()
                    print(f"| {name} | triton, fp32 sum in the GEMM ({label}) | {ms:.3f} | {flops / ms / 1e9:.0f} "
                          f"| {diff:.3g} |")
                except Exception as err:  # a launch the GPU refuses (shared memory): report it, try the next
                    print(f"| {name} | triton ({label}) | failed: {type(err).__name__}: {str(err)[:80]} | | |")


if __name__ == "__main__":
    main()
