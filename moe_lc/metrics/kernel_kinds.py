"""GPU kernels by kind: what bounds each share of a step's kernel time.

The component breakdown (``breakdown.py``) says which part of the model a kernel belongs to; this
says what kind of work it is, which is what a time model prices at one rate each:

- ``dense_gemm``: cuBLAS / CUTLASS / Triton matmuls (FLOPs at the matmul rate);
- ``grouped_gemm``: the routed experts' grouped GEMMs (FLOPs at the grouped rate);
- ``attention``: fused softmax attention (cuDNN, FlashAttention, FlexAttention);
- ``kda``: the KDA recurrence's Triton kernels (``kernels/kda_triton.py``);
- ``optimizer``: the optimizer's multi-tensor kernels and the gradient norm;
- ``communication``: NCCL;
- ``memory``: everything else (elementwise, copies, casts, norms, reductions, sorts): the
  memory-bound traffic.

``python -m moe_lc.metrics.kernel_kinds TRACE.json [...]`` sums a Chrome trace (``moe-lc bench
--trace``) by kind and prints each kind's largest kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Optional

from moe_lc.metrics.breakdown import kernel_table
from moe_lc.metrics.gaps import load_trace

KINDS = ("dense_gemm", "grouped_gemm", "attention", "kda", "optimizer", "communication", "memory")

# The @triton.jit kernels of kernels/kda_triton.py (tests/test_kernel_kinds.py keeps the list whole).
KDA_KERNELS = frozenset({
    "_ut_inverse_kernel", "_row_norms_kernel", "_prep_blocked_kernel", "_prep_scores_kernel", "_wu_kernel",
    "_state_fwd_kernel", "_state_bwd_kernel", "_bwd_vside_kernel", "_bwd_kside_chunk_kernel",
    "_bwd_kside_tile_kernel", "_bwd_kside_gate_kernel",
})
_GROUPED = ("GroupProblemShape", "grouped_mm", "GroupedGemm")
_DENSE = ("nvjet", "gemm", "Gemm", "cutlass", "xmma", "triton_tem_fused_mm", "triton_tem_fused_addmm",
          "triton_tem_fused_bmm", "cublas")
_ATTENTION = ("sdpa", "flash", "fmha", "attention", "flex_attention", "triton_tem_fused_flex")
_OPTIMIZER = ("FusedOptimizerTensorListMetadata", "fused_adamw", "LpNormFunctor", "multi_tensor_apply")


def kernel_kind(name: str) -> str:
    """The kind (one of ``KINDS``) of a kernel, by its name as the profiler records it."""
    if name in KDA_KERNELS:
        return "kda"
    if "nccl" in name.lower():
        return "communication"
    if any(key in name for key in _ATTENTION):  # before GEMMs: attention kernels are named after their GEMMs too
        return "attention"
    if any(key in name for key in _GROUPED):
        return "grouped_gemm"
    if any(key in name for key in _DENSE):
        return "dense_gemm"
    if any(key in name for key in _OPTIMIZER):
        return "optimizer"
    return "memory"


def kernels_by_kind(kernels: Iterable[tuple[str, float]]) -> dict[str, dict[str, tuple[float, int]]]:
    """(name, microseconds) pairs summed per kind and kernel: {kind: {name: (ms, launches)}}, every kind
    present (empty where none ran), kernels largest first."""
    table = kernel_table((kernel_kind(name), name, us) for name, us in kernels)
    return {kind: table.get(kind, {}) for kind in KINDS}


def kind_totals(table: dict[str, dict[str, tuple[float, int]]]) -> dict[str, float]:
    """Milliseconds per kind."""
    return {kind: sum(ms for ms, _ in rows.values()) for kind, rows in table.items()}


def device_kernels(events: Iterable[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel, memcpy and memset among a Chrome trace's events
    (``moe_lc.metrics.gaps.load_trace``)."""
    return [(e["name"], float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def format_kinds(table: dict[str, dict[str, tuple[float, int]]], coverage: float = 0.99, max_rows: int = 80,
                 name_width: int = 110) -> str:
    """Each kind's total and share, then its largest kernels until they make ``coverage`` of the kind's
    time (at most ``max_rows``): time, launches, mean time a launch and the running share, which tell a
    kernel away from its floor from many short launches (docs/performance.md §12.13)."""
    totals = kind_totals(table)
    whole = sum(totals.values()) or 1.0
    lines = [f"kernel time {whole:.1f} ms: " + ", ".join(f"{k} {totals[k]:.1f}" for k in KINDS if totals[k])]
    for kind in KINDS:
        if not table[kind]:
            continue
        launches = sum(n for _, n in table[kind].values())
        lines.append(f"{kind}: {totals[kind]:.1f} ms ({totals[kind] / whole:.1%}) in {launches} launches")
        shown = 0.0
        for name, (ms, n) in list(table[kind].items())[:max_rows]:
            shown += ms
            lines.append(f"  {ms:9.2f} ms {n:6d}x {ms / n * 1e3:9.1f} us  {shown / (totals[kind] or 1.0):6.1%}  "
                         f"{name[:name_width]}")
            if shown >= coverage * totals[kind]:
                break
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m moe_lc.metrics.kernel_kinds TRACE.json [...]", file=sys.stderr)
        return 2
    for path in paths:
        print(f"== {path}")
        print(format_kinds(kernels_by_kind(device_kernels(load_trace(path)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
