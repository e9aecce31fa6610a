"""The routed experts' dispatch (moe_lc.ops.grouped_experts) and the one-process MoE path around it.

The grouped path runs ``torch._grouped_mm`` in fp32 on CPU (torch >= 2.13) and is compared, with
the reference loop, to the experts written out in float64 (autograd for the gradients). Routing is
random with empty experts, the first and the last among them. Tolerance: each output is a chain of
fp32 dot products of at most K terms (K the longest reduction: width, hidden or an expert's rows),
so it may be off by about K eps32 times the size of its terms; ``TOL_FACTOR`` K eps32 of the
largest magnitude, with a margin of 4 for the chain of three GEMMs and the activation.

On a GPU the same tests also run the CUDA path (bf16 grouped GEMM, fused SiTU) and check under
``torch.cuda.set_sync_debug_mode("error")`` that the layer never waits for the device.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_lc.config import MoEConfig  # noqa: E402
from moe_lc.model.moe import LatentMoE  # noqa: E402
from moe_lc.ops.token_permutation import combine_by_token, sort_by_expert  # noqa: E402
from moe_lc.ops.grouped_experts import autocast_operands, expert_offsets, grouped_glu, resolve_backend  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps
B1, B2 = 4.0, 25.0
WIDTH, HIDDEN = 8, 12  # rows of 32 and 48 bytes in fp32: what _grouped_mm takes
COUNTS = [0, 9, 0, 17, 1, 6, 0]  # 7 experts, 33 rows; experts 0, 2 and 6 get nothing


def _grouped_mm_runs_here() -> bool:
    """torch._grouped_mm exists and takes fp32 on CPU (torch >= 2.13)."""
    try:
        torch._grouped_mm(torch.zeros(2, 4), torch.zeros(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


needs_grouped_mm = pytest.mark.skipif(not _grouped_mm_runs_here(), reason="torch._grouped_mm does not run on CPU here")
needs_triton = pytest.mark.skipif(not triton_available("cpu"), reason="Triton's interpreter is not available")


def weights(experts: int = len(COUNTS), seed: int = 0, width: int = WIDTH, hidden: int = HIDDEN) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w_gate = torch.randn(experts, hidden, width, generator=gen) * width**-0.5
    w_in = torch.randn(experts, hidden, width, generator=gen) * width**-0.5 * 4.0  # c reaches b2's bend
    w_out = torch.randn(experts, width, hidden, generator=gen) * hidden**-0.5
    return w_gate, w_in, w_out


def experts_float64(x, counts, w_gate, w_in, w_out):
    """Expert e's SiTU-GLU on its rows, written out from the formula."""
    rows, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start : start + n]
        a, c = xe @ w_gate[e].T, xe @ w_in[e].T
        h = B1 * torch.tanh(a / B1) * torch.sigmoid(a) * (B2 * torch.tanh(c / B2))
        rows.append(h @ w_out[e].T)
        start += n
    return torch.cat(rows)


def run(fn, x, w, dy):
    """Output and gradients of x and of the three stacked weights."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, *w)]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def tolerance(ref: torch.Tensor, reduction: int) -> float:
    return 4 * reduction * EPS32 * ref.abs().max().item()


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "backend, activation_backend, counts_on, device",
    [
        ("torch", "torch", "host", "cpu"),
        ("torch", "torch", "device", "cpu"),
        pytest.param("grouped", "torch", "device", "cpu", marks=needs_grouped_mm),
        pytest.param("grouped", "torch", "host", "cpu", marks=needs_grouped_mm),
        pytest.param("grouped", "triton", "device", "cpu", marks=[needs_grouped_mm, needs_triton]),
        pytest.param("auto", "auto", "device", "cuda", marks=cuda_only),  # fp32 grouped GEMM + fused SiTU
    ],
)
def test_experts_match_float64_with_empty_experts(backend, activation_backend, counts_on, device):
    w = [t.to(device) for t in weights()]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), WIDTH, generator=gen).to(device)
    dy = torch.randn(sum(COUNTS), WIDTH, generator=gen).to(device)
    counts = torch.tensor(COUNTS, device=device) if counts_on == "device" else COUNTS
    if backend == "auto":
        assert resolve_backend(x, *w) == "grouped"
    out = run(lambda x_, *w_: grouped_glu(x_, counts, *w_, "situ", B1, B2, backend=backend,
                                          activation_backend=activation_backend), x, w, dy)
    ref = run(lambda x_, *w_: experts_float64(x_, COUNTS, *w_), x.double(), [t.double() for t in w], dy.double())
    reduction = max(WIDTH, HIDDEN, max(COUNTS))
    for name, got, want in zip(["y", "dx", "dw_gate", "dw_in", "dw_out"], out, ref):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        err = (got.double() - want).abs().max().item()  # fp32 GEMMs: no TF32 unless a test turns it on
        assert err <= tolerance(want, reduction), f"{backend}: {name} off by {err:.3g}"
    for grad in out[2:]:  # empty experts: exactly zero, not garbage from unwritten memory
        assert torch.equal(grad[[0, 2, 6]], torch.zeros_like(grad[[0, 2, 6]]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("grouped", marks=needs_grouped_mm)])
def test_no_rows_still_reaches_the_weights(backend):
    """An expert-parallel rank that receives nothing must still run backward into its experts."""
    w = [t.requires_grad_(True) for t in weights()]
    x = torch.zeros(0, WIDTH, requires_grad=True)
    y = grouped_glu(x, torch.zeros(len(COUNTS), dtype=torch.long), *w, "situ", B1, B2, backend=backend)
    y.sum().backward()
    assert y.shape == (0, WIDTH)
    assert all(t.grad is not None and not t.grad.any() for t in w)


def test_backend_choice_and_errors():
    w = weights()
    x = torch.zeros(3, WIDTH)
    assert resolve_backend(x, *w, backend="auto") == "torch"  # CPU: the reference, bitwise the old path
    assert resolve_backend(x.double(), *[t.double() for t in w], backend="auto") == "torch"
    with pytest.raises(RuntimeError, match="multiples of 4"):
        grouped_glu(torch.zeros(3, 6), [1, 2], torch.zeros(2, 12, 6), torch.zeros(2, 12, 6),
                    torch.zeros(2, 6, 12), "situ", B1, B2, backend="grouped")
    with pytest.raises(ValueError, match="one row count per expert"):
        grouped_glu(x, [3], *w, "situ", B1, B2)
    with pytest.raises(ValueError, match="add up to 2 rows"):
        grouped_glu(x, [1, 1, 0, 0, 0, 0, 0], *w, "situ", B1, B2)
    with pytest.raises(ValueError, match="unknown backend"):
        grouped_glu(x, [3, 0, 0, 0, 0, 0, 0], *w, "situ", B1, B2, backend="loop")


def test_sort_and_combine_against_a_direct_sum():
    """sort_by_expert's counts and order, and combine_by_token = sum_j p_tj out_{e_tj}(t)."""
    gen = torch.Generator().manual_seed(2)
    tokens, k, experts = 11, 3, 6
    topk_idx = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])  # 5 never used
    order, token_of_row, counts = sort_by_expert(topk_idx, experts)
    assert counts.tolist() == torch.bincount(topk_idx.reshape(-1), minlength=experts).tolist()
    experts_of_rows = topk_idx.reshape(-1)[order]
    assert torch.equal(experts_of_rows, experts_of_rows.sort().values) and torch.equal(token_of_row, order // k)
    p = torch.rand(tokens, k, generator=gen, dtype=F64)
    table = torch.randn(experts, tokens, 4, generator=gen).double()  # expert e's output for token t
    out_sorted = table[experts_of_rows, token_of_row].float()  # exact: the table holds fp32 values
    u = combine_by_token(out_sorted, order, p)
    direct = sum(p[:, j, None] * table[topk_idx[:, j], torch.arange(tokens)] for j in range(k))
    eps64 = torch.finfo(F64).eps
    assert u.dtype == F64 and torch.allclose(u, direct, rtol=0, atol=2 * k * eps64 * direct.abs().max().item())


def moe_layer(seed: int = 0) -> LatentMoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_routed=8, top_k=2, num_shared=1, latent_dim=WIDTH, expert_hidden=HIDDEN)
    moe = LatentMoE(16, cfg)
    for name, p in moe.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, 0.0, 0.3)
    moe.balancer.bias.copy_(torch.tensor([3.0, -9.0, 0.0, 0.0, 0.0, 0.0, -9.0, 0.0]))  # experts 1, 6 idle
    return moe


@needs_grouped_mm
def test_latent_moe_is_the_same_with_either_backend():
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for backend in ("torch", "grouped"):
        moe = moe_layer()
        moe.experts.backend = backend
        xb = x.clone().requires_grad_(True)
        y = moe(xb)
        (y * torch.linspace(-1, 1, 16)).sum().backward()
        results.append([y.detach(), xb.grad] + [p.grad for p in moe.parameters()])
    for got, want in zip(results[1], results[0]):
        assert torch.allclose(got, want, rtol=0, atol=tolerance(want, 48)), (got - want).abs().max()


class HostRead(AssertionError):
    pass


@needs_grouped_mm
def test_one_process_layer_makes_no_host_reads(monkeypatch):
    """Forward and backward of the layer on the grouped path never read a tensor back to the host."""
    moe = moe_layer()
    moe.experts.backend = "grouped"
    x = torch.randn(2, 24, 16, requires_grad=True)

    def refuse(name):
        def read(*args, **kwargs):
            raise HostRead(f"Tensor.{name} read a tensor back to the host")

        return read

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    y = moe(x)
    y.backward(torch.ones_like(y))
    monkeypatch.undo()
    assert moe.experts.w_gate.grad is not None and x.grad is not None
    with pytest.raises(HostRead):  # the check is live: the reference loop does read the counts
        monkeypatch.setattr(torch.Tensor, "tolist", refuse("tolist"))
        moe.experts.backend = "torch"
        moe(x)


@needs_grouped_mm
def test_under_autocast_fp32_weights_take_the_grouped_gemm_in_the_autocast_dtype():
    """One-process training keeps fp32 weights and runs the matmuls in bf16 under autocast. The grouped
    GEMM is not on autocast's lists, so grouped_glu casts its operands as autocast casts a matmul's:
    the grouped path then equals the reference loop under the same autocast (whose matmuls autocast
    casts), and the fp32 weights get fp32 gradients. Without the cast the operands' dtypes differ and
    the grouped GEMM refuses them (on a GPU, "auto" fell back to the loop)."""
    width, hidden = 2 * WIDTH, 2 * HIDDEN  # rows of 32 and 48 bytes in bf16
    x = torch.randn(sum(COUNTS), width, generator=torch.Generator().manual_seed(1))
    w = weights(width=width, hidden=hidden)
    dy = torch.randn(sum(COUNTS), width, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_operands(x.bfloat16(), *w)
        assert [t.dtype for t in cast] == [torch.bfloat16] * 4
        assert resolve_backend(x.bfloat16(), *w, backend="auto") == "torch"  # mixed dtypes: no grouped GEMM
        assert resolve_backend(*cast, backend="grouped") == "grouped"

        def experts(backend):
            return lambda x_, *w_: grouped_glu(x_.bfloat16(), COUNTS, *w_, "situ", B1, B2, backend=backend,
                                               activation_backend="torch")

        got = run(experts("grouped"), x, w, dy)
        want = run(experts("torch"), x, w, dy)
    assert autocast_operands(x, *w)[1] is w[0]  # autocast off: untouched
    assert [g.dtype for g in got[2:]] == [torch.float32] * 3
    for name, g, r in zip(["y", "dx", "dw_gate", "dw_in", "dw_out"], got, want):
        assert g.dtype == r.dtype, name
        # the same bf16 products; only the summation order inside the GEMMs may differ
        assert torch.allclose(g.float(), r.float(), rtol=0, atol=8 * 2**-8 * r.float().abs().max().item()), name


def _experts_and_bf16_batches(seed: int, **backends: str):
    """Routed experts of twice the test widths with ``weights()``' values (fp32, as training keeps
    them), and three micro-batches of bf16 rows: a step under autocast."""
    from moe_lc.model.moe import RoutedExperts

    width, hidden = 2 * WIDTH, 2 * HIDDEN
    experts = RoutedExperts(len(COUNTS), width, hidden, "situ", B1, B2, **backends)
    with torch.no_grad():
        for w, g in zip((experts.w_gate, experts.w_in, experts.w_out), weights(width=width, hidden=hidden)):
            w.copy_(g)
    gen = torch.Generator().manual_seed(seed)
    return experts, [torch.randn(sum(COUNTS), width, generator=gen).bfloat16() for _ in range(3)]


def test_a_step_casts_the_experts_weights_once_and_its_gradients_are_those_of_casts_per_micro_batch():
    """reuse_weight_casts: every micro-batch of a step gets the same bf16 copies of the fp32 weights
    (one cast, not one per micro-batch) and the fp32 gradients accumulated over the micro-batches are
    bitwise those of casting again for each (the same bf16 values meet the same kernels). Outside it,
    without grad or without autocast the weights go to the GEMMs as they are."""
    from moe_lc.model.moe import reuse_weight_casts

    experts, batches = _experts_and_bf16_batches(seed=3, activation_backend="torch")
    counts = torch.tensor(COUNTS)

    def gradients(reuse: bool) -> tuple[list, list]:
        experts.zero_grad(set_to_none=True)
        seen = []
        with reuse_weight_casts(experts) if reuse else contextlib.nullcontext():
            for x in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    seen.append(experts.compute_weights(x))
                    y = experts(x, counts)
                (y.float() ** 2).sum().backward()
        return [w.grad.clone() for w in (experts.w_gate, experts.w_in, experts.w_out)], seen

    per_micro_batch, raw = gradients(reuse=False)
    once, cast = gradients(reuse=True)
    assert all(w.dtype == torch.float32 for seen in raw for w in seen)  # no reuse: autocast casts each use
    assert all(a is b for seen in cast[1:] for a, b in zip(seen, cast[0]))  # one copy for the whole step
    assert [w.dtype for w in cast[0]] == [torch.bfloat16] * 3
    for a, b in zip(once, per_micro_batch):
        assert a.dtype == torch.float32 and a.is_contiguous() and torch.equal(a, b)
    assert experts.step_casts is None  # dropped when the step ends (the optimizer changes the weights)
    with reuse_weight_casts(experts):
        x = batches[0]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert experts.compute_weights(x)[0] is experts.w_gate
        assert experts.compute_weights(x)[0] is experts.w_gate  # autocast off


@needs_grouped_mm
@pytest.mark.parametrize("activation_backend,wgrad_backend", [
    ("torch", "torch"), pytest.param("triton", "torch", marks=needs_triton),
    pytest.param("torch", "triton", marks=needs_triton)])
def test_a_step_stacks_gate_and_input_weights_into_one_grouped_gemm(activation_backend, wgrad_backend, request):
    """Within reuse_weight_casts on the grouped GEMM, W_gate and W_in go to the GEMM stacked ([E, 2h, l],
    one cast writing both halves) and the activation reads the GEMM's [rows, 2h] output in place: the
    output, dx and the fp32 weight gradients over three micro-batches are the unstacked path's within
    bf16 rounding (the GEMMs sum the same bf16 products, dx in one reduction instead of two summed),
    and nothing else is cast for the step. With ``wgrad_backend="triton"`` the weight-gradient GEMMs
    add into the fp32 ``.grad`` themselves (the first micro-batch stores): a sum that overwrote, or
    rows of W_in sent to W_gate, would be O(1) off."""
    from moe_lc.model.moe import reuse_weight_casts

    if wgrad_backend == "triton":
        request.getfixturevalue("exact_bf16_dots")
    experts, batches = _experts_and_bf16_batches(seed=4, backend="grouped", activation_backend=activation_backend,
                                                 wgrad_backend=wgrad_backend)
    _, hidden, width = experts.w_gate.shape
    counts = torch.tensor(COUNTS)

    def step(reuse: bool):
        experts.zero_grad(set_to_none=True)
        outs, dxs = [], []
        with reuse_weight_casts(experts) if reuse else contextlib.nullcontext():
            for x in batches:
                x = x.clone().requires_grad_(True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = experts(x, counts)
                (y.float() ** 2).sum().backward()
                outs.append(y.detach().float())
                dxs.append(x.grad.float())
            casts = None if experts.step_casts is None else dict(experts.step_casts)
        return outs, dxs, [w.grad.clone() for w in (experts.w_gate, experts.w_in, experts.w_out)], casts

    stacked = step(reuse=True)
    plain = step(reuse=False)
    assert list(stacked[3]) == [("stacked", torch.bfloat16)]  # the one stacked copy, no per-weight copies
    assert stacked[3][("stacked", torch.bfloat16)][0].shape == (len(COUNTS), 2 * hidden, width)
    for name, got, want in zip(["y", "dx", "grads"], stacked[:3], plain[:3]):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.allclose(g, w, rtol=0, atol=8 * 2**-8 * w.abs().max().item()), name
    assert all(g.dtype == torch.float32 and g.is_contiguous() for g in stacked[2])


@needs_grouped_mm
@needs_triton
def test_the_stacked_experts_are_a_custom_op_whose_fake_and_autograd_agree_with_it():
    """torch.library's checks of the stacked experts' op and its backward (what a compiled MoE layer
    plans with): schema, fake kernels with the real outputs' shapes and strides, autograd registered,
    on bf16 operands with empty experts. (The fused SiTU kernel: the reference activation's backward
    inside the op is a torch.func vjp, whose wrapped tensors opcheck's schema check cannot read.)"""
    gen = torch.Generator().manual_seed(5)
    experts, hidden, width = len(COUNTS), 16, 8
    x = torch.randn(sum(COUNTS), width, generator=gen).bfloat16().requires_grad_(True)
    w_gate_in = torch.randn(experts, 2 * hidden, width, generator=gen).bfloat16().requires_grad_(True)
    w_out = torch.randn(experts, width, hidden, generator=gen).bfloat16().requires_grad_(True)
    offsets = expert_offsets(COUNTS, torch.device("cpu"))
    settings = ("situ", B1, B2, "triton")
    torch.library.opcheck(torch.ops.moe_lc.grouped_glu_stacked.default, (x, offsets, w_gate_in, w_out, *settings))
    out, y, h = torch.ops.moe_lc.grouped_glu_stacked(x.detach(), offsets, w_gate_in.detach(), w_out.detach(), *settings)
    torch.library.opcheck(torch.ops.moe_lc.grouped_glu_stacked_backward.default,
                          (torch.randn_like(out), x.detach(), offsets, w_gate_in.detach(), w_out.detach(), y, h,
                           *settings))


# ----------------------------------------------------------------------------- on a GPU


@cuda_only
def test_cuda_routed_experts_match_float64():
    """auto on CUDA bf16 = grouped GEMM + fused SiTU; the routed path (sort, experts, combine) is within
    a few bf16 eps (norm-wise) of the float64 reference loop on the same bf16 weights and routing:
    about six bf16 roundings of eps/2 each lie on the way to any output or gradient."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_routed=16, top_k=4, num_shared=0, latent_dim=64, expert_hidden=128)
    moe = LatentMoE(128, cfg).cuda().bfloat16()
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, 0.0, 64**-0.5)
    ref = LatentMoE(128, cfg).cuda().double()
    ref.load_state_dict(moe.state_dict())  # the same bf16 values, upcast exactly
    tokens = 1024
    scores = torch.rand(tokens, 16, device="cuda")
    scores[:, [3, 11]] = -1.0  # experts 3 and 11 get nothing
    topk_idx = scores.topk(4, dim=-1).indices
    p = torch.rand(tokens, 4, device="cuda")
    z = torch.randn(tokens, 64, device="cuda").bfloat16()
    dy = torch.randn(tokens, 64, device="cuda").bfloat16()
    assert resolve_backend(z, moe.experts.w_gate, moe.experts.w_in, moe.experts.w_out) == "grouped"
    got = run(lambda z_, p_: moe.routed(z_, topk_idx, p_), z, [p], dy)
    want = run(lambda z_, p_: ref.routed(z_, topk_idx, p_), z.double(), [p.double()], dy.double())
    got += [q.grad for q in moe.experts.parameters()]
    want += [q.grad for q in ref.experts.parameters()]
    eps = torch.finfo(torch.bfloat16).eps
    for name, g, w in zip(["u", "dz", "dp", "dw_gate", "dw_in", "dw_out"], got, want):
        rel = ((g.double() - w).norm() / w.norm()).item()
        assert rel <= 4 * eps, f"{name}: relative error {rel:.3g} > 4 bf16 eps"
    assert not moe.experts.w_gate.grad[[3, 11]].any()


@cuda_only
@pytest.mark.parametrize("weights_dtype", ["bf16", "fp32 under autocast"])
def test_cuda_layer_never_waits_for_the_device(weights_dtype):
    """Forward and backward of the whole layer under sync-debug "error" (eval mode: the balancer's
    training statistics use torch.bincount, which reads its maximum back to the host), with bf16
    weights and, as one-process training runs it, with fp32 weights under bf16 autocast: the reference
    loop reads the counts back, so a fallback to it fails here."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_routed=16, top_k=4, num_shared=1, latent_dim=64, expert_hidden=128)
    moe = LatentMoE(128, cfg).cuda().eval()
    if weights_dtype == "bf16":
        moe = moe.bfloat16()
    for name, p in moe.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, 0.0, 0.05)
    x = torch.randn(4, 256, 128, device="cuda").bfloat16().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=weights_dtype != "bf16"):
            y = moe(x)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moe.experts.w_gate.grad is not None and torch.isfinite(x.grad).all()
