"""One MoE layer's sums of the routed experts' bf16 weight gradients into their fp32 ``.grad``, as
every micro-batch after a step's first does them (docs/performance.md §12.3).

    python benchmarks/bench_grad_accumulation.py [--preset k3-small] [--repeats 20]

Rows: the stacked gate/input gradient [E, 2h, l] added as its two halves (what the per-step casts'
backward hands each weight) or whole, and the output weight's [E, l, h], each by torch's ``add_``
and by ``moe_lc.ops.accumulate.accumulate_`` (the Triton kernel on CUDA); milliseconds of GPU time
per call and the bytes moved per second (10 bytes an element: read 4 + 2, write 4).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_expert_gemms import gpu_ms  # this folder is on sys.path when run as a script
from moe_lc.ops.accumulate import accumulate_
from moe_lc.presets import get_preset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grad_accumulation: needs a CUDA GPU", file=sys.stderr)
        return 2
    moe = get_preset(args.preset).moe
    experts, hidden, width = moe.num_routed, moe.expert_hidden, moe.latent_dim
    cuda = dict(device="cuda")
    stacked = torch.randn(experts, 2 * hidden, width, dtype=torch.bfloat16, **cuda)
    out = torch.randn(experts, width, hidden, dtype=torch.bfloat16, **cuda)
    gate, inp = torch.zeros(experts, hidden, width, **cuda), torch.zeros(experts, hidden, width, **cuda)
    whole, w_out = torch.zeros(experts, 2 * hidden, width, **cuda), torch.zeros(experts, width, hidden, **cuda)
    cases = {
        "gate/input, two halves": (lambda add: (add(gate, stacked[:, :hidden]), add(inp, stacked[:, hidden:])),
                                   stacked.numel()),
        "gate/input, whole": (lambda add: add(whole, stacked), stacked.numel()),
        "output": (lambda add: add(w_out, out), out.numel()),
    }
    adds = {"torch add_": lambda dst, src: dst.add_(src), "accumulate_": accumulate_}
    print(f"{args.preset}: {experts} experts, hidden {hidden}, latent {width}, {torch.cuda.get_device_name()}")
    print(f"| gradient | {' | '.join(f'{name} ms (TB/s)' for name in adds)} |")
    print(f"|---|{'---|' * len(adds)}")
    for label, (run, elements) in cases.items():
        cells = []
        for add in adds.values():
            ms = gpu_ms(lambda: run(add), args.repeats)
            cells.append(f"{ms:.3f} ({elements * 10 / ms / 1e9:.2f})")
        print(f"| {label} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
