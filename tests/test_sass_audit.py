"""benchmarks/sass_audit.py: the project's Triton kernels compiled for a Hopper GPU (sm_90) on a machine
without one. The interpreter the other kernel tests run cannot tell whether a kernel compiles at all,
nor whether its default launch choices spill registers; this does, for the MoE layer's kernels, the
output gate's and the short convolution's (its row kernels branch at run time with tuples of rows as the branches' results;
the KDA and depth-mixture kernels take ~30 s more: `python benchmarks/sass_audit.py`).

Runs in a process of its own: the kernel modules must be imported without TRITON_INTERPRET, which
the other test modules set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
OPS = "router,sort,situ,permutation,accumulate,mla_keys,short_conv,output_gate"


def test_the_moe_kernels_compile_for_hopper_without_register_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sass_audit.py"), "--ops", OPS],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "_kernel" in line]
    kernels = {cells[0].strip() for cells in rows}
    assert {"route_fwd_kernel", "route_bwd_kernel", "route_statistics_kernel", "expert_block_counts_kernel",
            "place_by_expert_kernel", "situ_glu_fwd_kernel", "situ_glu_bwd_kernel", "sum_rows_kernel",
            "combine_bwd_kernel", "accumulate_rows_kernel", "mla_keys_fwd_kernel", "mla_keys_bwd_kernel",
            "short_conv_fwd_kernel", "short_conv_bwd_rows_kernel", "short_conv_rows_kernel",
            "gated_output_fwd_kernel", "gated_output_bwd_kernel"} <= kernels
    for cells in rows:
        registers, stack, spill_ops = int(cells[4]), int(cells[5]), int(cells[6])
        assert 0 < registers <= 255 and stack == 0 and spill_ops == 0, \
            f"{cells[0].strip()} spills: {stack} stack bytes, {spill_ops} STL/LDL ({cells[1].strip()})"
        assert int(cells[8]) > 0
    assert re.search(r"\d+ kernels, 0 with register spills", done.stdout)
