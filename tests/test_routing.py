"""The fused MoE router (moe_lc.ops.routing, kernels moe_lc_kernels.routing) against the router written
out in float64:

    s = sigmoid(logits)   T = argtop_k(s + b)   alpha = (k+1)-th largest s + b   p_j = scale s_j / sum_T s

and against the balancer's own statistics (QuantileHistogram.add_required, expert_loads), which must
agree count for count. Without a GPU the kernels run in Triton's interpreter, so sizes stay small; a
small token block makes the tokens span several programs and end in a partial one.

Tolerances come from the precision: s is within a few fp32 ulps of the float64 sigmoid (one exp,
one division), alpha adds one rounding of s + b, p adds the sum of k terms and a division. The
selection and the histogram are discrete: the inputs are made so that no choice and no bin lies
within 1e-5 of a tie or a bin edge in float64, far beyond the fp32 error, so they must be exact.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc_kernels.routing as kernel_module  # noqa: E402
from moe_lc.config import ConfigError, MoEConfig  # noqa: E402
from moe_lc.model.balancing import ExpertBalancer, QuantileHistogram, expert_loads, required_bias  # noqa: E402
from moe_lc.model.moe import LatentMoE  # noqa: E402
from moe_lc.ops.routing import resolve_backend, route_reference, route_statistics, route_topk  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
TOKENS, EXPERTS, K, BINS = 45, 12, 3, 64
MARGIN = 1e-5  # float64 distance kept from every tie and bin edge


@pytest.fixture
def small_blocks(monkeypatch):
    """16 tokens a program: 45 tokens span three programs, the last one partial."""
    monkeypatch.setattr(kernel_module, "TUNING", dict(block_t=16, warps=4))


def float64_router(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float):
    """(topk_idx, p, alpha, s) in float64 from the formula, the slots in descending order of s + b."""
    s = torch.sigmoid(logits.detach().cpu().to(F64))
    biased = s + bias.cpu().to(F64)
    values, idx = biased.sort(dim=-1, descending=True, stable=True)
    picked = s.gather(1, idx[:, :top_k])
    return idx[:, :top_k], picked / picked.sum(-1, keepdim=True) * scale, values[:, top_k], s


def unambiguous_logits(bias: torch.Tensor, top_k: int, bins: int, seed: int, width: int = EXPERTS) -> torch.Tensor:
    """[TOKENS, width] fp32 logits whose float64 routing has no near-tie among the top k + 1 biased
    scores and whose required biases alpha - s lie at least MARGIN bin widths from a bin edge:
    offending logits are nudged and the check repeated."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(TOKENS, width, generator=gen, dtype=F64) * 2.0).float()
    b = bias.to(F64)
    lo, hi = b.min() - 1.0, b.max() + 1.0
    bin_width = (hi - lo) / bins
    for _ in range(100):
        s = torch.sigmoid(logits.to(F64))
        biased = s + b
        values, _ = biased.sort(dim=-1, descending=True)
        gaps = (values[:, : top_k + 1] - values[:, 1 : top_k + 2]).min(dim=1).values
        alpha = values[:, top_k : top_k + 1]
        position = (alpha - s - lo) / bin_width
        near_edge = (position - position.round()).abs() < MARGIN
        bad_rows = gaps < MARGIN
        if not bad_rows.any() and not near_edge.any():
            return logits
        nudge = torch.rand(logits.shape, generator=gen) * 0.05
        logits = torch.where(bad_rows[:, None] | near_edge, logits + nudge, logits)
    raise AssertionError("could not make unambiguous logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_weights_and_cutoff_match_float64(dtype, small_blocks):
    """The kernel picks the float64 top k in its order, and its weights and cutoff are within a few
    fp32 ulps; the logits are columns of a wider GEMM output (strided rows), read in place."""
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(1)) * 0.2
    logits = unambiguous_logits(bias, K, BINS, seed=2).to(dtype)
    wide = torch.cat([torch.randn(TOKENS, 5).to(dtype), logits, torch.randn(TOKENS, 3).to(dtype)], dim=1).to(DEVICE)
    strided = wide[:, 5 : 5 + EXPERTS]
    assert not strided.is_contiguous()
    idx, p, alpha = route_topk(strided, bias.to(DEVICE), K, 2.5, backend="triton")
    want_idx, want_p, want_alpha, s = float64_router(logits, bias, K, 2.5)
    assert idx.dtype == torch.int64 and p.dtype == alpha.dtype == torch.float32
    assert torch.equal(idx.cpu(), want_idx)
    assert ((p.cpu().double() - want_p).abs() <= 16 * EPS32 * want_p.abs()).all()
    magnitude = s.max(dim=1).values + bias.abs().max().double()
    assert ((alpha.cpu().double() - want_alpha).abs() <= 4 * EPS32 * magnitude).all()


def test_ties_go_to_the_lower_expert_index():
    """Equal biased scores: the kernel takes the lower expert index first, so the choice is the
    same on every run and device."""
    logits = torch.zeros(4, 8, device=DEVICE)
    logits[:, 5] = 1.0
    idx, p, _ = route_topk(logits, torch.zeros(8, device=DEVICE), 3, 1.0, backend="triton")
    assert idx.tolist() == [[5, 0, 1]] * 4
    assert torch.allclose(p.sum(-1), torch.ones(4, device=DEVICE), rtol=4 * EPS32, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_of_the_weights_matches_float64(dtype, small_blocks):
    """d logits from d p through p_j = scale s_j / sum_T s and the sigmoid, zero off the selected
    experts; in the logits' dtype, within fp32 rounding of a few terms (plus its own rounding)."""
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3)) * 0.2
    logits = unambiguous_logits(bias, K, BINS, seed=4).to(dtype).to(DEVICE).requires_grad_(True)
    dp = torch.randn(TOKENS, K, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _, p, _ = route_topk(logits, bias.to(DEVICE), K, 2.5, backend="triton")
    got, = torch.autograd.grad(p, logits, dp)
    ref_logits = logits.detach().cpu().to(F64).requires_grad_(True)
    _, want_p, _, _ = float64_router(ref_logits, bias, K, 2.5)
    s = torch.sigmoid(ref_logits)
    picked_idx = float64_router(ref_logits, bias, K, 2.5)[0]
    picked = s.gather(1, picked_idx)
    want, = torch.autograd.grad(picked / picked.sum(-1, keepdim=True) * 2.5, ref_logits, dp.cpu().to(F64))
    assert got.dtype == dtype and got.shape == logits.shape
    selected = torch.zeros_like(want, dtype=torch.bool).scatter_(1, picked_idx, True)
    assert not got.cpu()[~selected].any()
    out_rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    bound = (16 * EPS32 + out_rounding) * want.abs().max(dim=1, keepdim=True).values * K
    assert ((got.cpu().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("histogram", [True, False])
def test_statistics_are_the_balancers_count_for_count(histogram, small_blocks):
    """The statistics kernel adds to the loads and to QB's histogram exactly what the balancer's own
    PyTorch path adds for the same routing (integer counts, the same fp64 bins), and sets the range."""
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(6)) * 0.2
    logits = unambiguous_logits(bias, K, BINS, seed=7).to(DEVICE)
    idx, _, alpha = route_topk(logits, bias.to(DEVICE), K, 1.0, backend="triton")
    loads = torch.full((EXPERTS,), 3, dtype=torch.int64, device=DEVICE)  # adds to what is there
    hist = QuantileHistogram(EXPERTS, BINS).to(DEVICE)
    hist.counts.fill_(2)
    route_statistics(logits, bias.to(DEVICE), idx, alpha, loads, hist.counts if histogram else None,
                     hist.value_range if histogram else None)
    ref_idx, _, ref_alpha = route_reference(logits.cpu(), bias, K, 1.0)
    assert torch.equal(loads.cpu(), 3 + expert_loads(ref_idx, EXPERTS))
    ref = QuantileHistogram(EXPERTS, BINS)
    ref.counts.fill_(2)
    if histogram:
        ref.add_required(required_bias(torch.sigmoid(logits.cpu()), ref_alpha), bias)
    assert torch.equal(hist.counts.cpu(), ref.counts)
    assert torch.equal(hist.value_range.cpu(), ref.value_range)


@pytest.mark.parametrize("balancing", ["qb", "sign"])
def test_a_moe_layer_routes_and_balances_the_same_through_either_backend(balancing):
    """LatentMoE with ``router_backend`` triton against torch (fp32, training): the same experts, the
    same output and gradients up to fp32 rounding, the same step statistics and next bias; nothing
    is counted in eval."""
    from reference_checks import output_and_gradients, randomize

    cfg = MoEConfig(num_routed=EXPERTS, top_k=K, num_shared=1, latent_dim=16, expert_hidden=24, balancing=balancing,
                    qb_bins=BINS)
    layers = {b: randomize(LatentMoE(32, dataclasses.replace(cfg, router_backend=b)), seed=8).to(DEVICE).train()
              for b in ("torch", "triton")}
    x = torch.randn(3, 15, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    logits = layers["torch"].input_projections(x.reshape(-1, 32))[0]
    assert layers["triton"].fused_router(logits) and not layers["torch"].fused_router(logits)
    results = {backend: output_and_gradients(layer, x) for backend, layer in layers.items()}
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert ((b - a).norm() / a.norm()).item() < 1e-5
    torch_b, triton_b = layers["torch"].balancer, layers["triton"].balancer
    assert torch_b.step_loads.sum() == x.shape[0] * x.shape[1] * K
    assert torch.equal(torch_b.step_loads, triton_b.step_loads)
    if balancing == "qb":
        assert torch.equal(torch_b.histogram.counts, triton_b.histogram.counts)
    for balancer in (torch_b, triton_b):
        balancer.update()
    assert torch.equal(torch_b.bias, triton_b.bias)
    layers["triton"].eval()
    with torch.no_grad():
        layers["triton"](x)
    assert not triton_b.step_loads.any()


def test_the_custom_ops_trace_without_graph_breaks(small_blocks):
    """The fused router's ops pass torch's custom-op checks, and a compiled function calling them has
    no graph break and the same values and gradient."""
    bias = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(10)).to(DEVICE) * 0.2
    logits = torch.randn(TOKENS, EXPERTS, device=DEVICE, requires_grad=True)
    # (opcheck's AOT test sums every output with a float gradient, which the int64 choice cannot take)
    torch.library.opcheck(torch.ops.moe_lc.route.default, (logits, bias, K, 1.5),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def routed_sum(logits):
        idx, p, alpha = route_topk(logits, bias, K, 1.5, backend="triton")
        return (p * idx).sum() + alpha.sum()

    torch._dynamo.reset()
    eager = routed_sum(logits)
    grad, = torch.autograd.grad(eager, logits)
    compiled = torch.compile(routed_sum, backend="aot_eager", fullgraph=True)(logits)
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.autograd.grad(compiled, logits)[0], grad)


def test_dispatch_choices_and_errors():
    logits = torch.zeros(6, 8, device=DEVICE)
    assert resolve_backend(logits, 2, "auto") == ("triton" if logits.is_cuda else "torch")
    assert resolve_backend(logits, 2, "torch") == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend(logits, 2, "cuda")
    with pytest.raises(RuntimeError, match="1 <= top_k < experts"):
        resolve_backend(logits, 8, "triton")
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        resolve_backend(logits.double(), 2, "triton")
    with pytest.raises(RuntimeError, match="plain tensors"):  # a subclass, as tensor parallelism's DTensor
        resolve_backend(torch.nn.Parameter(logits), 2, "triton")
    from moe_lc.config import ModelConfig
    base = ModelConfig(moe=MoEConfig(num_routed=8, top_k=2))
    with pytest.raises(ConfigError, match="moe.router_backend='cuda': use auto, torch or triton"):
        dataclasses.replace(base, moe=dataclasses.replace(base.moe, router_backend="cuda")).validate()
    with pytest.raises(ConfigError, match="not balancing='aux'"):
        dataclasses.replace(base, moe=dataclasses.replace(base.moe, router_backend="triton", balancing="aux")).validate()
    assert not ExpertBalancer(8, 2, mode="qb", exact=True).fused_statistics()
