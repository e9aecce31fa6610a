"""How the reference tests compare a module with its float64 formula: non-trivial parameters, and
forward and gradients to a bound that follows from float64 rounding."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

F64 = torch.float64

# Both sides compute in float64 (unit roundoff 1.1e-16) through a few hundred operations whose
# condition numbers are O(1)-O(100) on these inputs: rounding leaves them ~1e-14 apart. 1e-10 keeps
# four orders of magnitude of headroom and still fails for any change of a formula that moves the
# result by more than one part in 1e10 (a dropped eps of 1e-6 moves it by ~1e-6).
FLOAT64_RTOL = 1e-10


def rel(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b||; NaN never passes."""
    assert not torch.isnan(a).any(), "NaN in the module's result"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def randomize(module: nn.Module, seed: int, bias_scale: float = 0.1) -> nn.Module:
    """Give every parameter a value that exercises its formula (nothing at its initial value):
    projections ~ N(0, 1/fan_in) so activations are O(1) and the nonlinearities are not linear;
    norm weights 1 + 0.3 N(0, 1); pseudo-queries N(0, 1); A_log ~ 0.5 N(0, 1); decay biases N(0, 1);
    balancer biases ~ bias_scale N(0, 1), comparable to the spread of the router scores."""
    gen = torch.Generator().manual_seed(seed)

    def noise(t: Tensor) -> Tensor:
        return torch.randn(t.shape, generator=gen, dtype=F64).to(t.dtype)

    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "query" or leaf == "dt_bias":
            p.copy_(noise(p))
        elif leaf == "A_log":
            p.copy_(0.5 * noise(p))
        elif p.dim() == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.3 * noise(p))
        else:  # [out, in] projections, [C, W] conv taps, [E, out, in] expert stacks, [V, d] embeddings
            p.copy_(noise(p) / math.sqrt(p.shape[-1]))
    for name, b in module.named_buffers():
        if name.endswith("balancer.bias"):
            b.copy_(bias_scale * noise(b))
    return module


def assert_matches(
    run_module: Callable[[], Tensor],
    run_reference: Callable[[], Tensor],
    leaves: dict[str, Tensor],
    seed: int = 0,
    rtol: float = FLOAT64_RTOL,
) -> None:
    """Forward, and the gradient of <output, R> (R random) with respect to every leaf, agree to rtol.

    Every leaf must get a non-zero gradient from the reference: a leaf the formula does not use is a
    mistake in the test."""
    out, ref = run_module(), run_reference()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert rel(out, ref) < rtol, f"forward: rel. error {rel(out, ref):.3e}"
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    names, tensors = list(leaves), list(leaves.values())
    got = torch.autograd.grad((out * cotangent).sum(), tensors, allow_unused=True)
    want = torch.autograd.grad((ref * cotangent).sum(), tensors, allow_unused=True)
    for name, g, w in zip(names, got, want):
        assert w is not None and w.norm() > 0, f"the reference does not depend on {name}"
        assert g is not None, f"no gradient reaches {name}"
        assert rel(g, w) < rtol, f"d/d {name}: rel. error {rel(g, w):.3e}"


def parameters_of(module: nn.Module, skip: Sequence[str] = ()) -> dict[str, Tensor]:
    return {n: p for n, p in module.named_parameters() if not any(n.startswith(s) for s in skip)}


def output_and_gradients(module: nn.Module, x: Tensor) -> list[Tensor]:
    """[y, dx, then every parameter's gradient] of loss sum(y^2): what two backends of one layer
    must agree on."""
    xi = x.clone().requires_grad_(True)
    y = module(xi)
    y.square().sum().backward()
    return [y.detach(), xi.grad] + [p.grad for p in module.parameters() if p.grad is not None]
