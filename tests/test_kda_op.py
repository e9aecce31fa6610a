"""KDA op: recurrence vs an explicit-matrix loop, chunk form vs recurrence, gate, dispatch, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lc.ops import kda
from moe_lc.ops._kda_chunk import _TileDecay, decayed_scores
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import chunk_kda, kda_gate, recurrent_kda, register_kda_backend
from moe_lc.ops.kda_segments import segment_transition

F64 = torch.float64


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_gate(shape: tuple[int, ...], kind: str, generator: torch.Generator) -> torch.Tensor:
    """Log-decays g [B, T, H, K] in float64 from the real gate function."""
    heads, key_dim = shape[-2:]
    z = torch.randn(shape, dtype=F64, generator=generator)
    if kind == "bounded":
        a_log = 0.5 * torch.randn(heads, dtype=F64, generator=generator)
        dt_bias = torch.randn(heads * key_dim, dtype=F64, generator=generator)
        return kda_gate(z, a_log, dt_bias)
    if kind == "near_lower_bound":  # every step close to -5: 1/Gamma over a chunk would overflow
        return kda_gate(2 * z + 9, torch.zeros(heads, dtype=F64))
    if kind == "softplus_extreme":  # unbounded: per-tile spans far beyond exp's range in fp64
        return kda_gate(4 * z, torch.full((heads,), 4.0, dtype=F64), lower_bound=None)
    raise ValueError(kind)


def make_inputs(batch, seq_len, heads, key_dim, value_dim, *, gate="bounded", seed=0, num_states=None):
    """Realistic float64 inputs: unit-norm q/k (the layer L2-normalises), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq_len, heads, key_dim, dtype=F64, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, seq_len, heads, key_dim, dtype=F64, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, heads, value_dim, dtype=F64, generator=gen)
    beta = torch.sigmoid(torch.randn(batch, seq_len, heads, dtype=F64, generator=gen))
    g = make_gate((batch, seq_len, heads, key_dim), gate, gen)
    states = torch.randn(num_states or batch, heads, key_dim, value_dim, dtype=F64, generator=gen)
    return q, k, v, g, beta, states


def naive_kda(q, k, v, g, beta, scale, state):
    """Independent reference: the update as explicit K x K matrices, one (batch, head) at a time."""
    batch, seq_len, heads, key_dim = q.shape
    out = torch.empty(batch, seq_len, heads, v.shape[-1], dtype=F64)
    final = torch.empty_like(state)
    eye = torch.eye(key_dim, dtype=F64)
    for b in range(batch):
        for h in range(heads):
            s = state[b, h].clone()
            for t in range(seq_len):
                kt, bt = k[b, t, h][:, None], beta[b, t, h]
                transition = (eye - bt * kt @ kt.T) @ torch.diag(torch.exp(g[b, t, h]))
                s = transition @ s + bt * kt @ v[b, t, h][None, :]
                out[b, t, h] = scale * s.T @ q[b, t, h]
            final[b, h] = s
    return out, final


# ----------------------------------------------------------------------------- recurrence
def test_recurrence_matches_explicit_matrix_loop():
    q, k, v, g, beta, s0 = make_inputs(2, 37, 2, 5, 3, seed=1)
    out, final = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    ref_out, ref_final = naive_kda(q, k, v, g, beta, 5**-0.5, s0)
    assert rel(out, ref_out) < 1e-12
    assert rel(final, ref_final) < 1e-12


def test_recurrence_custom_scale_and_zero_initial_state():
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 4, 6, seed=2)
    out, final = recurrent_kda(q, k, v, g, beta, scale=0.7, output_final_state=True)
    ref_out, ref_final = naive_kda(q, k, v, g, beta, 0.7, torch.zeros(1, 2, 4, 6, dtype=F64))
    assert rel(out, ref_out) < 1e-12 and rel(final, ref_final) < 1e-12
    assert recurrent_kda(q, k, v, g, beta)[1] is None


# ----------------------------------------------------------------------------- chunk form, forward
@pytest.mark.parametrize("shape", [(2, 100, 3, 16, 24), (1, 64, 2, 8, 8), (2, 130, 2, 16, 8), (1, 1, 1, 4, 4)])
@pytest.mark.parametrize("gate", ["bounded", "near_lower_bound", "softplus_extreme"])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrence(shape, gate, with_state):
    q, k, v, g, beta, s0 = make_inputs(*shape, gate=gate, seed=3)
    s0 = s0 if with_state else None
    out, final = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    ref_out, ref_final = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    assert rel(out, ref_out) < 1e-10
    assert rel(final, ref_final) < 1e-10


def test_extreme_gates_exercise_both_diagonal_tile_paths():
    gen = torch.Generator().manual_seed(4)
    bounded = make_gate((1, 64, 2, 8), "near_lower_bound", gen).transpose(1, 2)  # chunks: [.., C, K]
    unbounded = make_gate((1, 64, 2, 8), "softplus_extreme", gen).transpose(1, 2)
    assert not _TileDecay.build(bounded).pairwise_diagonal
    assert not _TileDecay.build(bounded.float()).pairwise_diagonal
    assert _TileDecay.build(unbounded).pairwise_diagonal


@pytest.mark.parametrize("gate", ["bounded", "near_lower_bound"])
def test_decayed_scores_factorized_and_pairwise_match_direct_sum(gate):
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 2, 64, 6, dtype=F64, generator=gen), torch.randn(2, 2, 64, 6, dtype=F64, generator=gen)
    g = make_gate((2, 64, 2, 6), gate, gen).transpose(1, 2)  # [B, H, C, K]
    direct = torch.zeros(2, 2, 64, 64, dtype=F64)
    for i in range(64):
        for j in range(i + 1):
            log_decay = g[..., j + 1 : i + 1, :].sum(-2)  # decay applied after key j, through query i
            direct[..., i, j] = (x[..., i, :] * y[..., j, :] * log_decay.exp()).sum(-1)
    for pairwise in (False, True):
        assert rel(decayed_scores(x, y, g, strict=False, pairwise_diagonal=pairwise), direct) < 1e-12
        strict = decayed_scores(x, y, g, strict=True, pairwise_diagonal=pairwise)
        assert rel(strict, direct.tril(-1)) < 1e-12


@pytest.mark.parametrize("gate", ["bounded", "softplus_extreme"])
def test_float32_matches_float64_reference(gate):
    q, k, v, g, beta, s0 = make_inputs(2, 150, 2, 32, 32, gate=gate, seed=6)
    ref_out, ref_final = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    args = [t.float() for t in (q, k, v, g, beta)]
    out, final = chunk_kda(*args, initial_state=s0.float(), output_final_state=True)
    assert out.dtype == torch.float32
    assert rel(out, ref_out) < 1e-5 and rel(final, ref_final) < 1e-5


def test_bfloat16_inputs_return_bfloat16():
    q, k, v, g, beta, s0 = make_inputs(2, 100, 2, 16, 16, seed=7)
    args = [t.bfloat16() for t in (q, k, v, g, beta)]
    out, final = chunk_kda(*args, initial_state=s0.bfloat16(), output_final_state=True)
    ref_out, ref_final = recurrent_kda(*(t.double() for t in args), initial_state=s0.bfloat16().double(),
                                       output_final_state=True)
    assert out.dtype == torch.bfloat16
    assert final.dtype == torch.float32  # the carried state stays in the compute dtype
    assert rel(out, ref_out) < 1e-2 and rel(final, ref_final) < 1e-2


# ----------------------------------------------------------------------------- packed documents
LENGTHS = [1, 63, 64, 65, 150, 7]


def split_documents(lengths):
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return DocumentBounds.from_host(bounds, "cpu"), list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_documents_are_independent(with_state):
    docs, spans = split_documents(LENGTHS)
    q, k, v, g, beta, s0 = make_inputs(1, sum(LENGTHS), 2, 16, 8, seed=8, num_states=len(LENGTHS))
    s0 = s0 if with_state else None
    out, final = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, docs=docs)
    assert final.shape == (len(LENGTHS), 2, 16, 8)
    for n, (start, end) in enumerate(spans):
        doc = [t[:, start:end] for t in (q, k, v, g, beta)]
        doc_state = None if s0 is None else s0[n : n + 1]
        ref_out, ref_final = recurrent_kda(*doc, initial_state=doc_state, output_final_state=True)
        assert rel(out[:, start:end], ref_out) < 1e-10, f"document {n}"
        assert rel(final[n : n + 1], ref_final) < 1e-10, f"document {n}"
    # a plain cu_seqlens tensor works too (read once into DocumentBounds)
    packed_ref, packed_final = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                             docs=docs.cu_seqlens)
    assert rel(out, packed_ref) < 1e-10 and rel(final, packed_final) < 1e-10


# ----------------------------------------------------------------------------- gradients
def _grads(fn, inputs, docs=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    q, k, v, g, beta, s0 = leaves
    out, final = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, docs=docs)
    gen = torch.Generator().manual_seed(99)
    loss = (out * torch.randn(out.shape, dtype=F64, generator=gen)).sum()
    loss = loss + (final * torch.randn(final.shape, dtype=F64, generator=gen)).sum()
    return torch.autograd.grad(loss, leaves)


NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.mark.parametrize("gate", ["bounded", "near_lower_bound"])
def test_gradients_match_recurrence(gate):
    inputs = make_inputs(2, 70, 2, 8, 6, gate=gate, seed=9)
    for name, got, want in zip(NAMES, _grads(chunk_kda, inputs), _grads(recurrent_kda, inputs)):
        assert rel(got, want) < 1e-10, name


def test_gradients_match_recurrence_packed():
    docs, _ = split_documents([5, 70, 20])
    inputs = make_inputs(1, 95, 2, 8, 6, seed=10, num_states=3)
    chunk = _grads(chunk_kda, inputs, docs)
    ref = _grads(recurrent_kda, inputs, docs)
    for name, got, want in zip(NAMES, chunk, ref):
        assert rel(got, want) < 1e-10, name


def test_gradcheck_tiny():
    inputs = [t.requires_grad_(True) for t in make_inputs(1, 20, 1, 4, 3, seed=11)]

    def fn(q, k, v, g, beta, s0):
        return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- gate
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_bounded_gate_stays_strictly_inside_bounds(dtype):
    z = torch.tensor([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4], dtype=dtype)
    z = z[:, None, None].expand(7, 3, 2)  # every extreme value for every head (H=3, K=2)
    a_log = torch.tensor([-30.0, 0.0, 10.0], dtype=dtype)
    for lower in (-5.0, -1.0):
        g = kda_gate(z, a_log, lower_bound=lower)
        assert g.dtype == dtype
        assert (g > lower).all() and (g < 0).all(), g


def test_gate_matches_direct_formula_and_bias_shapes():
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(2, 5, 3, 4, dtype=F64, generator=gen)
    a_log = torch.randn(3, dtype=F64, generator=gen)
    bias = torch.randn(3, 4, dtype=F64, generator=gen)
    x = z + bias
    bounded = -5.0 / (1.0 + torch.exp(-torch.exp(a_log)[:, None] * x))
    softplus = -torch.exp(a_log)[:, None] * torch.log1p(torch.exp(x))
    assert rel(kda_gate(z, a_log, bias), bounded) < 1e-14
    assert rel(kda_gate(z, a_log, bias.flatten()), bounded) < 1e-14
    assert rel(kda_gate(z, a_log, bias, lower_bound=None), softplus) < 1e-14
    no_bias = -5.0 * torch.sigmoid(torch.exp(a_log)[:, None] * z)
    assert rel(kda_gate(z, a_log), no_bias) < 1e-14


def test_softplus_gate_is_nonpositive_and_gate_computes_in_fp32():
    z = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4], dtype=torch.bfloat16).reshape(5, 1, 1)
    g = kda_gate(z, torch.tensor([2.0]), lower_bound=None)
    assert g.dtype == torch.float32
    assert (g <= 0).all() and torch.isfinite(g).all()
    assert kda_gate(z, torch.tensor([0.0])).dtype == torch.float32


# ----------------------------------------------------------------------------- dispatch
def test_backend_dispatch(monkeypatch):
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 8, 8, seed=13)
    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    chosen = []

    def record(name):
        impl, supports = kda._BACKENDS[name]
        return lambda *args: chosen.append(name) or impl(*args)

    for name in ("torch", "triton", "fla"):
        kda._BACKENDS[name] = (record(name), kda._BACKENDS[name][1])
    auto_out, _ = chunk_kda(q, k, v, g, beta, backend="auto")
    assert chosen == ["torch"]  # on CPU no kernel takes the inputs
    ref_out, _ = recurrent_kda(q, k, v, g, beta)
    assert rel(auto_out, ref_out) < 1e-10
    for planned in ("triton", "fla"):
        with pytest.raises(NotImplementedError, match="not available"):
            chunk_kda(q, k, v, g, beta, backend=planned)
    with pytest.raises(ValueError, match="unknown backend"):
        chunk_kda(q, k, v, g, beta, backend="cuda_magic")

    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    calls = []

    def fake(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
        calls.append((scale, docs, gate_lower_bound))
        return torch.zeros_like(v), None

    register_kda_backend("triton", fake, supports=lambda t: t.dtype == F64)
    chunk_kda(q, k, v, g, beta)  # auto prefers the fast kernel when it supports the inputs
    assert calls == [(8**-0.5, None, None)]
    # backends receive the documents as DocumentBounds and the caller's gate floor as given
    chunk_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], docs=torch.tensor([0, 15, 40]), gate_lower_bound=-5.0)
    _, docs, floor = calls.pop()
    assert docs.host == (0, 15, 40) and floor == -5.0
    out32, _ = chunk_kda(*(t.float() for t in (q, k, v, g, beta)))  # not supported -> torch
    assert len(calls) == 1 and chosen[-1] == "torch" and rel(out32, ref_out) < 1e-5


def test_auto_prefers_triton_and_inputs_it_cannot_take_go_to_fla(monkeypatch):
    """auto tries triton first at every shape (measured faster than fla everywhere); the triton
    backend hands unbounded gates and head dims the kernels do not take to fla when fla supports
    the inputs, else to the torch reference (the same result as backend="torch")."""
    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    calls = []
    register_kda_backend("triton", lambda *a: calls.append("triton") or (torch.zeros_like(a[2]), None))
    register_kda_backend("fla", lambda *a: calls.append("fla") or (torch.zeros_like(a[2]), None))
    for batch, seq_len, heads in ((8, 64, 16), (1, 300, 2), (2, 70, 64)):
        q, k, v, g, beta, _ = make_inputs(batch, seq_len, heads, 4, 4, seed=15)
        chunk_kda(q, k, v, g, beta)
        assert calls.pop() == "triton"

    register_kda_backend("fla", lambda *a: calls.append("fla") or (torch.zeros_like(a[2]), None))
    for gate, dim in (("softplus_extreme", 16), ("bounded", 24)):  # unbounded gate; a head dim the kernels lack
        q, k, v, g, beta, _ = make_inputs(1, 40, 2, dim, dim, gate=gate, seed=16)
        kda._triton_backend(q, k, v, g, beta, dim**-0.5, None, False, None, None)
        assert calls.pop() == "fla"
    register_kda_backend("fla", lambda *a: calls.append("fla"), supports=lambda q: False)
    out, _ = kda._triton_backend(q, k, v, g, beta, 24**-0.5, None, False, None, None)
    ref, _ = chunk_kda(q, k, v, g, beta, backend="torch")
    assert not calls and torch.equal(out, ref)


# ----------------------------------------------------------------------------- errors
def test_clear_errors_on_bad_inputs():
    q, k, v, g, beta, s0 = make_inputs(2, 10, 2, 4, 3, seed=14)
    cases = [
        (dict(k=k[..., :3]), "k must have the shape of q"),
        (dict(g=g[:, :9]), "g must have the shape of q"),
        (dict(v=v[:, :9]), "v must be"),
        (dict(beta=beta[..., :1]), "beta must be"),
        (dict(initial_state=s0[:1]), "initial_state must be"),
        (dict(docs=torch.tensor([0, 4, 10])), "B must be 1"),
    ]
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    for fn in (chunk_kda, recurrent_kda):
        for override, message in cases:
            with pytest.raises(ValueError, match=message):
                fn(**{**base, **override})

    packed = dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1])
    packed_cases = [
        (torch.tensor([1, 4, 10]), "must start at 0"),
        (torch.tensor([0, 4, 9]), "end at 9 but T=10"),
        (DocumentBounds.from_host([0, 4, 9], "cpu"), "end at 9 but T=10"),
        (torch.tensor([0, 6, 4, 10]), "strictly increasing"),
        (torch.tensor([0, 4, 4, 10]), "strictly increasing"),
        (torch.tensor([0.0, 10.0]), "integer"),
    ]
    for docs, message in packed_cases:
        with pytest.raises(ValueError, match=message):
            chunk_kda(**packed, docs=docs)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_kda(**packed, docs=torch.tensor([0, 4, 10]), initial_state=s0[:1])
    with pytest.raises(ValueError, match="must be <= 0"):
        chunk_kda(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(torch.randn(3, 2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(torch.randn(3, 2, 4), torch.zeros(2), torch.zeros(7))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(torch.randn(3, 2, 4), torch.zeros(2), lower_bound=5.0)


def test_bounded_gate_is_recognised_from_the_given_floor_without_reading_it(monkeypatch):
    """The kernels' bounded-gate check trusts a floor within their span (no g.min(), which on a GPU
    waits for all queued work); without a floor, or with one outside the span, it reads g."""
    from moe_lc_kernels.kda import gate_is_bounded

    g = make_gate((1, 8, 2, 4), "bounded", torch.Generator().manual_seed(3))
    unbounded = make_gate((1, 8, 2, 4), "softplus_extreme", torch.Generator().manual_seed(3))
    reads = []
    monkeypatch.setattr(torch.Tensor, "min", lambda self, *a: reads.append(1) or torch.amin(self))
    assert gate_is_bounded(g, -5.0) and gate_is_bounded(unbounded, -5.5) and not reads  # trusted, not checked
    assert gate_is_bounded(g, None) and len(reads) == 1
    assert gate_is_bounded(g, -8.0) and len(reads) == 2  # a floor beyond the span: g itself decides
    assert not gate_is_bounded(unbounded, None) and len(reads) == 3


def test_the_gate_floor_reaches_the_backend_from_the_projections_op(monkeypatch):
    """chunk_kda_from_projections tells chunk_kda the floor of the gate it computed (the layer's
    g_min), so a kernel backend never has to read g to learn it; the softplus gate has none."""
    from moe_lc.ops.kda_projections import chunk_kda_from_projections

    monkeypatch.setattr(kda, "_BACKENDS", dict(kda._BACKENDS))
    floors = []

    def mine(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
        floors.append(gate_lower_bound)
        return torch.zeros_like(v), None

    register_kda_backend("mine", mine)
    q, k, v, z, beta, _ = make_inputs(1, 20, 2, 8, 8, seed=17)
    for lower_bound in (-3.0, None):
        chunk_kda_from_projections(q, k, v, z, beta, torch.zeros(2, dtype=F64), lower_bound=lower_bound,
                                   backend="mine")
    assert floors == [-3.0, None]


def test_segment_transition_composes():
    """S_end = M S_start + S~ (the KCP identity) for packed documents, against chunk_kda itself."""
    gen = torch.Generator().manual_seed(4)
    docs = DocumentBounds.from_host([0, 50, 120], "cpu")
    q, k, v, g, beta, _ = make_inputs(1, 120, 2, 8, 4, seed=18)
    s_tilde, transition = segment_transition(q, k, v, g, beta, docs=docs, backend="torch")
    start = torch.randn(2, 2, 8, 4, generator=gen, dtype=F64)
    _, end = chunk_kda(q, k, v, g, beta, initial_state=start, output_final_state=True, docs=docs, backend="torch")
    assert transition.shape == (2, 2, 8, 8)
    assert rel(transition @ start + s_tilde, end) < 1e-12
