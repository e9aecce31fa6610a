"""The fused SiTU-GLU kernels (moe_lc_kernels.situ_glu) and their dispatch (moe_lc.ops.situ_glu)
against SiTU written out in float64 from its formula, h = [b1 tanh(a/b1) sigmoid(a)] [b2 tanh(c/b2)].

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
first imported), so sizes stay small; a small block makes a tensor span several programs and end
in a partial one.

Tolerances come from the precision. The kernels compute in fp32 with a few roundings per value and
exp from exp2 of a rounded product (relative error up to |x| ulps for exp(x)); an output in the
input's dtype adds half an ulp of that dtype (GPUs round to nearest; Triton's CPU interpreter
truncates fp32 to bf16, a whole ulp). So an element may be off by
``r eps_out |ref| + eps32 (16 + 2|a|) m``, with r the output rounding (1/2 or 1), m = |ref| for the products (h, dc) and, for da, whose
two terms cancel where b1 tanh(a/b1) sigmoid(a) has its minimum, the sum of the terms' magnitudes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc_kernels.situ_glu as kernel_module  # noqa: E402
from moe_lc.model.ffn import GatedFFN  # noqa: E402
from moe_lc.ops.situ_glu import glu_activation, glu_activation_stacked, resolve_backend, situ_glu  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
OUTPUT_ROUNDING = 1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.5  # in ulps of the output dtype
B1, B2 = 4.0, 25.0


@pytest.fixture
def small_blocks(monkeypatch):
    """256 elements a program: the [37, 53] inputs span 8 programs, the last one partial."""
    monkeypatch.setattr(kernel_module, "TUNING", dict(block=256, warps=4, bwd_block=256, bwd_warps=4))


def inputs(dtype: torch.dtype, shape=(37, 53), seed: int = 0):
    """a, c, dh with typical pre-activations, tiny ones (where b tanh(x/b) ~ x must keep its
    relative precision), the SiTU-gate minimum near a = -1.5, saturated ones and exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=gen, dtype=F64) * 3.0
    c = torch.randn(shape, generator=gen, dtype=F64) * 20.0
    flat_a, flat_c = a.view(-1), c.view(-1)
    flat_a[:40] = torch.logspace(-6, 0, 40, dtype=F64) * torch.tensor([1.0, -1.0], dtype=F64).repeat(20)
    flat_c[:40] = torch.logspace(-6, 0, 40, dtype=F64)
    flat_a[40:60] = torch.linspace(-2.0, -1.0, 20, dtype=F64)
    flat_a[60:70] = torch.tensor([-40.0, -20.0, -9.0, 9.0, 20.0, 40.0, 0.0, -0.0, 0.25, -0.25], dtype=F64)
    flat_c[60:70] = torch.tensor([-300.0, -90.0, 0.0, 90.0, 300.0, 1e-3, 0.0, -6.25, 6.25, -1e-3], dtype=F64)
    dh = torch.randn(shape, generator=gen, dtype=F64)
    return a.to(dtype).to(DEVICE), c.to(dtype).to(DEVICE), dh.to(dtype).to(DEVICE)


def reference_terms(a: torch.Tensor, c: torch.Tensor, dh: torch.Tensor) -> dict[str, torch.Tensor]:
    """h, da, dc in float64 from the formula, and the magnitudes that bound each one's error."""
    a, c, dh = (t.detach().cpu().to(F64) for t in (a, c, dh))
    g, s, u = B1 * torch.tanh(a / B1), torch.sigmoid(a), B2 * torch.tanh(c / B2)
    sech_a, sech_c = 1.0 - torch.tanh(a / B1) ** 2, 1.0 - torch.tanh(c / B2) ** 2
    da_terms = (sech_a * s, g * s * (1.0 - s))
    h = g * s * u
    da = dh * u * (da_terms[0] + da_terms[1])
    dc = dh * g * s * sech_c
    da_size = (dh * u).abs() * (da_terms[0].abs() + da_terms[1].abs())
    return dict(h=h, da=da, dc=dc, h_size=h.abs(), da_size=da_size, dc_size=dc.abs(), a=a)


def assert_within(out: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, a: torch.Tensor, name: str) -> None:
    """|out - ref| <= r eps_out |ref| + eps32 (16 + 2|a|) size, elementwise (module docstring)."""
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    eps_out = torch.finfo(out.dtype).eps
    err = (out.detach().cpu().to(F64) - ref).abs()
    bound = OUTPUT_ROUNDING * eps_out * ref.abs() + EPS32 * (16.0 + 2.0 * a.abs()) * size + torch.finfo(out.dtype).tiny
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name} ({out.dtype}): error reaches {worst:.2f} x its bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_both_gradients_match_float64(dtype, small_blocks):
    a, c, dh = inputs(dtype)
    a.requires_grad_(True)
    c.requires_grad_(True)
    h = situ_glu(a, c, B1, B2, backend="triton")
    da, dc = torch.autograd.grad(h, (a, c), dh)
    ref = reference_terms(a, c, dh)
    assert h.dtype == da.dtype == dc.dtype == dtype
    assert_within(h, ref["h"], ref["h_size"], ref["a"], "h")
    assert_within(da, ref["da"], ref["da_size"], ref["a"], "da")
    assert_within(dc, ref["dc"], ref["dc_size"], ref["a"], "dc")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_halves_are_the_same_math_read_and_written_in_place(dtype, small_blocks):
    """glu_activation_stacked on y = [a | c] (one GEMM's output over stacked gate and input weights):
    the kernel reads both halves of each row in place and writes dy = [da | dc] as one tensor; each
    element is the same fp32 math as the kernel on separate a and c, so equal bit for bit, and
    within the float64 bound. The reference dispatch splits y and gives the reference's values."""
    a, c, dh = inputs(dtype)
    y = torch.cat([a, c], dim=-1).requires_grad_(True)
    h = glu_activation_stacked(y, "situ", B1, B2, backend="triton")
    dy, = torch.autograd.grad(h, y, dh)
    assert h.shape == a.shape and dy.shape == y.shape and dy.is_contiguous()
    a_, c_ = a.clone().requires_grad_(True), c.clone().requires_grad_(True)
    h_plain = situ_glu(a_, c_, B1, B2, backend="triton")
    da, dc = torch.autograd.grad(h_plain, (a_, c_), dh)
    hidden = a.shape[-1]
    assert torch.equal(h, h_plain) and torch.equal(dy[:, :hidden], da) and torch.equal(dy[:, hidden:], dc)
    ref = reference_terms(a, c, dh)
    assert_within(h, ref["h"], ref["h_size"], ref["a"], "h")
    assert_within(dy[:, hidden:], ref["dc"], ref["dc_size"], ref["a"], "dc")
    y_ref = y.detach().clone().requires_grad_(True)
    h_ref = glu_activation_stacked(y_ref, "situ", B1, B2, backend="torch")
    # the same elementwise ops on strided halves (the CPU's vectorised and scalar loops may round apart)
    close = dict(rtol=4 * torch.finfo(dtype).eps, atol=0.0)
    torch.testing.assert_close(h_ref, glu_activation(a, c, "situ", B1, B2, backend="torch"), **close)
    swiglu = glu_activation_stacked(y_ref, "swiglu", B1, B2)
    torch.testing.assert_close(swiglu, torch.nn.functional.silu(a) * c, **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_halves_may_be_columns_of_a_wider_output(dtype, small_blocks):
    """y = [a | c] as columns of a wider GEMM output (``LatentMoE`` stacks the router and W_down with
    the shared experts' weights): the kernel reads the strided rows in place, bit for bit what it
    computes from the same y made contiguous, and writes dy contiguous."""
    a, c, dh = inputs(dtype)
    pad = lambda n: torch.randn(a.shape[0], n, device=a.device).to(dtype)  # noqa: E731
    wide = torch.cat([pad(5), a, c, pad(3)], dim=-1)
    wide.requires_grad_(True)
    y = wide[:, 5:5 + 2 * a.shape[-1]]
    assert y.stride(0) == wide.shape[1] and not y.is_contiguous()
    h = glu_activation_stacked(y, "situ", B1, B2, backend="triton")
    dwide, = torch.autograd.grad(h, wide, dh)
    y_dense = y.detach().contiguous().requires_grad_(True)
    h_dense = glu_activation_stacked(y_dense, "situ", B1, B2, backend="triton")
    dy_dense, = torch.autograd.grad(h_dense, y_dense, dh)
    assert torch.equal(h, h_dense) and torch.equal(dwide[:, 5:5 + 2 * a.shape[-1]], dy_dense)
    assert not dwide[:, :5].any() and not dwide[:, 5 + 2 * a.shape[-1]:].any()


def test_backward_keeps_only_a_and_c():
    """h is recomputed in backward, never stored: the autograd graph holds exactly a and c."""
    a, c, _ = inputs(torch.float32, shape=(8, 16))
    a.requires_grad_(True)
    c.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        situ_glu(a, c, B1, B2, backend="triton")
    assert len(saved) == 2 and all(t.shape == a.shape for t in saved)
    assert {t.data_ptr() for t in saved} == {a.data_ptr(), c.data_ptr()}


def test_non_contiguous_and_empty_inputs():
    a, c, dh = inputs(torch.float32, shape=(16, 12))
    a_t, c_t = a.t().requires_grad_(True), c.t().requires_grad_(True)  # [12, 16] views
    h = situ_glu(a_t, c_t, B1, B2, backend="triton")
    da, dc = torch.autograd.grad(h, (a_t, c_t), dh.t())
    ref = reference_terms(a_t, c_t, dh.t())
    assert_within(h, ref["h"], ref["h_size"], ref["a"], "h")
    assert_within(da, ref["da"], ref["da_size"], ref["a"], "da")
    assert_within(dc, ref["dc"], ref["dc_size"], ref["a"], "dc")
    empty = torch.zeros(0, 5, device=DEVICE, requires_grad=True)
    out = situ_glu(empty, empty, backend="triton")
    out.sum().backward()
    assert out.shape == (0, 5) and empty.grad.shape == (0, 5)


def test_gated_ffn_is_the_same_through_either_backend():
    """The dense FFN and the shared experts reach the kernel through GatedFFN's activation_backend."""
    torch.manual_seed(0)
    ffn = GatedFFN(16, 24).to(DEVICE)
    x = torch.randn(10, 16, device=DEVICE)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        ffn.activation_backend = backend
        ffn.zero_grad()
        y = ffn(x)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append(ffn.w_gate.weight.grad.clone())
    assert torch.allclose(outs[1], outs[0], rtol=64 * EPS32, atol=64 * EPS32 * outs[0].abs().max().item())
    assert torch.allclose(grads[1], grads[0], rtol=64 * EPS32, atol=64 * EPS32 * grads[0].abs().max().item())


def test_dispatch_choices_and_errors():
    a = torch.zeros(3, 4, device=DEVICE)
    assert resolve_backend(a, a, "auto") == ("triton" if a.is_cuda else "torch")  # never the CPU interpreter
    assert resolve_backend(a, a, "torch") == "torch"
    with pytest.raises(RuntimeError, match="one shape"):
        situ_glu(a, torch.zeros(3, 1, device=DEVICE), backend="triton")
    with pytest.raises(RuntimeError, match="fp32/bf16/fp16"):
        situ_glu(a.double(), a.double(), backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        situ_glu(a, a, backend="cuda")
    with pytest.raises(ValueError, match="unknown GLU activation"):
        glu_activation(a, a, "gelu", B1, B2)


def test_the_kernels_are_custom_ops_whose_fake_and_autograd_agree_with_them():
    """torch.library's checks of the four ops: schema (nothing mutated, no output aliasing an input),
    fake kernels with the real outputs' shapes, dtypes and strides (what a compiled graph plans
    with), and autograd registered on the forward ops."""
    a, c, dh = (t.float().requires_grad_(i < 2) for i, t in enumerate(inputs(torch.float32, shape=(8, 12))))
    y = torch.cat([a, c], dim=-1).detach().requires_grad_(True)
    ops = torch.ops.moe_lc
    torch.library.opcheck(ops.situ_glu.default, (a, c, B1, B2))
    torch.library.opcheck(ops.situ_glu_backward.default, (a.detach(), c.detach(), dh, B1, B2))
    torch.library.opcheck(ops.situ_glu_stacked.default, (y, B1, B2))
    torch.library.opcheck(ops.situ_glu_stacked_backward.default, (y.detach(), dh, B1, B2))
