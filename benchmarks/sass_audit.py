"""What the project's Triton kernels compile to on a Hopper GPU, from a machine without one.

Runs the kernels' launchers at k3-small's shapes on CPU tensors with Triton's driver replaced by
one that compiles for sm_90 and launches nothing (``JITFunction.run`` with ``warmup``), then reads
each compiled kernel's resource usage (``cuobjdump``, shipped with Triton) and its SASS
(``nvdisasm``): registers a thread, its stack frame and the STL/LDL instructions (where registers
spill: cuobjdump's LOCAL counts only explicit local arrays), shared memory, instructions.
A kernel that spills at its default launch choices is slower than it should be; the GPU's own
measurements stay the judge of speed (docs/performance.md), this only says where to look.

    python benchmarks/sass_audit.py                       # every op below
    python benchmarks/sass_audit.py --ops router,sort     # some of them

The outputs are not computed (nothing runs), so launchers whose choices depend on values would
see garbage; the ones here choose from shapes only. Needs Triton with its NVIDIA backend
(the pip package has it) and must run without TRITON_INTERPRET (its kernels are then
interpreted functions, not compiled ones).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

TOKENS, D, LATENT, HIDDEN, EXPERTS, TOP_K, HEADS, HEAD_DIM = 16384, 2048, 1024, 896, 64, 8, 16, 128


@dataclass
class Compiled:
    kernel: str
    constexprs: dict
    warps: int
    stages: int
    registers: int
    stack_bytes: int  # a thread's stack frame: where spilled registers go
    spill_instructions: int  # STL/LDL: stores and loads of spilled values
    shared_bytes: int
    instructions: int


class _CompileOnlyDriver:
    """The parts of Triton's driver that compiling (not launching) asks for, for one GPU target."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_only(arch: int = 90) -> Iterator[list]:
    """Inside, every Triton launch compiles for sm_``arch`` and returns without running; yields the list
    of (kernel name, constexpr and launch keyword arguments, CompiledKernel) it fills."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("sass_audit: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    compiled: list = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")},
                         kernel))
        return kernel

    previous = getattr(driver, "_active", None)  # None on a machine without a GPU: no driver to restore
    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = run
    try:
        yield compiled
    finally:
        JITFunction.run = original
        driver._active = previous


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(name: str, kernel) -> Compiled:
    """Registers, local and shared bytes and the SASS instruction count of one compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))  # noqa: E731
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    spills = sum(1 for line in lines if re.search(r"\b(STL|LDL)\b", line))
    meta = kernel.metadata
    return Compiled(name, {}, meta.num_warps, meta.num_stages, field("REG"), field("STACK") + field("LOCAL"), spills,
                    meta.shared, len(lines))


# -- the ops, at k3-small's shapes (one micro-batch of 16K tokens) ----------------------------------

# The MoE ops also launch at the smallest sizes, one token or one block: the JIT compiles an integer
# argument equal to 1 as a constant (a Python int inside the kernel, where ``.to()`` fails), which the
# interpreter the kernel tests run never does (a one-block sort failed that way on the GPU).
EDGE_TOKENS = (TOKENS, 1, 3)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def _situ() -> None:
    from moe_lc_kernels.situ_glu import situ_glu_stacked_triton

    for tokens in EDGE_TOKENS:
        rows = tokens * TOP_K
        y = _bf16(rows, 2 * HIDDEN).requires_grad_(True)
        situ_glu_stacked_triton(y).backward(_bf16(rows, HIDDEN))


def _output_gate() -> None:
    """KDA's gated output norm (heads of HEAD_DIM) and MLA's plain gate, each gate a column slice."""
    from moe_lc_kernels.output_gate import gated_output_triton

    gate = _bf16(TOKENS, 64 + HEADS * HEAD_DIM)[:, 64:]
    for weight, shape in ((torch.ones(HEAD_DIM, requires_grad=True), (TOKENS, HEADS, HEAD_DIM)),
                          (None, (TOKENS, HEADS * HEAD_DIM))):
        x = _bf16(*shape).requires_grad_(True)
        gated_output_triton(x, gate.view(shape), weight).backward(_bf16(*shape))


def _router() -> None:
    from moe_lc_kernels.routing import route_backward_triton, route_statistics_triton, route_triton

    for tokens in EDGE_TOKENS:
        logits, bias = _bf16(tokens, EXPERTS), torch.zeros(EXPERTS)
        idx = torch.randint(0, EXPERTS, (tokens, TOP_K))
        route_triton(logits, bias, TOP_K, 1.0)
        route_backward_triton(logits, idx, torch.randn(tokens, TOP_K), 1.0)
        route_statistics_triton(logits, bias, idx, torch.randn(tokens), torch.zeros(EXPERTS, dtype=torch.int64),
                                torch.zeros(EXPERTS, 1024, dtype=torch.int64), torch.zeros(2, dtype=torch.float64))


def _sort() -> None:
    from moe_lc_kernels.token_permutation import sort_by_expert_triton

    for tokens in EDGE_TOKENS:
        sort_by_expert_triton(torch.randint(0, EXPERTS, (tokens, TOP_K)), EXPERTS)
    sort_by_expert_triton(torch.randint(0, 4, (1, 1)), 4)  # one slot: n == 1


def _permutation() -> None:
    from moe_lc_kernels.token_permutation import combine_backward_triton, sum_token_rows_triton

    for tokens in EDGE_TOKENS:
        rows = torch.randperm(tokens * TOP_K).view(tokens, TOP_K)
        out, weights = _bf16(tokens * TOP_K, LATENT), torch.rand(tokens, TOP_K)
        sum_token_rows_triton(out, rows, weights, torch.bfloat16)
        combine_backward_triton(_bf16(tokens, LATENT), out, rows, weights)


def _short_conv() -> None:
    """KDA's stacked q, k, v convolution at the default launch choices, then its forward on the row kernel."""
    from moe_lc_kernels import short_conv
    from moe_lc_kernels.short_conv import short_conv_triton_pieces
    from moe_lc_kernels.tuning import launch_choices

    x = _bf16(1, TOKENS, 3 * HEADS * HEAD_DIM).requires_grad_(True)
    pos = torch.arange(TOKENS, dtype=torch.int32) % 8192
    pieces = short_conv_triton_pieces(x, torch.randn(3 * HEADS * HEAD_DIM, 4), 3, pos)
    torch.autograd.backward(pieces, [torch.ones_like(p) for p in pieces])
    with launch_choices(short_conv.TUNING, dict(rows=1, fwd_bt=128, fwd_bc=256)), torch.no_grad():
        short_conv_triton_pieces(x, torch.randn(3 * HEADS * HEAD_DIM, 4), 3, pos)


def _depth_mixture() -> None:
    from moe_lc_kernels.depth_mixture import depth_mixture_triton

    for count in (2, 3, 4, 5, 6, 7):  # k3-small's mixers have 2 to 6 sources; 7 the most a block mode of 8 blocks reaches
        for out_norm in (None, (torch.ones(D, requires_grad=True), 1e-6)):  # the mixture alone, and with its pre-norm
            sources = [_bf16(1, TOKENS, D).requires_grad_(True) for _ in range(count)]
            h = depth_mixture_triton(sources, torch.randn(D, requires_grad=True), torch.ones(D, requires_grad=True),
                                     1e-6, out_norm=out_norm)
            h.backward(torch.ones_like(h))


def _accumulate() -> None:
    from moe_lc_kernels.accumulate import accumulate_rows_triton

    for rows in (EXPERTS * HIDDEN, 1):
        accumulate_rows_triton(torch.zeros(rows, LATENT), _bf16(rows, 2 * LATENT), rows, LATENT, 2 * LATENT)


def _mla_keys() -> None:
    from moe_lc_kernels.mla_keys import mla_keys_triton

    kv = _bf16(1, TOKENS, HEADS, 256).requires_grad_(True)  # k3-small's MLA: 16 heads, nope 128 + v 128, key 64
    wide = _bf16(1, TOKENS, 64 + 512).requires_grad_(True)
    k, v = mla_keys_triton(kv, wide[..., :64], 128)
    torch.autograd.backward((k, v), (torch.ones_like(k).transpose(1, 2).contiguous().transpose(1, 2), torch.ones_like(v)))


def _cross_entropy() -> None:
    from moe_lc_kernels.cross_entropy import cross_entropy_rows

    labels = torch.randint(0, 65536, (64,))  # k3-small's vocabulary; rows are independent programs
    cross_entropy_rows(_bf16(64, 65536), labels, -100, torch.bfloat16)
    cross_entropy_rows(_bf16(64, 65536), labels, -100)


def _grouped_wgrad() -> None:
    from moe_lc_kernels.grouped_wgrad import grouped_wgrad_

    ends = torch.arange(1, EXPERTS + 1, dtype=torch.int32) * 64  # rows per expert do not change the code
    rows = 64 * EXPERTS
    gate, up = torch.zeros(EXPERTS, HIDDEN, LATENT), torch.zeros(EXPERTS, HIDDEN, LATENT)
    grouped_wgrad_([gate, up], _bf16(rows, 2 * HIDDEN), _bf16(rows, LATENT), ends, accumulate=True)
    grouped_wgrad_([torch.zeros(EXPERTS, LATENT, HIDDEN)], _bf16(rows, LATENT), _bf16(rows, HIDDEN), ends,
                   accumulate=False)


def _kda() -> None:
    from moe_lc_kernels.kda import chunk_kda_triton

    q, k, v = (_bf16(1, TOKENS, HEADS, HEAD_DIM).requires_grad_(True) for _ in range(3))
    g = (-5.0 * torch.rand(1, TOKENS, HEADS, HEAD_DIM)).requires_grad_(True)
    beta = torch.rand(1, TOKENS, HEADS).to(torch.bfloat16).requires_grad_(True)
    o, _ = chunk_kda_triton(q, k, v, g, beta, seq_bounds=[0, 8192, TOKENS], gate_lower_bound=-5.0)
    o.backward(torch.ones_like(o))


OPS: dict[str, Callable[[], None]] = {
    "situ": _situ, "router": _router, "sort": _sort, "permutation": _permutation, "short_conv": _short_conv,
    "depth_mixture": _depth_mixture, "accumulate": _accumulate, "kda": _kda, "mla_keys": _mla_keys,
    "cross_entropy": _cross_entropy, "grouped_wgrad": _grouped_wgrad, "output_gate": _output_gate,
}


def audit(ops: list[str], arch: int = 90) -> list[Compiled]:
    """Every kernel the named ops launch, compiled for sm_``arch``, once per distinct compilation."""
    results, seen = [], set()
    for op in ops:
        with compile_only(arch) as compiled:
            OPS[op]()
        for name, launch, kernel in compiled:
            if id(kernel) in seen:
                continue
            seen.add(id(kernel))
            row = resources(name, kernel)
            row.constexprs = launch
            results.append(row)
    return results


def format_table(rows: list[Compiled]) -> str:
    lines = ["| kernel | launch | warps | stages | registers | stack (spill) bytes | spill loads+stores | shared bytes "
             "| SASS instructions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        launch = ", ".join(f"{k}={v}" for k, v in r.constexprs.items() if not k.startswith("num_"))
        lines.append(f"| {r.kernel} | {launch} | {r.warps} | {r.stages} | {r.registers} | {r.stack_bytes} | "
                     f"{r.spill_instructions} | {r.shared_bytes} | {r.instructions} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose among {list(OPS)}")
    rows = audit(ops, args.arch)
    print(format_table(rows))
    spilled = [r.kernel for r in rows if r.stack_bytes or r.spill_instructions]
    print(f"\n{len(rows)} kernels, {len(spilled)} with register spills{': ' + ', '.join(spilled) if spilled else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
