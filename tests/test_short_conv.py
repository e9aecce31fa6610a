"""The fused short-convolution kernels (moe_lc_kernels.short_conv) and the op's dispatch
(moe_lc.ops.short_conv) against float64 references.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
first imported), so shapes stay small; tiny tiles (BT=16, BC=32) make T span several T blocks and
C = 40 end in a partial channel block. References: the torch backend in float64, and each document
run alone through F.conv1d.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc_kernels.short_conv as kernel_module  # noqa: E402
from moe_lc.model.short_conv import ShortConv, causal_depthwise_conv  # noqa: E402
from moe_lc.ops.documents import DocumentBounds  # noqa: E402
from moe_lc.ops.short_conv import resolve_backend, short_conv, short_conv_pieces  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
TOL = 1e-5  # fp32 kernels vs float64 (measured ~1e-7)
DOC_LENS = [1, 2, 3, 7, 20, 1, 33, 2, 41]  # 110 tokens; boundaries fall inside and across 16-row tiles


@pytest.fixture(params=["tiles", "rows", "fused"])
def small_tiles(monkeypatch, request):
    """Tiles of 16 x 32 so that T = 50..150 spans several T blocks and C = 40 two channel blocks; each
    test runs the tile kernels, the row kernels (steps of 4 rows: four steps a program) and the tile
    forward with the SiLU backward fused into dx and dweight's row kernel."""
    monkeypatch.setattr(kernel_module, "TUNING", dict(fwd_bt=16, fwd_bc=32, fwd_warps=4, bwd_bt=16, bwd_bc=32,
                                                       bwd_warps=4, rows=int(request.param == "rows"), rows_r=4,
                                                       fused_bwd=int(request.param == "fused"), fused_bt=16,
                                                       fused_bc=32, fused_warps=4))
    return request.param


def tiles_only(layout: str) -> None:
    """The row kernels take minutes in Triton's interpreter at the larger cases; the smaller ones test them."""
    if layout != "tiles":
        pytest.skip("the row kernels run this case's smaller sibling (interpreter time)")


def silu_only(layout: str, activation) -> None:
    """The fused layout changes only the SiLU backward: without SiLU it runs the tile kernels' case again."""
    if layout == "fused" and activation is None:
        pytest.skip("without SiLU the fused layout is the tile kernels' case")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values (NaN marks unwritten outputs)"
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEVICE)


def inputs(batch: int, seq_len: int, channels: int = 40, width: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, channels, generator=gen)
    w = torch.randn(channels, width, generator=gen)
    dout = torch.randn(batch, seq_len, channels, generator=gen)
    return x.to(DEVICE), w.to(DEVICE), dout.to(DEVICE)


def run(fn, x, w, dout):
    """(output, dx, dweight) of fn(x, w) with cotangent dout."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dout.to(y.dtype))
    return y, dx, dw


def assert_close(got, ref, tol=TOL):
    errors = {name: rel(a, b) for name, a, b in zip(("y", "dx", "dweight"), got, ref)}
    assert all(e < tol for e in errors.values()), errors


def per_document_reference(x, w, dout, lens, activation):
    """Float64 (y, dx, dweight) with every document run alone through F.conv1d (left zero padding)."""
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    C, W = w64.shape
    outs, start = [], 0
    for n in lens:
        xd = x64[:, start:start + n].transpose(1, 2)
        yd = F.conv1d(F.pad(xd, (W - 1, 0)), w64.unsqueeze(1), groups=C).transpose(1, 2)
        outs.append(F.silu(yd) if activation == "silu" else yd)
        start += n
    y = torch.cat(outs, dim=1)
    dx, dw = torch.autograd.grad(y, (x64, w64), dout.double().cpu())
    return y, dx, dw


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("batch,seq_len", [(3, 50), (2, 131)])
def test_matches_float64_without_documents(small_tiles, activation, batch, seq_len):
    silu_only(small_tiles, activation)
    if seq_len > 100:
        tiles_only(small_tiles)
    x, w, dout = inputs(batch, seq_len, seed=seq_len)
    got = run(lambda a, b: short_conv(a, b, activation=activation, backend="triton"), x, w, dout)
    ref = run(lambda a, b: short_conv(a.double(), b.double(), activation=activation, backend="torch"), x, w, dout)
    assert got[0].dtype == torch.float32
    assert_close(got, ref)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_documents_match_float64_and_each_document_alone(small_tiles, activation):
    silu_only(small_tiles, activation)
    lens = DOC_LENS
    x, w, dout = inputs(1, sum(lens), seed=1)
    cu = cu_of(lens)  # DocumentBounds (as the layer passes them) or a plain cu_seqlens tensor
    docs = DocumentBounds.of(cu)
    got = run(lambda a, b: short_conv(a, b, docs, activation=activation, backend="triton"), x, w, dout)
    ref = run(lambda a, b: short_conv(a.double(), b.double(), cu, activation=activation, backend="torch"),
              x, w, dout)
    assert_close(got, ref)
    assert_close(got, per_document_reference(x, w, dout, lens, activation))


@pytest.mark.parametrize("width", [1, 2, 8])
def test_other_widths_with_documents_at_default_tiles(width):
    """Default tile sizes (T = 150 crosses the 64-row tiles); W from 1 to the kernels' maximum 8."""
    lens = [64, 1, 7, 3, 75]
    x, w, dout = inputs(1, sum(lens), width=width, seed=width)
    got = run(lambda a, b: short_conv(a, b, cu_of(lens), backend="triton"), x, w, dout)
    assert_close(got, per_document_reference(x, w, dout, lens, "silu"))


def test_non_contiguous_input(small_tiles):
    x, w, dout = inputs(2, 37, seed=3)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, [B, T, C] with stride(0) = C
    assert not x_t.is_contiguous()
    got = run(lambda a, b: short_conv(a, b, backend="triton"), x_t, w, dout)
    assert_close(got, run(lambda a, b: short_conv(a.double(), b.double(), backend="torch"), x, w, dout))


def test_bf16_stays_bf16_and_close(small_tiles):
    x, w, dout = inputs(2, 45, seed=4)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = run(lambda a, b: short_conv(a, b, backend="triton"), xb, wb, dout)
    assert [t.dtype for t in got] == [torch.bfloat16] * 3
    # reference on the same bf16-rounded inputs, in float64: only the kernels' roundings remain
    assert_close(got, run(lambda a, b: short_conv(a.double(), b.double(), backend="torch"), xb, wb, dout), 1e-2)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_pieces_are_the_chunks_of_one_convolution(small_tiles, activation):
    """short_conv_pieces on the kernels: three groups of 48 channels (each spans two 32-channel
    tiles, the second one partial), each its own contiguous tensor, equal to the float64
    convolution's chunks forward and backward (dx, dweight) with packed documents; a piece whose
    output is unused (no gradient) counts as zero."""
    if activation is None:
        tiles_only(small_tiles)
    lens = DOC_LENS
    x, w, dout = inputs(1, sum(lens), channels=144, seed=6)
    cu = cu_of(lens)
    for used in (3, 2):
        def pieces(a, b, backend):
            out = short_conv_pieces(a, b, 3, DocumentBounds.of(cu) if backend == "triton" else cu,
                                    activation=activation, backend=backend)
            assert len(out) == 3 and all(p.shape == (1, sum(lens), 48) for p in out)
            if backend == "triton":
                assert all(p.is_contiguous() for p in out)
            return torch.cat(out[:used], dim=-1)

        d = dout[..., :48 * used]
        got = run(lambda a, b: pieces(a, b, "triton"), x, w, d)
        ref = run(lambda a, b: pieces(a.double(), b.double(), "torch"), x, w, d)
        assert_close(got, ref)


def test_pieces_of_whole_channel_tiles_with_documents(small_tiles):
    """Three pieces of 64 channels (two whole 32-channel tiles each: the row kernels then drop their
    channel masks) with packed documents long enough for the backward's unmasked steps (no row outside
    [0, T), no document start within a step's reach), against the float64 convolution's chunks."""
    if small_tiles == "tiles":
        pytest.skip("the tile kernels mask every channel: the other pieces tests cover them")
    lens = DOC_LENS
    x, w, dout = inputs(1, sum(lens), channels=192, seed=7)
    cu = cu_of(lens)

    def pieces(a, b, backend):
        out = short_conv_pieces(a, b, 3, DocumentBounds.of(cu) if backend == "triton" else cu, backend=backend)
        return torch.cat(out, dim=-1)

    assert_close(run(lambda a, b: pieces(a, b, "triton"), x, w, dout),
                 run(lambda a, b: pieces(a.double(), b.double(), "torch"), x, w, dout))


def test_short_conv_module_passes_activation_and_backend(small_tiles):
    torch.manual_seed(0)
    conv = ShortConv(40, 4).to(DEVICE)
    x, _, _ = inputs(2, 30, seed=6)
    # default: the plain reference convolution, no activation (behaviour of the module until now)
    assert torch.equal(conv(x), causal_depthwise_conv(x, conv.weight))
    fused = conv(x, activation="silu", backend="triton")
    assert rel(fused, F.silu(causal_depthwise_conv(x.double(), conv.weight.double()))) < TOL


def test_auto_takes_torch_on_cpu_even_under_the_interpreter(monkeypatch):
    x, w = torch.randn(1, 20, 8), torch.randn(8, 4)  # CPU tensors on any machine

    def fail(*args, **kwargs):
        raise AssertionError("auto must not run the Triton interpreter on CPU tensors")

    monkeypatch.setattr(kernel_module, "short_conv_triton", fail)
    assert resolve_backend(x, w, "auto") == "torch"
    assert torch.equal(short_conv(x, w), F.silu(causal_depthwise_conv(x, w)))
    assert resolve_backend(x.double(), w.double(), "auto") == "torch"
    if torch.cuda.is_available():
        assert resolve_backend(x.cuda(), w.cuda(), "auto") == "triton"
        assert resolve_backend(x.cuda().double(), w.cuda().double(), "auto") == "torch"
        assert resolve_backend(x.cuda(), torch.randn(8, 9, device="cuda"), "auto") == "torch"  # W > 8


def test_explicit_triton_that_cannot_run_is_an_error(monkeypatch):
    x, w = torch.randn(1, 20, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    with pytest.raises(RuntimeError, match='fp32/bf16/fp16.*use backend="torch"'):
        short_conv(x.double(), w.double(), backend="triton")
    with pytest.raises(RuntimeError, match="at most 8 taps"):
        short_conv(x, torch.randn(8, 9, device=DEVICE), backend="triton")
    x, w = x.cpu(), w.cpu()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        short_conv(x, w, backend="triton")


@pytest.mark.parametrize("call,message", [
    (lambda x, w: short_conv(x[0], w), r"x must be \[B, T, C\]"),
    (lambda x, w: short_conv(x, w[:, 0]), r"weight must be \[C, W\]"),
    (lambda x, w: short_conv(x, w[:5]), r"C = x.shape\[-1\] = 8"),
    (lambda x, w: short_conv(x, w, torch.tensor([0, 10, 20])), "need B == 1, got B = 2"),
    (lambda x, w: short_conv(x[:1], w, torch.tensor([[0, 20]])), "cu_seqlens must be 1-D"),
    (lambda x, w: short_conv(x[:1], w, DocumentBounds.from_host([0, 5, 19], "cpu")), "end at 19 but x has T = 20"),
    (lambda x, w: short_conv(x, w, activation="gelu"), "unknown activation 'gelu'"),
    (lambda x, w: short_conv(x, w, backend="cuda"), "unknown backend 'cuda'"),
])
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(2, 20, 8), torch.randn(8, 4))
