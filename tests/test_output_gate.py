"""The sigmoid output gate's fused kernels (moe_lc_kernels.output_gate) and their dispatch
(moe_lc.ops.output_gate) against the formula written out in float64:

    y = sigmoid(g) * w x / sqrt(mean(x^2) + eps)   (per group of the last dim: KDA's heads)
    y = sigmoid(g) * x                             (MLA)

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
first imported); small launch blocks make the inputs span several programs and end in a partial
one, and the gate is a column slice of a wider tensor, as the models pass it.

Tolerances come from the precision: fp32 math over a group of K values (the sum of squares: K
roundings), the sigmoid from exp2 of a rounded product (|g| ulps) and an approximate rsqrt (a few),
so an element may be off by ``eps32 (K + 16 + 2|g|) size`` plus the output's rounding ``r eps_out
|ref|`` (r = 1/2 on a GPU, 1 in the interpreter, which truncates), where size is |ref| for products
and the sum of the terms' magnitudes where terms cancel (dx with the norm); dw sums N rows more.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc_kernels.output_gate as kernel_module  # noqa: E402
from moe_lc.config import KDAConfig  # noqa: E402
from moe_lc.model.kda import KDAttention  # noqa: E402
from moe_lc.model.norm import GatedRMSNorm  # noqa: E402
from moe_lc.ops.output_gate import gated_output, resolve_backend  # noqa: E402
from moe_lc.parallel.compile import CompileTarget, compile_targets  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
OUTPUT_ROUNDING = 1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.5
NORM_EPS = 1e-6


@pytest.fixture
def small_blocks(monkeypatch):
    """8 rows a program and 128-column groups without the norm: the inputs span several programs
    along both axes, the last ones partial."""
    monkeypatch.setattr(kernel_module, "TUNING", dict(rows=8, warps=4, bwd_rows=8, bwd_warps=2, group=128))


def gate_slice(shape, dtype, seed: int) -> torch.Tensor:
    """A gate of ``shape`` read in place from a wider [..., 5 + columns] tensor (a projection's output
    columns), with saturated, tiny and zero logits among normal ones."""
    gen = torch.Generator().manual_seed(seed)
    columns = 1
    for n in shape[2:]:
        columns *= n
    wide = torch.randn(*shape[:2], 5 + columns, generator=gen, dtype=F64) * 3.0
    flat = wide[..., 5:].reshape(-1)
    flat[:8] = torch.tensor([-60.0, -20.0, -1e-4, 0.0, 1e-4, 20.0, 60.0, -0.5], dtype=F64)
    return wide.to(dtype).to(DEVICE)[..., 5:].view(shape)


def reference(x: torch.Tensor, g: torch.Tensor, w, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """y and the gradients in float64 from the formula, with the magnitudes that bound their errors."""
    x, g, dy = (t.detach().cpu().to(F64) for t in (x, g, dy))
    s = 1.0 / (1.0 + torch.exp(-g))
    if w is None:
        n = x
        dx = dy * s
        dx_size = dx.abs()
        out = dict(dw=None)
    else:
        w = w.detach().cpu().to(F64)
        r = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS)
        xh = x * r
        n = xh * w
        dn = dy * s
        wdn = w * dn
        dx = r * (wdn - xh * (wdn * xh).mean(-1, keepdim=True))
        dx_size = r * (wdn.abs() + xh.abs() * (wdn * xh).abs().mean(-1, keepdim=True))
        rows = dn * xh
        out = dict(dw=rows.reshape(-1, w.numel()).sum(0), dw_size=rows.abs().reshape(-1, w.numel()).sum(0),
                   dw_rows=rows.reshape(-1, w.numel()).shape[0])
    y = s * n
    dg = dy * n * s * (1.0 - s)
    out.update(y=y, dx=dx, dg=dg, y_size=y.abs(), dx_size=dx_size, dg_size=dg.abs(), g=g)
    return out


def assert_within(out: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, g: torch.Tensor, group: int,
                  name: str, extra_terms: float = 0.0) -> None:
    """|out - ref| <= r eps_out |ref| + eps32 (K + 16 + 2|g| + extra) size, elementwise (module docstring)."""
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    eps_out = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 0.0
    out = out.detach().cpu().to(F64)
    bound = OUTPUT_ROUNDING * eps_out * ref.abs() + EPS32 * (group + 16 + 2 * g.abs() + extra_terms) * size + 1e-30
    excess = ((out - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"{name}: error {excess:.2f}x its bound"


def run(x, g, w, dy):
    xs = x.detach().requires_grad_()
    gs = g.detach().requires_grad_()
    ws = None if w is None else w.detach().requires_grad_()
    y = gated_output(xs, gs, ws, NORM_EPS, backend="triton")
    y.backward(dy)
    return y, xs.grad, gs.grad, (None if ws is None else ws.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_norm_matches_the_formula_in_float64(small_blocks, dtype):
    shape = (2, 37, 3, 16)  # 74 rows over 10 programs of 8, three heads of 16
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen, dtype=F64) * 2.0).to(dtype).to(DEVICE)
    x[0, 0, 0] = 0.0  # a head of zeros: rms = sqrt(eps)
    g = gate_slice(shape, dtype, seed=2)
    assert g.stride(-1) == 1 and not g.is_contiguous()
    w = (torch.rand(16, generator=gen, dtype=F64) + 0.5).float().to(DEVICE)
    dy = torch.randn(shape, generator=gen, dtype=F64).to(dtype).to(DEVICE)
    y, dx, dg, dw = run(x, g, w, dy)
    ref = reference(x, g, w, dy)
    assert y.dtype == dtype and dx.dtype == dtype and dg.dtype == dtype and dw.dtype == torch.float32
    for name in ("y", "dx", "dg"):
        assert_within(locals()[name], ref[name], ref[f"{name}_size"], ref["g"], 16, name)
    assert_within(dw, ref["dw"], ref["dw_size"], ref["g"].abs().amax(), 16, "dw", extra_terms=ref["dw_rows"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_gate_matches_the_formula_in_float64(small_blocks, dtype):
    shape = (2, 21, 200)  # 200 columns: a full group of 128 and a masked one
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen, dtype=F64) * 2.0).to(dtype).to(DEVICE)
    g = gate_slice(shape, dtype, seed=4)
    dy = torch.randn(shape, generator=gen, dtype=F64).to(dtype).to(DEVICE)
    y, dx, dg, _ = run(x, g, None, dy)
    ref = reference(x, g, None, dy)
    for name in ("y", "dx", "dg"):
        assert_within(locals()[name], ref[name], ref[f"{name}_size"], ref["g"], 0, name)


def test_auto_takes_the_kernels_only_on_cuda_and_bad_inputs_say_why():
    x = torch.randn(4, 2, 16, device=DEVICE)
    assert resolve_backend(x, x, torch.ones(16, device=DEVICE)) == ("triton" if DEVICE == "cuda" else "torch")
    assert resolve_backend(x, x, None, "torch") == "torch"
    with pytest.raises(RuntimeError, match="power of two"):
        gated_output(torch.randn(4, 2, 12, device=DEVICE), torch.randn(4, 2, 12, device=DEVICE),
                     torch.ones(12, device=DEVICE), backend="triton")
    with pytest.raises(RuntimeError, match="one shape"):
        gated_output(x, x[:, :1], backend="triton")


def test_the_kda_layer_gives_the_same_output_and_gradients_through_either_backend():
    """The model's KDA layer: its gated output norm on the kernels against the reference."""
    torch.manual_seed(0)
    layer = KDAttention(32, KDAConfig(num_heads=2, head_dim=16, backend="torch")).to(DEVICE)
    x = torch.randn(2, 24, 32, device=DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        layer.o_norm.backend = backend
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        y = layer(xs)
        y.square().sum().backward()
        results[backend] = (y.detach(), xs.grad, layer.o_norm.weight.grad.clone(), layer.gate_proj[0].weight.grad.clone())
    for a, b in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_gated_norm_is_left_uncompiled_where_it_runs_its_kernels():
    layer = torch.nn.ModuleDict(dict(norm=GatedRMSNorm(16), plain=GatedRMSNorm(16, backend="torch")))
    assert compile_targets(layer, [CompileTarget.norms], torch.device("cuda")) == ["plain"]
    assert compile_targets(layer, [CompileTarget.norms], torch.device("cpu")) == ["norm", "plain"]
