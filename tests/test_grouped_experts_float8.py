"""The routed experts in float8 (``float8.experts=true``): the padded groups the float8 grouped GEMM
needs, checked on the CPU against the per-expert loop in float64 (any routing: empty experts,
counts that are and are not multiples of 16, every row on one expert), which modules convert,
and the one-line refusal off the GPU; on an H200, torchao's float8 grouped GEMMs against float64
within float8's precision, without a host read."""

from __future__ import annotations

import functools

import pytest
import torch

from moe_lc.model.moe import RoutedExperts
from moe_lc.ops.grouped_experts import expert_offsets, grouped_glu, grouped_glu_reference
from moe_lc.ops.grouped_experts_float8 import GROUP_ROWS, pad_groups, padded_grouped_glu
from moe_lc.ops.situ_glu import glu_activation

ROUTINGS = {
    "mixed": [5, 0, 16, 33, 1, 0, 7, 2],
    "one_expert": [0, 0, 0, 64, 0, 0, 0, 0],
    "multiples": [16, 32, 0, 16, 0, 0, 0, 16],
}


def loop_gmm(x: torch.Tensor, w_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A grouped GEMM written as its definition: group g is rows [ends[g-1], ends[g]) times w_t[g]."""
    out, start = [], 0
    for g, end in enumerate(ends.tolist()):
        out.append(x[start:end] @ w_t[g])
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_padded_groups_hold_each_experts_rows_and_zeros(routing):
    counts = ROUTINGS[routing]
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, 8, dtype=torch.float64) + 3.0  # no real row is all zeros
    padded, ends, new_index = pad_groups(x, expert_offsets(counts, x.device))
    total = -(-(rows + experts * (GROUP_ROWS - 1)) // GROUP_ROWS) * GROUP_ROWS
    assert padded.shape == (total, 8) and ends.dtype == torch.int32 and int(ends[-1]) == total
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    assert all(s % GROUP_ROWS == 0 for s in sizes)
    start = 0
    for e, n in enumerate(counts):
        group = padded[int(ends[e]) - sizes[e]:int(ends[e])]
        assert torch.equal(group[:n], x[start:start + n]), e  # the expert's rows, in order, first
        assert not group[n:].any(), e  # then zeros
        assert sizes[e] >= n and (e == experts - 1 or sizes[e] - n < GROUP_ROWS)
        start += n
    assert torch.equal(padded[new_index], x)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_padded_glu_equals_the_loop_in_float64(routing):
    counts = ROUTINGS[routing]
    torch.manual_seed(0)
    experts, width, hidden = len(counts), 16, 32
    x = torch.randn(sum(counts), width, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(experts, hidden, width, dtype=torch.float64, requires_grad=True),
               torch.randn(experts, hidden, width, dtype=torch.float64, requires_grad=True),
               torch.randn(experts, width, hidden, dtype=torch.float64, requires_grad=True)]
    act = functools.partial(glu_activation, kind="situ", beta1=1.0, beta2=0.5, backend="torch")
    got = padded_grouped_glu(x, expert_offsets(counts, x.device), *weights, act, loop_gmm)
    want = grouped_glu_reference(x, counts, *weights, act)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, [x, *weights], grad)
    want_grads = torch.autograd.grad(want, [x, *weights], grad)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_float8_experts_convert_only_when_asked():
    pytest.importorskip("torchao.float8")
    from configs import tiny

    from moe_lc.model.init import build_model
    from moe_lc.parallel.float8 import Float8Training, apply_float8, float8_expert_names

    def experts_backends(model):
        return {name: m.backend for name, m in model.named_modules() if isinstance(m, RoutedExperts)}

    plain = build_model(tiny(), device="cpu", seed=0)
    apply_float8(plain, Float8Training())
    assert set(experts_backends(plain).values()) == {"auto"}
    model = build_model(tiny(), device="cpu", seed=0)
    converted = apply_float8(model, Float8Training(experts=True))
    backends = experts_backends(model)
    assert backends and set(backends.values()) == {"float8"}
    assert float8_expert_names(model) == sorted(backends, key=list(backends).index)
    assert set(backends) <= set(converted)


def test_float8_experts_off_the_gpu_is_one_line():
    counts = [3, 5]
    x = torch.randn(8, 16)
    w = [torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 16, 32)]
    with pytest.raises(RuntimeError, match=r'backend "float8" unavailable: the float8 grouped GEMM runs on CUDA'):
        grouped_glu(x, counts, *w, "situ", 1.0, 0.5, backend="float8")


def _float8_capable() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        from moe_lc.ops.grouped_experts_float8 import float8_grouped_mm

        float8_grouped_mm()
    except ImportError:
        return False
    return hasattr(torch, "_scaled_grouped_mm")


@pytest.mark.skipif(not _float8_capable(), reason="needs a GPU of compute capability 9.0+ and torchao")
def test_float8_experts_match_float64_within_float8_precision_and_never_wait():
    """e4m3 keeps 3 mantissa bits: each operand is rounded by up to 2^-4 relative, so a product of two
    rounded operands, summed over the width, lands within a few percent of the exact one (by norm);
    far more than bf16's 2^-8, which shows the GEMMs really ran in float8."""
    torch.manual_seed(0)
    cfg_counts = [37, 0, 16, 200, 3, 95, 1, 160]
    experts, width, hidden = len(cfg_counts), 256, 512
    x64 = torch.randn(sum(cfg_counts), width, dtype=torch.float64, device="cuda")
    w64 = [torch.randn(experts, hidden, width, dtype=torch.float64, device="cuda") * width ** -0.5,
           torch.randn(experts, hidden, width, dtype=torch.float64, device="cuda") * width ** -0.5,
           torch.randn(experts, width, hidden, dtype=torch.float64, device="cuda") * hidden ** -0.5]
    counts = torch.tensor(cfg_counts, device="cuda")
    x = x64.bfloat16().requires_grad_(True)
    w = [t.float().requires_grad_(True) for t in w64]  # fp32 master weights, as training holds them
    grad = torch.randn(sum(cfg_counts), width, dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = grouped_glu(x, counts, *w, "situ", 1.0, 0.5, backend="float8")
        y.backward(grad.bfloat16())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_in = [x.detach().double().requires_grad_(True), *(t.detach().double().requires_grad_(True) for t in w)]
    act = functools.partial(glu_activation, kind="situ", beta1=1.0, beta2=0.5, backend="torch")
    ref = grouped_glu_reference(ref_in[0], cfg_counts, *ref_in[1:], act)
    ref.backward(grad)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert 1e-3 < rel(y, ref) < 0.1, rel(y, ref)
    for got, want, name in zip([x.grad, *(t.grad for t in w)], [t.grad for t in ref_in], ["x", "gate", "in", "out"]):
        assert got is not None and rel(got, want) < 0.15, (name, rel(got, want))



def test_the_run_says_when_the_experts_compute_in_float8_too():
    from moe_lc.train.runtime import Runtime

    fp8 = Runtime(0, 1, 0, torch.device("cuda"), torch.bfloat16, False, float8=True)
    assert fp8.precision_label == "fp8 linears, bf16 autocast, fp32 weights"
    assert fp8.describe_precision(float8_experts=True) == "fp8 linears and experts, bf16 autocast, fp32 weights"
    plain = Runtime(0, 1, 0, torch.device("cuda"), torch.bfloat16, False)
    assert plain.describe_precision(float8_experts=True) == "bf16 autocast, fp32 weights"  # only under fp8
