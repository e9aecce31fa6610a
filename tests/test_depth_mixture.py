"""The fused AttnRes depth-mixture kernels (moe_lc_kernels.depth_mixture) and their dispatch
(moe_lc.ops.depth_mixture) against the mixture written out in float64 from its formula,

    h = sum_i a_i v_i,   a = softmax_i(logit_i),   logit_i = w . u_i,   u_i = r_i v_i,   w = g q,
    r_i = 1 / sqrt(mean(v_i^2) + eps),

and its gradient for an output gradient G, with da_i = G . v_i and dl_i = a_i (da_i - sum_j a_j da_j):
dv_i = a_i G + r_i dl_i (w - u_i logit_i / d), dq = g P, dg = q P, P = sum over tokens and i of dl_i u_i.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
first imported), so sizes stay small; small blocks make d = 40 span three tiles (the last one
partial) and N = 10 tokens three row blocks (the last one partial) over two programs, so that
the programs stride over the row blocks and each adds two blocks into its partial sums.

Tolerances come from the precision. Along any path to an output the kernels round at most
n = d + S + 16 times in fp32 (a d-term dot product or sum of squares in some order, an S-term
softmax normaliser and mixture, a few products, rsqrt, exp and a division of a few ulps each);
the query's and the gain's gradients add the sum over N tokens (n + N). A sum's rounding is
relative to the sum of its terms' magnitudes, not to its value, so each output is bounded by
eps32 times the same expression evaluated with every term replaced by its magnitude ("mag", in
float64). The mixture weights a carry the logits' errors, which are absolute (at most n eps32 L,
L = max_i r_i sum_c |w_c v_ic| per token), plus the exp of a rounded product (relative error up
to |logit - max| ulps on a GPU): relative to a, 2 n eps32 (1 + L) covers both. So

    |out - ref| <= eps_n mag + r eps_out (|ref| + eps_n mag),   eps_n = 2 n eps32 (1 + L),

where the second term is the rounding to the output dtype: r = 1/2 ulp on a GPU (round to
nearest), a whole ulp in the interpreter (which truncates fp32 to bf16). With d = 40 this is
~1e-4 of the magnitudes. A source of rms 1e-3 (mean of squares = eps) makes a dropped or
misplaced eps move its mixture weight by tens of percent; a wrong sign of any term of dv moves
dv by at least that term, against bounds four orders of magnitude smaller.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import moe_lc.model.attn_res as attn_res_module  # noqa: E402
import moe_lc_kernels.depth_mixture as kernel_module  # noqa: E402
from moe_lc.model.attn_res import DepthMixer  # noqa: E402
from moe_lc.model.attn_res import ResidualStream  # noqa: E402
from moe_lc.model.norm import GatedRMSNorm, RMSNorm  # noqa: E402
from moe_lc.ops.depth_mixture import GradientSum, add_to_partial_sum, depth_mixture, resolve_backend  # noqa: E402
from moe_lc.ops.depth_mixture import triton_unsupported_reason  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402
from moe_lc_kernels.depth_mixture import MAX_SOURCES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS32 = torch.finfo(F32).eps
OUTPUT_ROUNDING = 1.0 if os.environ.get("TRITON_INTERPRET") == "1" else 0.5  # in ulps of the output dtype
EPS = 1e-6
B, T, D = 2, 5, 40


TILED = dict(fwd_rows=4, fwd_block_d=16, fwd_warps=4, bwd_rows=4, bwd_block_d=16, bwd_warps=4, l2_budget=0, programs=2,
             resident_max_values=80,
             **{f"{p}_resident_{k}": v for p in ("fwd", "bwd")
                for k, v in dict(max_d=0, rows=4, cols_per_warp=64, per_sm=1, prefetch=0, maxnreg=0).items()})
RESIDENT = dict(TILED, fwd_resident_max_d=64, bwd_resident_max_d=64)
PREFETCHING = dict(RESIDENT, fwd_resident_prefetch=1, bwd_resident_prefetch=1)


@pytest.fixture(params=["tiled", "resident", "prefetch"])
def small_blocks(request, monkeypatch):
    """Either kernel family over two programs. Tiled: 4 rows x 16 columns a tile, 3 row blocks (the
    last partial) x 3 tiles (the last partial). Resident: 4 whole rows (d = 40 in 64 columns, the last
    24 masked) at a time, 3 row blocks (the last partial), so one program adds two blocks into its sums;
    prefetch: the resident kernels loading each program's next row block ahead (past the last: none)."""
    tuning = {"tiled": TILED, "resident": RESIDENT, "prefetch": PREFETCHING}[request.param]
    monkeypatch.setattr(kernel_module, "TUNING", tuning)
    return request.param


def make_inputs(dtypes: list[torch.dtype], query_scale: float = 0.3, seed: int = 0, tiny_source: bool = True):
    """Sources of varied scales (source 1 with rms 1e-3, where eps matters, unless not ``tiny_source``),
    query, gain and output gradient."""
    gen = torch.Generator().manual_seed(seed)
    scales = [1e-3 if i == 1 and tiny_source else 0.5 + i for i in range(len(dtypes))]
    sources = [(torch.randn(B, T, D, generator=gen, dtype=F64) * s).to(dt).to(DEVICE).requires_grad_()
               for s, dt in zip(scales, dtypes)]
    query = (torch.randn(D, generator=gen, dtype=F64) * query_scale).float().to(DEVICE).requires_grad_()
    gain = (1 + 0.3 * torch.randn(D, generator=gen, dtype=F64)).float().to(DEVICE).requires_grad_()
    out_dtype = dtypes[0]
    for dt in dtypes[1:]:
        out_dtype = torch.promote_types(out_dtype, dt)
    grad = torch.randn(B, T, D, generator=gen, dtype=F64).to(out_dtype).to(DEVICE)
    return sources, query, gain, grad


def expected(sources, query, gain, grad) -> dict:
    """The formula in float64 (plain tensor ops, [S, B, T, d]), its gradient in closed form, and the
    magnitudes that bound each output's error (module docstring)."""
    v = torch.stack([s.detach().cpu().to(F64) for s in sources])
    q, g, G = query.detach().cpu().to(F64), gain.detach().cpu().to(F64), grad.cpu().to(F64)
    S = v.shape[0]
    w = g * q
    r = 1.0 / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS)  # [S, B, T, 1]
    u = v * r
    logit = (u * w).sum(-1, keepdim=True)
    a = torch.softmax(logit, dim=0)
    h = (a * v).sum(0)
    da = (G * v).sum(-1, keepdim=True)
    dl = a * (da - (a * da).sum(0, keepdim=True))
    dv = a * G + r * dl * (w - u * logit / D)
    P = (dl * u).sum(dim=(0, 1, 2))
    # magnitudes: every term by its absolute value
    L = (r * (w.abs() * v.abs()).sum(-1, keepdim=True)).amax(0)  # [B, T, 1]
    da_mag = (G.abs() * v.abs()).sum(-1, keepdim=True)
    dl_mag = a * (da_mag + (a * da_mag).sum(0, keepdim=True))
    logit_mag = r * (w.abs() * v.abs()).sum(-1, keepdim=True)
    dv_mag = a * G.abs() + r * dl_mag * (w.abs() + u.abs() * logit_mag / D)
    P_mag = (dl_mag * u.abs()).sum(dim=(0, 1, 2))
    n = D + S + 16
    eps_n = 2 * n * EPS32 * (1 + L)  # per token
    eps_p = 2 * (n + B * T) * EPS32 * (1 + L.max())
    return dict(h=h, dv=dv, dq=g * P, dg=q * P, h_bound=eps_n * (a * v.abs()).sum(0), dv_bound=eps_n * dv_mag,
                dq_bound=eps_p * g.abs() * P_mag, dg_bound=eps_p * q.abs() * P_mag, a=a)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, name: str) -> None:
    """|out - ref| <= bound + r eps_out (|ref| + bound), elementwise (module docstring)."""
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    eps_out = torch.finfo(out.dtype).eps
    err = (out.detach().cpu().to(F64) - ref).abs()
    total = bound + OUTPUT_ROUNDING * eps_out * (ref.abs() + bound) + torch.finfo(out.dtype).tiny
    worst = (err / total).max().item()
    assert worst <= 1.0, f"{name} ({out.dtype}): error reaches {worst:.2f} x its bound"


def check_against_float64(dtypes: list[torch.dtype], query_scale: float = 0.3) -> dict:
    sources, query, gain, grad = make_inputs(dtypes, query_scale)
    h = depth_mixture(sources, query, gain, EPS, backend="triton")
    grads = torch.autograd.grad(h, [*sources, query, gain], grad)
    ref = expected(sources, query, gain, grad)
    out_dtype = grad.dtype
    assert h.dtype == out_dtype and h.shape == (B, T, D)
    assert_within(h, ref["h"], ref["h_bound"], "h")
    for i, (dv, v) in enumerate(zip(grads, sources)):
        assert dv.dtype == v.dtype
        assert_within(dv, ref["dv"][i], ref["dv_bound"][i], f"dv[{i}]")
    assert grads[-2].dtype == grads[-1].dtype == F32
    assert_within(grads[-2], ref["dq"], ref["dq_bound"], "d_query")
    assert_within(grads[-1], ref["dg"], ref["dg_bound"], "d_norm_weight")
    return ref


def test_the_closed_form_gradient_is_autograd_of_the_formula():
    """The backward formula above (what the kernel computes) against autograd, both in float64."""
    sources, query, gain, grad = make_inputs([F32, F32, F32])
    v = [s.detach().cpu().to(F64).requires_grad_() for s in sources]
    q, g = query.detach().cpu().to(F64).requires_grad_(), gain.detach().cpu().to(F64).requires_grad_()
    u = [x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) for x in v]
    a = torch.softmax(torch.stack([(ui * g * q).sum(-1) for ui in u]), dim=0)
    h = sum(a[i].unsqueeze(-1) * x for i, x in enumerate(v))
    autograd = torch.autograd.grad(h, [*v, q, g], grad.cpu().to(F64))
    ref = expected(sources, query, gain, grad)
    assert (h - ref["h"]).abs().max() < 1e-12
    for got, want in zip(autograd, [*ref["dv"], ref["dq"], ref["dg"]]):
        assert (got - want).abs().max() < 1e-12 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtypes", [
    pytest.param([F32] * 4, id="four-fp32"),
    pytest.param([F32, BF16, BF16], id="fp32-embedding-bf16-sums"),
    pytest.param([BF16] * 3, id="bf16-only"),
    pytest.param([F32, F16], id="two-sources-fp32-fp16"),
    pytest.param([F32] + [BF16] * (MAX_SOURCES - 1), id="maximum-sources"),
])
def test_forward_and_every_gradient_match_float64(dtypes, small_blocks):
    check_against_float64(dtypes)


def test_zero_query_is_the_uniform_mean_and_still_has_a_query_gradient(small_blocks):
    ref = check_against_float64([F32, BF16, BF16, BF16], query_scale=0.0)
    assert torch.allclose(ref["a"], torch.full_like(ref["a"], 0.25), rtol=0, atol=1e-15)
    assert ref["dq"].abs().max() > 1e-3  # the gradient that moves the query off zero


def test_the_kernels_keep_the_sources_and_three_numbers_per_source_and_token(small_blocks):
    """a; r and the logit in one [2S, N] tensor."""
    sources, query, gain, _ = make_inputs([F32, BF16, BF16])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        depth_mixture(sources, query, gain, EPS, backend="triton")
    inputs = {t.data_ptr() for t in (*sources, query, gain)}
    new = [t for t in saved if t.data_ptr() not in inputs]
    assert {t.data_ptr() for t in saved} >= inputs
    assert sorted(t.shape for t in new) == [(3, B * T), (6, B * T)] and all(t.dtype == F32 for t in new)


def test_non_dense_sources_and_no_tokens(small_blocks):
    sources, query, gain, grad = make_inputs([F32, BF16])
    wide = [torch.cat([s, s], dim=1).detach()[:, :T].requires_grad_() for s in sources]  # rows not dense
    h = depth_mixture(wide, query, gain, EPS, backend="triton")
    ref = expected(wide, query, gain, grad)
    assert_within(h, ref["h"], ref["h_bound"], "h")
    empty = [torch.zeros(0, D, device=DEVICE, requires_grad=True) for _ in range(2)]
    out = depth_mixture(empty, query, gain, EPS, backend="triton")
    out.sum().backward()
    assert out.shape == (0, D) and empty[0].grad.shape == (0, D)


def test_dispatch_choices_and_errors(monkeypatch):
    v, q, g = [torch.zeros(2, 3, 4, device=DEVICE)] * 2, torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    assert resolve_backend(v, q, g, "auto") == ("triton" if v[0].is_cuda else "torch")  # never the CPU interpreter
    assert resolve_backend(v, q, g, "torch") == "torch"
    wide = [t.double() for t in v]
    assert resolve_backend(wide, q.double(), g.double(), "auto") == "torch"  # fp64 always runs the reference
    with pytest.raises(RuntimeError, match="fp64 runs the reference"):
        depth_mixture(wide, q.double(), g.double(), EPS, backend="triton")
    with pytest.raises(RuntimeError, match=f"at most {MAX_SOURCES} sources"):
        depth_mixture(v * (MAX_SOURCES // 2 + 1), q, g, EPS, backend="triton")
    with pytest.raises(RuntimeError, match="one shape"):
        depth_mixture([v[0], v[0][:, :2]], q, g, EPS, backend="triton")
    strided = torch.zeros(2, 4, 3, device=DEVICE).transpose(1, 2)  # [2, 3, 4], last dim of stride 3
    assert "last dim is contiguous" in triton_unsupported_reason([v[0], strided], q, g)
    with pytest.raises(ValueError, match="unknown backend"):
        depth_mixture(v, q, g, EPS, backend="cuda")
    cpu = [torch.zeros(2, 3, 4)] * 2
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU without the interpreter: no Triton at all
    assert "Triton cannot run on cpu" in triton_unsupported_reason(cpu, q.cpu(), g.cpu())
    assert resolve_backend(cpu, q.cpu(), g.cpu(), "auto") == "torch"
    with pytest.raises(RuntimeError, match='backend "triton" unavailable'):
        depth_mixture(cpu, q.cpu(), g.cpu(), EPS, backend="triton")


def mixer_and_sources(backend: str) -> tuple[DepthMixer, list[torch.Tensor]]:
    mixer = DepthMixer(D, EPS, backend=backend).to(DEVICE)
    sources, query, gain, _ = make_inputs([F32, BF16, BF16])
    with torch.no_grad():
        mixer.query.copy_(query)
        mixer.norm.weight.copy_(gain)
    return mixer, sources


def test_the_depth_mixer_goes_through_the_dispatch(monkeypatch, small_blocks):
    """DepthMixer calls ``depth_mixture`` with its backend; through either one it matches float64."""
    calls = []

    def spy(sources, query, norm_weight, eps, backend="auto", sums=None, out_norm=None):
        calls.append(backend)
        return depth_mixture(sources, query, norm_weight, eps, backend, sums, out_norm)

    monkeypatch.setattr(attn_res_module, "depth_mixture", spy)
    for backend in ("torch", "triton"):
        mixer, sources = mixer_and_sources(backend)
        _, _, _, grad = make_inputs([F32, BF16, BF16])
        out = mixer(sources)
        grads = torch.autograd.grad(out, [*sources, mixer.query, mixer.norm.weight], grad)
        ref = expected(sources, mixer.query, mixer.norm.weight, grad)
        assert_within(out, ref["h"], ref["h_bound"], f"{backend}: h")
        for i, dv in enumerate(grads[:-2]):
            assert_within(dv, ref["dv"][i], ref["dv_bound"][i], f"{backend}: dv[{i}]")
        assert_within(grads[-2], ref["dq"], ref["dq_bound"], f"{backend}: d_query")
        assert_within(grads[-1], ref["dg"], ref["dg_bound"], f"{backend}: d_norm_weight")
    assert calls == ["torch", "triton"]


def test_a_compiled_depth_mixer_runs_the_kernels_eagerly(small_blocks):
    """Under torch.compile the Triton entry point is a graph break: Dynamo never traces the launches."""
    mixer, sources = mixer_and_sources("triton")
    eager = mixer(sources)
    torch._dynamo.reset()
    mixer.compile()
    compiled = mixer(sources)
    assert torch.equal(compiled, eager)


def _three_readers(with_sums: bool) -> dict:
    """Three mixtures read e and b (as every sublayer's mixer reads the embedding and the block sums),
    each later one also the running sum of the earlier ones' tanh outputs (as the stream's partial
    sum): so each later mixture reads something computed from every earlier one's output. e and b
    reach each mixture through a view of its own, whose retained .grad is what that reader handed
    to autograd."""
    gen = torch.Generator().manual_seed(3)
    e = torch.randn(B, T, D, generator=gen).to(DEVICE).requires_grad_()
    b = (2 * torch.randn(B, T, D, generator=gen)).to(DEVICE).requires_grad_()
    queries = [(0.3 * torch.randn(D, generator=gen)).to(DEVICE).requires_grad_() for _ in range(3)]
    gain = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEVICE)
    G = torch.randn(B, T, D, generator=gen).to(DEVICE)
    sums = [GradientSum(), GradientSum()] if with_sums else None
    views, partial = [], None
    for q in queries:
        ev, bv = e.view_as(e), b.view_as(b)
        ev.retain_grad(), bv.retain_grad()
        views.append((ev, bv))
        sources = [ev, bv] + ([partial] if partial is not None else [])
        reader_sums = None if sums is None else (sums + [GradientSum()])[: len(sources)]
        h = depth_mixture(sources, q, gain, EPS, backend="triton", sums=reader_sums)
        partial = torch.tanh(h) if partial is None else partial + torch.tanh(h)
    (partial * G).sum().backward()
    return dict(e=e, b=b, queries=queries, views=views, sums=sums)


def test_gradient_sums_hand_each_source_its_whole_gradient_from_its_first_reader(small_blocks):
    """With one GradientSum per source shared by its readers, the kernels sum the source's gradient
    (the later readers add into it and hand autograd nothing; the first reader, whose backward runs
    last, hands over the sum): each source's gradient is autograd's sum of every reader's share
    (the same fp32 additions in another place: 2 roundings of the shares' magnitudes)."""
    plain, summed = _three_readers(False), _three_readers(True)
    for j, ((pe, pb), (se, sb)) in enumerate(zip(plain["views"], summed["views"])):
        assert pe.grad is not None and pb.grad is not None  # without sums every reader hands its share over
        if j > 0:
            assert se.grad is None and sb.grad is None, f"reader {j} handed autograd its share"
    for name in ("e", "b"):
        shares = torch.stack([getattr(v, "grad") for v in (pair[0 if name == "e" else 1] for pair in plain["views"])])
        magnitude = shares.abs().sum(0)
        got, want = summed[name].grad, plain[name].grad
        assert torch.equal(summed["views"][0][0 if name == "e" else 1].grad, got)  # the first reader's hand-over
        assert (got - want).abs().le(2 * 3 * EPS32 * magnitude + torch.finfo(F32).tiny).all(), name
    for qp, qs in zip(plain["queries"], summed["queries"]):
        assert torch.allclose(qs.grad, qp.grad, rtol=1e-5, atol=1e-6)  # the same kernels on the same values
    assert all(total.claimed and total.total is None for total in summed["sums"])  # nothing left behind


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_next_partial_sums_gradient_reaches_the_partial_through_its_mixtures_kernel(small_blocks, backend):
    """p2 = p + tanh(mixture(e, p)): p's gradient is p2's (through the add) plus the mixture's share.
    With the fused mixture (which claims p's GradientSum), the add hands p2's gradient to the mixture's
    backward kernel as a seed and autograd nothing, and the kernel writes the sum: the same gradient as
    autograd's add, one rounding of the two terms' magnitudes apart (both fp32). With the reference
    mixture (no claim) autograd adds as usual."""
    gen = torch.Generator().manual_seed(4)
    e, p = (torch.randn(B, T, D, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    q = (0.3 * torch.randn(D, generator=gen)).to(DEVICE)
    gain = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEVICE)
    G = torch.randn(B, T, D, generator=gen).to(DEVICE)

    def p_grad(fused: bool) -> tuple[torch.Tensor, torch.Tensor, GradientSum]:
        sums = [GradientSum(), GradientSum()]
        h = depth_mixture([e, p], q, gain, EPS, backend=backend, sums=sums if fused else None)
        f = torch.tanh(h)
        p2 = add_to_partial_sum(p, f, sums[1]) if fused else p + f
        # the mixture's share alone (a backward of its own, so only where nothing is fused)
        share = None if fused else torch.autograd.grad(h, p, (1 - f.detach() ** 2) * G, retain_graph=True)[0]
        (p2 * G).sum().backward()
        return p.grad.clone(), share, sums[1]

    want, share, _ = p_grad(False)
    p.grad = None
    got, _, total = p_grad(True)
    assert total.seed is None and total.total is None  # the seed was taken and the sum handed over
    assert total.claimed == (backend == "triton")
    bound = 2 * EPS32 * (G.abs() + share.abs()) + torch.finfo(F32).tiny
    assert (got - want).abs().le(bound).all()
    assert (want - G).abs().max() > 1e-3  # the mixture's share is there to be lost


def test_the_stream_keeps_one_gradient_sum_per_source_and_a_new_one_per_new_tensor():
    x = [torch.zeros(1, 2, D) for _ in range(4)]
    stream = ResidualStream.start("block", x[0])
    assert len(stream.sums) == 1
    first = stream.sums[0]
    stream = stream.plus(x[1])
    assert stream.sums[0] is first and len(stream.sums) == 2  # the embedding's, and the partial sum's
    partial_sum = stream.sums[1]
    stream = stream.plus(x[2])
    assert stream.sums[0] is first and stream.sums[1] is not partial_sum  # partial + f: a new tensor
    closed = stream.end_layer(0, block_size=1)
    assert closed.sources[1] is stream.partial and closed.sums == stream.sums  # the block sum keeps its own
    assert len(closed.plus(x[3]).sums) == 3
    full = ResidualStream.start("full", x[0]).plus(x[1])
    assert len(full.sums) == 2 and ResidualStream.start("none", x[0]).sums == ()


@pytest.mark.parametrize("fused_norm", [False, True], ids=["norms-apart", "fused-norms"])
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_the_model_with_shared_gradient_sums_has_the_reference_gradients(mode, fused_norm):
    """The tiny model (block AttnRes, blocks of 2 layers: the embedding and the first block sum have
    several readers each) on the fused mixtures, whose backward sums each source's gradient in its
    kernels, against the same model on the reference mixtures, under each checkpointing policy
    (the recompute runs the mixtures again), with the pre-norms apart or in the mixtures' kernels
    (``attn_res.fused_norm``). Both in fp32: the mixtures round in other orders, by
    about (d + S + 16) eps32 ~ 1e-5 of each gradient's magnitude; the bound leaves a factor 10,
    where a source that lost a reader's share is off by the share itself."""
    from moe_lc.model.init import build_model
    from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
    from moe_lc.presets import get_preset

    def grads(backend: str) -> tuple[torch.Tensor, dict]:
        cfg = get_preset("tiny")
        cfg.attn_res.backend, cfg.kda.backend, cfg.attn_res.fused_norm = backend, "torch", fused_norm
        model = build_model(cfg.validate(), DEVICE, seed=0)
        width = cfg.d_model
        fusing = [m.fuses_norm(RMSNorm(width).to(DEVICE), [torch.zeros(1, 1, width, device=DEVICE)] * 2)
                  for m in model.modules() if isinstance(m, DepthMixer)]
        assert fusing and all(f == (fused_norm and backend == "triton") for f in fusing)
        apply_activation_checkpointing(model, ActivationCheckpointing(mode))
        model.train()
        gen = torch.Generator().manual_seed(1)
        ids, labels = (torch.randint(0, cfg.vocab_size, (1, 16), generator=gen).to(DEVICE) for _ in range(2))
        loss = model(ids, labels=labels, return_logits=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (fused_loss, fused), (ref_loss, ref) = grads("triton"), grads("torch")
    assert torch.allclose(fused_loss, ref_loss, rtol=1e-5)
    assert fused.keys() == ref.keys()
    for name, want in ref.items():
        bound = 1e-4 * want.abs().max().item() + torch.finfo(F32).tiny
        assert (fused[name] - want).abs().max().item() <= bound, name


# -- the pre-norm in the mixture's kernels (``out_norm``) ---------------------------------------------

NORM_EPS = 1e-5


def normed_expected(sources, query, gain, gamma, Y) -> dict:
    """y = gamma * h^ / sqrt(mean(h^2) + eps2), h^ the mixture rounded to the output dtype (straight
    through: its gradient passes unchanged, as the kernels treat it), in float64, with the gradients
    of every input by autograd."""
    v = [s.detach().cpu().to(F64).requires_grad_() for s in sources]
    q, g, gam = (t.detach().cpu().to(F64).requires_grad_() for t in (query, gain, gamma))
    u = [x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) for x in v]
    a = torch.softmax(torch.stack([(ui * g * q).sum(-1) for ui in u]), dim=0)
    h = sum(a[i].unsqueeze(-1) * x for i, x in enumerate(v))
    h_hat = h + (h.to(Y.dtype).to(F64) - h).detach()
    y = gam * h_hat / torch.sqrt(h_hat.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    grads = torch.autograd.grad(y, [*v, q, g, gam], Y.cpu().to(F64))
    L = max((ui.abs() * (g * q).abs()).sum(-1).max().item() for ui in u)
    return dict(y=y.detach(), grads=grads, L=L)


def check_normed(dtypes: list[torch.dtype], tiny_source: bool) -> None:
    """The fused kernels against ``normed_expected``, each output within a bound on its largest element:
    the fp32 math rounds about n = d + S + 16 times along a path, each error relative to magnitudes of
    the size of the output's largest (the norm rescales the mixture to rms ~1), and the mixture weights
    carry the logits' absolute error (factor 1 + L, as above): 8 n eps32 (1 + L) leaves a factor ~4 for
    the norm's own chain of products. Where the output is not fp32 the rounding of h^ (and of the
    outputs) to it adds its eps: an h^ element the two sides round differently moves y by an ulp there,
    and every gradient by at most an ulp of the magnitudes it feeds: 4 eps_out covers the output's
    own rounding and that flip. A term dropped or of the wrong sign moves an output by itself, at least
    ~1e-2 of the magnitudes here. (A bf16 output with the source of rms 1e-3 is left out: its
    gradient, scaled by 1/rms, magnifies an ulp of h^ that the interpreter, which truncates where
    the reference rounds, gets wrong in about every other element.)"""
    gen = torch.Generator().manual_seed(5)
    sources, query, gain, _ = make_inputs(dtypes, tiny_source=tiny_source)
    gamma = (1 + 0.3 * torch.randn(D, generator=gen, dtype=F64)).float().to(DEVICE).requires_grad_()
    out_dtype = sources[0].dtype
    for v in sources[1:]:
        out_dtype = torch.promote_types(out_dtype, v.dtype)
    Y = torch.randn(B, T, D, generator=gen, dtype=F64).to(out_dtype).to(DEVICE)
    y = depth_mixture(sources, query, gain, EPS, backend="triton", out_norm=(gamma, NORM_EPS))
    got = torch.autograd.grad(y, [*sources, query, gain, gamma], Y)
    ref = normed_expected(sources, query, gain, gamma, Y)
    n = D + len(sources) + 16
    fp32_part = 8 * n * EPS32 * (1 + ref["L"])
    out_part = 0.0 if out_dtype == F32 else 4 * torch.finfo(out_dtype).eps * OUTPUT_ROUNDING
    assert y.dtype == out_dtype and y.shape == (B, T, D)
    names = [f"dv[{i}]" for i in range(len(sources))] + ["d_query", "d_norm_weight", "d_gamma"]
    for name, out, want in [("y", y, ref["y"]), *zip(names, got, ref["grads"])]:
        assert torch.isfinite(out).all(), name
        scale = want.abs().max().item()
        limit = (fp32_part + out_part + (0 if out.dtype == F32 else torch.finfo(out.dtype).eps)) * scale
        err = (out.detach().cpu().to(F64) - want).abs().max().item()
        assert err <= limit, f"{name} ({out.dtype}): error {err:.3g} against a bound of {limit:.3g}"


@pytest.mark.parametrize("dtypes,tiny_source", [
    pytest.param([F32] * 3, True, id="fp32"),
    pytest.param([F32, BF16, BF16], True, id="fp32-embedding-bf16-sums"),
    pytest.param([BF16] * 4, False, id="bf16-only"),
])
def test_the_pre_norm_in_the_kernels_matches_float64(dtypes, tiny_source, small_blocks):
    check_normed(dtypes, tiny_source)


def test_the_pre_norm_in_the_kernels_keeps_one_more_number_per_token_and_not_the_mixture(small_blocks):
    sources, query, gain, _ = make_inputs([F32, BF16, BF16])
    gamma = torch.ones(D, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        depth_mixture(sources, query, gain, EPS, backend="triton", out_norm=(gamma, NORM_EPS))
    inputs = {t.data_ptr() for t in (*sources, query, gain, gamma)}
    new = [t for t in saved if t.data_ptr() not in inputs]
    assert {t.data_ptr() for t in saved} >= inputs
    assert sorted(t.shape for t in new) == sorted([(B * T,), (3, B * T), (6, B * T)]) and all(t.dtype == F32 for t in new)


def test_the_reference_pre_norm_is_the_model_norm_of_the_mixture():
    """The torch backend's ``out_norm`` is the RMSNorm module's output on the mixture, bitwise."""
    sources, query, gain, _ = make_inputs([F32, BF16, BF16])
    norm = RMSNorm(D, NORM_EPS).to(DEVICE)
    with torch.no_grad():
        norm.weight.mul_(torch.linspace(0.5, 1.5, D, device=DEVICE))
    fused = depth_mixture(sources, query, gain, EPS, backend="torch", out_norm=(norm.weight, NORM_EPS))
    assert torch.equal(fused, norm(depth_mixture(sources, query, gain, EPS, backend="torch")))


def test_the_stream_fuses_the_pre_norm_only_where_the_kernels_take_it(small_blocks):
    """``ResidualStream.normed_input``: the mixer's kernels apply the norm when ``fused_norm`` is on, the
    mixture has two sources or more and runs on Triton, and the norm is a plain RMSNorm; the result
    is the norm of the mixture either way (fp32 sources: the same math in another order)."""
    mixer, sources = mixer_and_sources("triton")
    norm = RMSNorm(D, NORM_EPS).to(DEVICE)
    stream = ResidualStream("full", tuple(s.detach().float() for s in sources))
    assert mixer.fused_norm and mixer.fuses_norm(norm, list(stream.sources))  # the option is on by default
    mixer.fused_norm = False
    assert not mixer.fuses_norm(norm, list(stream.sources))
    apart = stream.normed_input(mixer, norm)
    mixer.fused_norm = True
    assert not mixer.fuses_norm(norm, list(stream.sources[:1]))  # one source: no mixture
    assert not mixer.fuses_norm(GatedRMSNorm(D).to(DEVICE), list(stream.sources))  # a gated norm is not this one
    calls = []
    original = attn_res_module.depth_mixture
    try:
        attn_res_module.depth_mixture = lambda *args: calls.append(args[-1]) or original(*args)
        together = stream.normed_input(mixer, norm)
    finally:
        attn_res_module.depth_mixture = original
    assert len(calls) == 1 and calls[0][0] is norm.weight and calls[0][1] == NORM_EPS
    scale = apart.abs().max().item()
    assert (together - apart).abs().max().item() <= 8 * (D + 3 + 16) * EPS32 * scale
    mixer.norm.backend = "torch"
    assert not mixer.fuses_norm(norm, list(stream.sources))  # the reference mixture: the norm runs apart


def test_the_plan_counts_what_the_pre_norm_in_the_kernels_saves():
    """What the tiny model keeps for backward with the pre-norms in the mixtures' kernels, against
    the same model with them apart (both on the kernels, fp32), layer by layer: the plan's difference
    (``moe_lc.parallel.activation_memory``, on a path with the kernels) is the measured one within
    the plan's 15%, and the fused model keeps less in every layer and outside them (the output
    mixture and the final norm)."""
    from dataclasses import replace

    from moe_lc.metrics.saved_activations import measure_saved_activations
    from moe_lc.model.init import build_model
    from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
    from moe_lc.parallel.activation_memory import REFERENCE_FP32, estimate_activations
    from moe_lc.presets import get_preset

    def measured_and_planned(fused: bool):
        cfg = get_preset("tiny")
        cfg.attn_res.backend, cfg.kda.backend, cfg.attn_res.fused_norm = "triton", "torch", fused
        model = build_model(cfg.validate(), DEVICE, seed=0)
        model.train()
        gen = torch.Generator().manual_seed(1)
        ids, labels = (torch.randint(0, cfg.vocab_size, (1, 32), generator=gen).to(DEVICE) for _ in range(2))
        measured = measure_saved_activations(model, ids, labels, backward=False)
        planned = estimate_activations(cfg, ActivationCheckpointing(), 32, replace(REFERENCE_FP32, fused=True))
        return measured, planned.by_layer

    (fused, fused_plan), (apart, apart_plan) = measured_and_planned(True), measured_and_planned(False)
    for label in apart_plan:
        saved = apart.per_token(label) - fused.per_token(label)
        planned = apart_plan[label] - fused_plan[label]
        assert saved > 0, label  # every layer's FFN sublayer reads a mixture, and so does the final norm
        assert abs(planned / saved - 1) < 0.15, f"{label}: plan saves {planned:.0f} B/token, measured {saved:.0f}"


def test_a_compiled_depth_mixer_applies_its_pre_norm_in_the_kernels_eagerly(small_blocks):
    """The ``attn_res`` compile target with the pre-norm fused: the mixer's compiled forward takes the
    norm as an argument and still reaches the kernels through their graph break, with the same result."""
    mixer, sources = mixer_and_sources("triton")
    mixer.fused_norm = True
    norm = RMSNorm(D, NORM_EPS).to(DEVICE)
    eager = mixer(sources, out_norm=norm)
    torch._dynamo.reset()
    mixer.compile()
    compiled = mixer(sources, out_norm=norm)
    assert torch.equal(compiled, eager)


def test_the_pre_norm_stays_apart_when_a_weight_is_a_dtensor(small_blocks):
    """Under tensor parallelism the norms' and mixers' weights are DTensors, whose local pieces only
    the module's own call sees (moe_lc.parallel.local_params): ``fuses_norm`` then says no, and the
    norm runs in its own call. One process, a mesh of one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mixer, sources = mixer_and_sources("triton")
    mixer.fused_norm = True
    norm = RMSNorm(D, NORM_EPS).to(DEVICE)
    assert mixer.fuses_norm(norm, sources)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(DEVICE, (1,))
        norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]))
        assert not mixer.fuses_norm(norm, sources)
    finally:
        dist.destroy_process_group()


def test_rows_that_would_spill_registers_take_the_tiled_kernels():
    """The resident kernels hold S x ROWS x BLOCK / (32 x warps) fp32 values a thread: up to 10 sources
    of d 2048 at the default launch (8 a source), then the tiled kernels; a row wider than
    ``*_resident_max_d`` never runs resident."""
    shape = kernel_module._resident_shape
    cpu = torch.device("cpu")
    assert shape(16384, 2048, 10, cpu, "bwd") is not None
    assert shape(16384, 2048, 11, cpu, "bwd") is None
    assert shape(16384, 2048, 11, cpu, "fwd") is None
    _, rows, block, warps = shape(16384, 2560, 2, cpu, "fwd")
    assert (rows, block, warps) == (1, 4096, 4096 // kernel_module.TUNING["fwd_resident_cols_per_warp"])
    # a forward of 4 warps a row (512 columns of d 2048) takes 8 at half the programs where 6 sources need it
    programs4, _, _, warps4 = shape(16384, 2048, 5, cpu, "fwd")
    programs6, _, _, warps6 = shape(16384, 2048, 6, cpu, "fwd")
    assert (warps4, warps6) == (4, 8) and programs6 * 2 == programs4
    assert shape(16384, 7168, 2, cpu, "bwd") is None
