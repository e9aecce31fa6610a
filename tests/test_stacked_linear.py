"""stacked_linear: several linear maps of one input as one GEMM, against the maps one by one in
float64 (outputs and every gradient), and what its forward keeps for backward: x and the weights
themselves, never a stacked copy."""

from __future__ import annotations

import pytest
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
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == sorted([((2, 5, 7), torch.bfloat16),  # x
                                                                     ((8, 7), torch.bfloat16)])  # W
    y.float().sum().backward()
    assert all(w.grad is not None and w.grad.dtype == torch.float32 for w in weights)


def micro_batches(seed: int, count: int = 2, device: str = "cpu"):
    """fp32 master weights, and per micro-batch an input and the output's gradient (bf16-exact values)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(n, 7, generator=gen).to(device)) for n in (3, 1, 4)]
    batches = [(torch.randn(2, 5, 7, generator=gen).bfloat16().float().to(device),
                torch.randn(2, 5, 8, generator=gen).bfloat16().float().to(device)) for _ in range(count)]
    return weights, batches


def run_steps(weights, batches, casts=None) -> list[torch.Tensor]:
    """Forward and backward of each micro-batch under bf16 autocast; the inputs' gradients."""
    grads = []
    for x, dy in batches:
        x = x.clone().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = stacked_linear(x, weights, casts)
        assert y.dtype == torch.bfloat16
        (y.float() * dy).sum().backward()
        grads.append(x.grad)
    return grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_weight_gradients_accumulate_in_fp32_over_micro_batches(device):
    """Under autocast over fp32 weights each weight's .grad is sum over micro-batches of dy_i^T x, the
    products of the bf16 operands summed in fp32 (on CUDA by the GEMM: fp32 output, then fp32 addmm in
    place): within fp32 rounding of float64, where a gradient rounded to bf16 per micro-batch
    (autograd's way) is ~1e-3 off. After the first micro-batch the stacked weights' gradients are row
    blocks of one buffer, into which the second adds in place."""
    weights, batches = micro_batches(4, device=device)
    run_steps(weights, batches[:1])
    base = weights[0].grad._base
    assert base is not None and all(w.grad._base is base for w in weights)
    pointer = base.data_ptr()
    run_steps(weights, batches[1:])
    assert weights[0].grad.data_ptr() == pointer and all(w.grad._base is base for w in weights)
    want = sum(dy.double().flatten(0, 1).T @ x.bfloat16().double().flatten(0, 1) for x, dy in batches)
    got = torch.cat([w.grad for w in weights]).double()
    assert (got - want).abs().max() / want.abs().max() < 1e-6
    rounded = sum((dy.flatten(0, 1).T @ x.flatten(0, 1)).bfloat16().double() for x, dy in batches)
    assert (rounded - want).abs().max() / want.abs().max() > 1e-4  # what the test tells apart


def test_input_gradient_uses_the_compute_copy_of_the_weights():
    weights, batches = micro_batches(5, count=1)
    (dx,) = run_steps(weights, batches)
    stacked = torch.cat([w.detach() for w in weights]).bfloat16().double()
    want = batches[0][1].bfloat16().double() @ stacked
    assert (dx.double() - want).abs().max() / want.abs().max() < 1e-2  # dx is bf16: its rounding


def test_weight_gradients_of_other_layouts_are_added_one_by_one():
    """.grad that are not one buffer's row blocks (made elsewhere) still get their share added, in
    fp32, each by its own GEMM. With a frozen weight among them the GEMM is autograd's (bf16 weight
    gradients, cast and added): the frozen one gets none, the others theirs within bf16 rounding."""
    weights, batches = micro_batches(6)
    run_steps(weights, batches)
    want = [w.grad.clone() for w in weights]
    weights2, _ = micro_batches(6)
    run_steps(weights2, batches[:1])
    for w in weights2:
        w.grad = w.grad.clone()  # separate tensors now
    run_steps(weights2, batches[1:])
    assert all(torch.allclose(w.grad, g, rtol=1e-6, atol=1e-6) for w, g in zip(weights2, want))
    frozen, _ = micro_batches(6)
    frozen[1].requires_grad_(False)
    run_steps(frozen, batches)
    assert frozen[1].grad is None
    assert (frozen[0].grad - want[0]).abs().max() / want[0].abs().max() < 1e-2


def test_the_steps_compute_copy_is_made_once():
    weights, batches = micro_batches(7, count=3)
    casts: dict = {}
    once = run_steps(weights, batches, casts)
    (copy,) = casts.values()
    assert copy.dtype == torch.bfloat16 and copy.shape == (8, 7) and not copy.requires_grad
    weights2, _ = micro_batches(7, count=3)
    again = run_steps(weights2, batches)
    assert all(torch.equal(a, b) for a, b in zip(once, again))
    assert all(torch.equal(w.grad, w2.grad) for w, w2 in zip(weights, weights2))


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


def test_a_models_dense_weights_get_their_gradients_under_autocast_and_step_casts(monkeypatch):
    """The model under bf16 autocast over fp32 weights, within ``reuse_weight_casts``, two micro-batches:
    every parameter gets the gradient autograd's way gives it (bf16 weight gradients cast and added),
    within that way's bf16 rounding, and in fp32 (no gradient lost or counted twice on its way into
    .grad: either would be off by the whole gradient); the mixers and FFNs hold their weights' bf16
    copies for the step and drop them after it."""
    import copy

    import moe_lc.ops.stacked_linear as op
    from moe_lc.model.init import build_model
    from moe_lc.model.moe import reuse_weight_casts
    from moe_lc.presets import get_preset

    cfg = get_preset("tiny")
    cfg.kda.backend = "torch"
    model = build_model(cfg, "cpu", seed=0)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (1, 24), generator=gen),
                torch.randint(0, cfg.vocab_size, (1, 24), generator=gen)) for _ in range(2)]

    def train(m) -> int:
        keepers = [k for k in m.modules() if hasattr(k, "step_casts")]
        with reuse_weight_casts(m):
            for ids, labels in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(ids, labels=labels).loss
                loss.backward()
            held = sum(len(k.step_casts) for k in keepers)
        assert all(k.step_casts is None for k in keepers)
        return held

    assert train(model) >= 3 * cfg.num_layers
    with monkeypatch.context() as patch:
        patch.setattr(op, "_accumulation_dtype", lambda x, weights: None)  # autograd's way
        train(reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert p.grad.dtype == torch.float32, name
            scale = q.grad.abs().max().clamp(min=1e-30)
            assert (p.grad - q.grad).abs().max() / scale < 1e-2, name
