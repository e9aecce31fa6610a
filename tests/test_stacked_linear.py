"""stacked_linear: several linear maps of one input as one GEMM, against the maps one by one in
float64 (outputs and every gradient), and what its forward keeps for backward: x and the weights
themselves, never a stacked copy."""

from __future__ import annotations

import torch

from moe_lc.ops.stacked_linear import stacked_linear
from reference_checks import F64, assert_matches


def operands(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 7, generator=gen, dtype=F64).requires_grad_(True)
    weights = [torch.randn(n, 7, generator=gen, dtype=F64).requires_grad_(True) for n in (3, 1, 4)]
    return x, weights


def test_stacked_linear_is_the_maps_side_by_side():
    x, weights = operands()
    leaves = {"x": x, **{f"w{i}": w for i, w in enumerate(weights)}}
    assert_matches(lambda: stacked_linear(x, weights), lambda: torch.cat([x @ w.T for w in weights], dim=-1), leaves)


def test_stacked_linear_keeps_x_and_the_weights_not_their_concatenation():
    x, weights = operands(1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = stacked_linear(x, weights)
    assert {t.data_ptr() for t in saved} == {t.data_ptr() for t in (x, *weights)}
    y.sum().backward()  # and the gradients still reach every weight
    assert all(w.grad is not None and w.grad.shape == w.shape for w in weights)


def test_stacked_linear_under_autocast_keeps_one_cast_of_the_stacked_weights():
    """Under autocast over fp32 weights the separate linears would keep a bf16 cast of each weight;
    the stacked one keeps one bf16 cast of the stacked matrix instead: the same bytes."""
    x, weights = operands(2)
    x, weights = x.detach().float().requires_grad_(True), [w.detach().float().requires_grad_(True) for w in weights]
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = stacked_linear(x, weights)
    assert y.dtype == torch.bfloat16
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == sorted([((10, 7), torch.bfloat16),
                                                                     ((7, 8), torch.bfloat16)])  # W^T
    y.float().sum().backward()
    assert all(w.grad is not None and w.grad.dtype == torch.float32 for w in weights)


def test_stacked_linear_under_autocast_with_weights_already_in_its_dtype():
    """bf16 weights and an fp32 input under bf16 autocast: no concatenated copy is kept, and the
    backward (which runs without autocast) gets operands of one dtype."""
    x, weights = operands(3)
    x, weights = x.detach().float().requires_grad_(True), [w.detach().bfloat16().requires_grad_(True) for w in weights]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = stacked_linear(x, weights)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(w.grad is not None and w.grad.dtype == torch.bfloat16 for w in weights)
