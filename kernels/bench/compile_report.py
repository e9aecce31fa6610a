"""Compile every KDA kernel for an H100/H200 (sm_90) on any machine, no GPU needed, and report
compile seconds, registers, stack frame (spills), shared memory and SASS instructions per kernel
(static count per warp; kernels/bench/sass_lines.py splits it by source line and loop).

    python kernels/bench/compile_report.py [--kernels ktile,vside] [--tuning 'ktile_bk=16']

Launch choices come from ``moe_lc_kernels.kda.TUNING`` (plus ``--tuning``), with the shapes of the
benchmarks: bf16 inputs, H=16, K=V=128, gate/norm/beta inside the kernels. Pointer arguments are
declared 16-byte aligned, as the JIT does for torch tensors (without that every load is scalar and
the stack numbers come out 1.5-3x too large). Uses Triton's bundled cuobjdump; what costs no device
time should not be measured on the device (kernels/NOTES.md: one kernel took 224 s to compile).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_lc_kernels import kda as kda_mod
from moe_lc_kernels import kda_triton as kt

INDEX_TABLES = {"chunk_bos", "chunk_eos", "seg_chunk0", "seg_nchunks", "seg_bos", "seg_eos", "seg_order"}
FLOAT_SCALARS = {"scale", "lower_bound"}


def launches(tuning: dict) -> dict:
    """kernel -> (function, constexprs, fp32 pointer arguments, num_warps, num_stages, maxnreg), as
    kernels/kda.py launches them (maxnreg 0: no register cap)."""
    flags = dict(GATE_IN_KERNEL=True, HAS_DT_BIAS=True, L2NORM=True, BETA_SIGMOID=True)
    dims = dict(K=128, BT=64)
    params = {"A_log", "dt_bias"}
    kept = kda_mod.bwd_dtypes(tuning["bwd_states"], torch.bfloat16)
    states = {name for name, dtype in kept.items() if dtype == torch.float32}
    bwd_operands = dict(OPD=tl.float32 if tuning["state_prec"] == "tf32" else tl.bfloat16,
                        SPLIT=tuning["state_prec"] == "bf16x2")
    return {
        "norms": (kt._row_norms_kernel, dict(K=128, BT=64, BK=tuning["norm_bk"], L2NORM=True), {"rnorm"},
                  tuning["norm_warps"], 1, 0),
        "prep": (kt._prep_blocked_kernel, dict(K=128, BT=64, BK=tuning["prep_bk"], GATE_IN_KERNEL=True,
                                               HAS_DT_BIAS=True),
                 params | {"gc_out", "gcum", "rnorm"}, tuning["prep_warps"], 1, tuning["prep_maxnreg"]),
        "scores": (kt._prep_scores_kernel, dict(dims, H=16, BK=tuning["score_bk"], BETA_SIGMOID=True, DOT_PREC="tf32"),
                   {"gcum", "rnorm", "a_out"}, tuning["score_warps"], 1, 0),
        "inverse": (kt._ut_inverse_kernel, dict(BT=64, INV_PREC="ieee"), {"x"}, tuning["inv_warps"], 1, 0),
        "wu": (kt._wu_kernel, dict(dims, V=128, BC=64, BETA_SIGMOID=True, DOT_PREC="tf32"), {"x"},
               tuning["wu_warps"], 2, 0),
        "state_fwd": (kt._state_fwd_kernel, dict(dims, V=128, BV=tuning["state_bv"], V_END=128, HAS_INIT=True,
                                                 TRANSITION=False, STORE_OUTPUT=True, STORE_STATES=False,
                                                 DOT_PREC="tf32", OPD=tl.bfloat16, SPLIT=False),
                      {"gc", "states", "seg_init", "seg_end"}, tuning["state_warps"], tuning["state_stages"], 0),
        "state_rec": (kt._state_fwd_kernel, dict(dims, V=128, BV=tuning["state_bv"], V_END=128, HAS_INIT=True,
                                                 TRANSITION=False, STORE_OUTPUT=False, STORE_STATES=True,
                                                 DOT_PREC="tf32", **bwd_operands),
                      {"gc", "seg_init", "seg_end"} | states, tuning["state_warps"], tuning["state_stages"], 0),
        "state_bwd": (kt._state_bwd_kernel, dict(dims, V=128, BV=tuning["state_bwd_bv"], HAS_INIT=True, STORE=True,
                                                 DOT_PREC="tf32", **bwd_operands),
                      {"gc", "seg_init", "seg_start_grad"} | states, tuning["state_warps"], tuning["state_stages"], 0),
        "vside": (kt._bwd_vside_kernel, dict(dims, H=16, V=128, BK=tuning["vside_bk"], BV=tuning["vside_bv"],
                                             BETA_SIGMOID=True, PREC=tuning["bwd_prec"],
                                             ROUND_DAQK=tuning["score_prec"] == "tf32"),
                  {"x_in", "dqg_out", "dw_out", "dkend_out", "daqk_out", "dt_out", "dgc_out"} | states,
                  tuning["vside_warps"], 1, tuning["vside_maxnreg"]),
        "kside": (kt._bwd_kside_chunk_kernel, dict(dims, H=16, BK=tuning["kside_bk"], PREC=tuning["bwd_prec"],
                                                   SCORE_PREC=tuning["score_prec"], BETA_SIGMOID=True),
                  {"x_in", "dw_in", "dt_in", "gcum", "rnorm", "db_part"}, tuning["kside_warps"],
                  tuning["kside_stages"], 0),
        "ktile": (kt._bwd_kside_tile_kernel, dict(dims, H=16, BK=tuning["ktile_bk"], SCORE_PREC=tuning["score_prec"],
                                                  L2NORM=True, BETA_SIGMOID=True),
                  {"gcum", "rnorm", "dqg_in", "dw_in", "dkend_in", "daqk_in", "dt_in", "db_part", "row_part",
                   "esum_part"}, tuning["ktile_warps"], tuning["ktile_stages"], tuning["ktile_maxnreg"]),
        "kgate": (kt._bwd_kside_gate_kernel, dict(dims, H=16, BK=tuning["kgate_bk"],
                                                  TILE_BLOCKS=128 // tuning["ktile_bk"], **flags),
                  params | {"gcum", "rnorm", "dqg_in", "dw_in", "dkend_in", "dgc_in", "esum_part", "db_part",
                            "row_part", "dA_part", "ddtb_part"}, tuning["kgate_warps"], 1, 0),
    }


def signature(fn, constexprs: dict, fp32: set) -> dict:
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in FLOAT_SCALARS:
            return "fp32"
        if name in ("H", "NTOK"):
            return "i32"
        if name in INDEX_TABLES:
            return "*i32"
        return "*fp32" if name in fp32 else "*bf16"

    return {name: kind(name) for name in fn.arg_names}


def nvidia_tool(name: str) -> str:
    """Path of a tool bundled with Triton's NVIDIA backend (cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(fn, constexprs: dict, fp32: set, warps: int, stages: int, maxnreg: int = 0):
    """(compiled kernel, seconds) for sm_90 with the launch options kernels/kda.py uses."""
    sig = signature(fn, constexprs, fp32)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    start = time.time()
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned),
                              target=GPUTarget("cuda", 90, 128), options=options)
    return compiled, time.time() - start


def cubin_tool(compiled, *command: str) -> str:
    """Output of a cuobjdump / nvdisasm command line run on the compiled cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvidia_tool(command[0]), *command[1:], f.name], capture_output=True, text=True).stdout


SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")


def compile_one(fn, constexprs: dict, fp32: set, warps: int, stages: int, maxnreg: int = 0) -> dict:
    compiled, seconds = compile_kernel(fn, constexprs, fp32, warps, stages, maxnreg)
    usage = cubin_tool(compiled, "cuobjdump", "--dump-resource-usage")
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    sass = cubin_tool(compiled, "cuobjdump", "-sass").splitlines()
    return dict(seconds=seconds, regs=int(match.group(1)), stack=int(match.group(2)),
                shared_kb=compiled.metadata.shared / 1024, warps=warps,
                instructions=sum(1 for line in sass if SASS_LINE.match(line)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="norms,prep,scores,inverse,wu,state_fwd,state_rec,state_bwd,vside,kside,ktile,kgate")
    p.add_argument("--tuning", default="", help="TUNING overrides, 'key=value,...'")
    p.add_argument("--json", action="store_true", help="one JSON object per kernel instead of the table")
    args = p.parse_args(argv)
    tuning = {**kda_mod.TUNING, **kda_mod.parse_tuning(args.tuning)}
    table = launches(tuning)
    if not args.json:
        print(f"sm_90, Triton {triton.__version__}, tuning overrides: {args.tuning or 'none'}")
        print("| kernel | warps | compile s | regs | stack B | shared KB | SASS instructions |\n"
              "|---|---|---|---|---|---|---|")
    for name in args.kernels.split(","):
        r = compile_one(*table[name])
        if args.json:
            print(json.dumps(dict(kernel=name, **r)), flush=True)
        else:
            print(f"| {name} | {r['warps']} | {r['seconds']:.1f} | {r['regs']} | {r['stack']} | {r['shared_kb']:.1f} "
                  f"| {r['instructions']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
