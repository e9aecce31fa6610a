"""Kernels by kind (moe_lc.metrics.kernel_kinds): names as the H200's profiler records them."""

import json
import re
from pathlib import Path

import pytest

from moe_lc.metrics.kernel_kinds import (KDA_KERNELS, KINDS, device_kernels, format_kinds, kernel_kind,
                                         kernels_by_kind, kind_totals, main)
from moe_lc.metrics.gaps import load_trace

REPO = Path(__file__).resolve().parents[1]

# Kernel names copied from k3-small traces on one H200 (torch 2.11): each with the kind it is.
NAMES = [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "dense_gemm"),
    ("nvjet_sm90_tss_192x192_64x3_1x2_h_badd_coopB_NTN", "dense_gemm"),
    ("triton_tem_fused_mm_7", "dense_gemm"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
     "INS_4gemm17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS_10collective13CollectiveMmaEEEEEvNT_6ParamsE",
     "grouped_gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x192_1x4x1_cga1x1", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4> >", "attention"),
    ("_bwd_kside_tile_kernel", "kda"),
    ("_state_fwd_kernel", "kda"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor", "optimizer"),
    ("depth_mixture_bwd_kernel", "memory"),
    ("situ_glu_fwd_kernel", "memory"),
    ("triton_poi_fused_index_put_new_zeros_1", "memory"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16> >", "memory"),
    ("Memcpy DtoD (Device -> Device)", "memory"),
]


@pytest.mark.parametrize("name,kind", NAMES)
def test_kernel_kind_of_profiled_names(name, kind):
    assert kernel_kind(name) == kind


def test_kda_kernels_are_the_triton_kernels_of_kda_triton():
    """Every kernel kda_triton.py launches, and nothing else (a renamed kernel would count as memory)."""
    source = (REPO / "kernels" / "kda_triton.py").read_text()
    launched = set(re.findall(r"@triton\.jit\s*\ndef (\w+_kernel)\(", source))
    assert launched and KDA_KERNELS == launched


def _trace(path: Path) -> Path:
    events = [
        {"ph": "X", "cat": "kernel", "name": NAMES[0][0], "dur": 1500.0},
        {"ph": "X", "cat": "kernel", "name": NAMES[0][0], "dur": 500.0},
        {"ph": "X", "cat": "kernel", "name": "_wu_kernel", "dur": 250.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 250.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "dur": 500.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000.0},  # host time: not a kernel
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 7000.0},
        {"ph": "i", "cat": "kernel", "name": "marker"},  # not a duration event
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_kernels_summed_by_kind(tmp_path):
    kernels = device_kernels(load_trace(_trace(tmp_path / "trace.json")))
    assert len(kernels) == 5
    table = kernels_by_kind(kernels)
    assert set(table) == set(KINDS)
    assert table["dense_gemm"] == {NAMES[0][0]: (2.0, 2)}
    assert table["kda"] == {"_wu_kernel": (0.25, 1)}
    assert list(table["memory"]) == ["Memset (Device)", "Memcpy DtoD (Device -> Device)"]  # largest first
    assert kind_totals(table) == {"dense_gemm": 2.0, "grouped_gemm": 0.0, "attention": 0.0, "kda": 0.25,
                                  "optimizer": 0.0, "communication": 0.0, "memory": 0.75}
    text = format_kinds(table)
    assert text.splitlines()[0] == "kernel time 3.0 ms: dense_gemm 2.0, kda 0.2, memory 0.8"
    assert "dense_gemm: 2.0 ms (66.7%) in 2 launches" in text
    assert "attention" not in text  # kinds that did not run are left out
    # each kernel with its launches, its mean time a launch and the running share of its kind
    assert "       2.00 ms      2x    1000.0 us  100.0%  " + NAMES[0][0][:110] in text
    memory = text.split("memory: ")[1].splitlines()
    assert memory[0] == "0.8 ms (25.0%) in 2 launches" and len(memory) == 3  # both kernels: 99% needs them
    assert len(format_kinds(table, coverage=0.5).split("memory: ")[1].splitlines()) == 2  # the first is enough


def test_cli_prints_each_trace(tmp_path, capsys):
    path = _trace(tmp_path / "rank0_trace.json")
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"== {path}\nkernel time 3.0 ms")
    assert main([]) == 2
