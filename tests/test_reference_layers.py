"""Every layer of the model against its formula written out in float64 (tests/reference_math.py):
forward and gradients with respect to the input and every parameter, with non-trivial parameters
and several packed documents."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference_math as ref
from moe_lc.config import KDAConfig, MLAConfig, MoEConfig
from moe_lc.model.attn_res import DepthMixer, ResidualStream
from moe_lc.model.ffn import GatedFFN, situ_glu, swiglu
from moe_lc.model.kda import KDAttention
from moe_lc.model import mla
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import LatentMoE
from moe_lc.model.norm import RMSNorm
from packed import packed
from reference_checks import F64, FLOAT64_RTOL, assert_matches, parameters_of, randomize, rel

D = 16
EPS = 1e-6
CU = [0, 3, 4, 13, 21]  # four documents, one of a single token (shorter than the conv window)


def inputs(batch: int, seq_len: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(batch, seq_len, D, generator=gen, dtype=F64)).requires_grad_(True)


def rows(layer_out_fn, x, bounds):
    """The reference applied row by row: one packed row with its documents, or B rows of one document."""
    if bounds is not None:
        return layer_out_fn(x[0], bounds).unsqueeze(0)
    return torch.stack([layer_out_fn(x[b], None) for b in range(x.shape[0])])


def layer_case(packed_row: bool, seed: int):
    """(x, cu_seqlens tensor or None, bounds list or None): a packed row of four documents, or 2 rows."""
    if packed_row:
        return inputs(1, CU[-1], seed), torch.tensor(CU, dtype=torch.int32), CU
    return inputs(2, 9, seed), None, None


# ----------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm(eps):
    norm = randomize(RMSNorm(D, eps).double(), seed=1)
    x = inputs(3, 5, seed=2, scale=0.05)  # small inputs: eps matters at the 1e-3 level
    assert_matches(lambda: norm(x), lambda: ref.rms_norm(x, norm.weight, eps), {"x": x, "weight": norm.weight})


def test_rms_norm_computes_in_fp32_for_bf16_inputs():
    norm = randomize(RMSNorm(D).double(), seed=3)
    x = inputs(2, 7, seed=4).detach().bfloat16()
    weight = norm.weight.detach().bfloat16()
    out = RMSNorm(D).bfloat16()
    with torch.no_grad():
        out.weight.copy_(weight)
    y = out(x)
    want = ref.rms_norm(x.double(), weight.double(), EPS)
    assert y.dtype == torch.bfloat16
    # fp32 inside, one rounding to bf16 at the end: each element within half a bf16 ulp (8 significant
    # bits: at most 2^-8 of its magnitude), plus fp32 rounding (~1e-7)
    assert ((y.double() - want).abs() <= (2.0**-8 + 1e-6) * want.abs()).all()


# ----------------------------------------------------------------------------- SiTU-GLU, SwiGLU, GatedFFN
def test_situ_and_swiglu_match_their_formulas():
    gen = torch.Generator().manual_seed(5)
    a = (8 * torch.randn(4000, generator=gen, dtype=F64)).requires_grad_(True)  # through both saturations
    c = (60 * torch.randn(4000, generator=gen, dtype=F64)).requires_grad_(True)
    assert_matches(lambda: situ_glu(a, c), lambda: ref.situ(a, c), {"a": a, "c": c})
    assert_matches(lambda: situ_glu(a, c, 3.0, 7.0), lambda: ref.situ(a, c, 3.0, 7.0), {"a": a, "c": c})
    assert_matches(lambda: swiglu(a, c), lambda: ref.swiglu(a, c), {"a": a, "c": c})


def test_situ_each_factor_saturates_at_its_own_beta():
    """a -> +inf: the gate factor tends to b1 = 4, so SiTU(a, c) -> 4 * 25 tanh(c / 25); swapping the two
    constants gives 25 * 4 tanh(c / 4), a different function of c."""
    c = torch.tensor([1.0, 10.0, 40.0], dtype=F64)
    big = torch.full_like(c, 200.0)
    assert rel(situ_glu(big, c), 4.0 * 25.0 * torch.tanh(c / 25.0)) < 1e-14
    assert situ_glu(-big, c).abs().max() < 1e-80  # a -> -inf: sigmoid(a) closes the gate
    assert (ref.SITU_BETA1, ref.SITU_BETA2) == (MoEConfig().situ_beta1, MoEConfig().situ_beta2) == (4.0, 25.0)


class _OwnLinear(torch.nn.Linear):
    """A linear that is not a plain nn.Linear (as tensor parallelism's shards and float8 linears are
    not): GatedFFN keeps its two GEMMs for it instead of stacking the weights."""


def _unstacked(ffn: GatedFFN) -> GatedFFN:
    for name in ("w_gate", "w_in"):
        plain = getattr(ffn, name)
        own = _OwnLinear(plain.in_features, plain.out_features, bias=False, dtype=plain.weight.dtype)
        own.weight = plain.weight
        setattr(ffn, name, own)
    return ffn


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "two-gemms"])
@pytest.mark.parametrize("activation, betas", [("situ", (4.0, 25.0)), ("situ", (2.0, 3.0)), ("swiglu", (4.0, 25.0))])
def test_gated_ffn(activation, betas, stacked):
    """The same formula whether W_gate x and W_in x are one GEMM over the stacked weights (plain
    linears) or two (other linears)."""
    ffn = randomize(GatedFFN(D, 24, activation, *betas).double(), seed=6)
    if not stacked:
        ffn = _unstacked(ffn)
    x = inputs(2, 6, seed=7, scale=3.0)  # large enough that both tanh factors bend
    leaves = {"x": x, **parameters_of(ffn)}
    assert_matches(lambda: ffn(x), lambda: ref.glu(x, ffn.w_gate.weight, ffn.w_in.weight, ffn.w_out.weight,
                                                   activation, *betas), leaves)


# ----------------------------------------------------------------------------- KDA
KDA_CASES = {
    "bounded-gate-full-output-gate": KDAConfig(num_heads=2, head_dim=8),
    "softplus-gate-low-rank-output-gate-and-decay": KDAConfig(num_heads=2, head_dim=8, gate="softplus",
                                                               output_gate="low_rank", output_gate_rank=3,
                                                               decay_rank=4),
    "bounded-gate-g_min-2-conv-3": KDAConfig(num_heads=3, head_dim=4, g_min=-2.0, conv_size=3),
    # the cases above run the default fused projections (two GEMMs, one convolution over the stacked
    # channels); this one runs the six projections and three convolutions one by one: the same formula
    "six-projections-conv-3": KDAConfig(num_heads=3, head_dim=4, conv_size=3, fused_projections=False),
}


@pytest.mark.parametrize("case", list(KDA_CASES))
@pytest.mark.parametrize("packed_row", [True, False])
def test_kda_layer(case, packed_row):
    cfg = KDA_CASES[case]
    layer = randomize(KDAttention(D, cfg, EPS).double(), seed=8)
    x, cu, bounds = layer_case(packed_row, seed=9)
    leaves = {"x": x, **parameters_of(layer)}
    assert_matches(lambda: layer(x, **packed(cu)), lambda: rows(lambda r, b: ref.kda_layer(layer, r, b, EPS), x, bounds),
                   leaves)


def test_kda_defaults_are_the_documented_ones():
    """Bounded gate with the fixed floor g_min = -5, short conv of width 4."""
    cfg = KDAConfig()
    assert (cfg.gate, cfg.g_min, cfg.conv_size) == ("bounded", -5.0, 4)


def test_kda_documents_restart_state_and_conv():
    """The same document gives the same output alone and after another one in a packed row."""
    layer = randomize(KDAttention(D, KDA_CASES["bounded-gate-full-output-gate"], EPS).double(), seed=10)
    x = inputs(1, 14, seed=11)
    before = inputs(1, 5, seed=12)
    row = torch.cat([before, x], dim=1)
    out = layer(row, **packed(torch.tensor([0, 5, 19], dtype=torch.int32)))
    assert rel(out[:, 5:], layer(x)) < FLOAT64_RTOL
    assert rel(layer(row)[:, 5:], layer(x)) > 1e-3  # without the boundary the first document leaks in


# ----------------------------------------------------------------------------- Gated MLA
MLA_CASES = {
    "low-rank-q-shared-key-gate": MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_dim=6,
                                              qk_rope_dim=4, v_dim=5),
    "direct-q-no-shared-key-no-gate": MLAConfig(num_heads=3, q_lora_rank=None, kv_lora_rank=7, qk_nope_dim=4,
                                                  qk_rope_dim=0, v_dim=6, gate=False),
    "separate-projections": MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_dim=6, qk_rope_dim=4,
                                      v_dim=5, fused_projections=False),
}


@pytest.mark.parametrize("case", list(MLA_CASES))
@pytest.mark.parametrize("packed_row", [True, False])
def test_gated_mla(case, packed_row):
    layer = randomize(GatedMLA(D, MLA_CASES[case], EPS).double(), seed=13)
    x, cu, bounds = layer_case(packed_row, seed=14)
    leaves = {"x": x, **parameters_of(layer)}
    assert_matches(lambda: layer(x, **packed(cu)), lambda: rows(lambda r, b: ref.mla_layer(layer, r, b, EPS), x, bounds),
                   leaves)


def test_mla_projections_of_x_are_one_gemm_for_plain_weights(monkeypatch):
    """fused_projections (test_gated_mla checks its math, both ways) computes W_dkv x, the shared key,
    W_dq x and the gate's logits as one GEMM of x; where one of them is not a plain nn.Linear (float8,
    tensor parallelism) or with fused_projections off, each runs its own."""
    linears = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a: linears.append(w.shape[0]) or real_linear(x, w, *a))
    cfg = MLA_CASES["low-rank-q-shared-key-gate"]
    layer = randomize(GatedMLA(D, cfg, EPS).double(), seed=13)
    x = inputs(1, 9, seed=3)
    want = layer(x)
    H, qk, gate = cfg.num_heads, cfg.qk_dim, cfg.num_heads * cfg.v_dim
    up = [H * qk, H * (cfg.qk_nope_dim + cfg.v_dim), D]  # W_uq, W_ukv, W_o
    assert linears == [cfg.kv_lora_rank + cfg.qk_rope_dim + cfg.q_lora_rank + gate, *up]
    one_by_one = [cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.q_lora_rank, gate, *up]

    class OtherLinear(torch.nn.Linear):
        pass

    other = OtherLinear(D, gate, bias=False).double()
    other.weight.data.copy_(layer.gate_proj.weight)
    layer.gate_proj = other
    linears.clear()
    assert rel(layer(x), want) < FLOAT64_RTOL
    assert linears == one_by_one
    separate = GatedMLA(D, dataclasses.replace(cfg, fused_projections=False), EPS).double()
    separate.load_state_dict(layer.state_dict())
    linears.clear()
    assert rel(separate(x), want) < FLOAT64_RTOL
    assert linears == one_by_one


def test_mla_softmax_scale_counts_the_shared_key_dims():
    layer = GatedMLA(D, MLA_CASES["low-rank-q-shared-key-gate"], EPS)
    assert layer.scale == pytest.approx((6 + 4) ** -0.5, rel=1e-15)


# ----------------------------------------------------------------------------- AttnRes
def test_depth_mixer():
    mixer = randomize(DepthMixer(D, EPS).double(), seed=15)
    gen = torch.Generator().manual_seed(16)
    sources = [(torch.randn(2, 5, D, generator=gen, dtype=F64) * (i + 1)).requires_grad_(True) for i in range(4)]
    leaves = {**{f"source {i}": s for i, s in enumerate(sources)}, **parameters_of(mixer)}
    assert_matches(lambda: mixer(sources), lambda: ref.depth_mixture(sources, mixer.query, mixer.norm.weight, EPS),
                   leaves)


def test_depth_mixer_with_zero_query_is_the_uniform_mean():
    gen = torch.Generator().manual_seed(17)
    sources = [torch.randn(2, 5, D, generator=gen, dtype=F64) * (i + 1) for i in range(4)]
    assert rel(DepthMixer(D).double()(sources), torch.stack(sources).mean(0)) < 1e-14


@pytest.mark.parametrize("mode, block_size", [("block", 1), ("block", 2), ("block", 3), ("full", 2), ("none", 2)])
def test_residual_stream_feeds_each_sublayer_its_mixture(mode, block_size):
    """Five decoder layers of two sublayers f(h) = tanh(h W): every sublayer input and the final output
    follow the definition of the sources (embedding, completed blocks, partial block) and the mixers."""
    layers = 5
    gen = torch.Generator().manual_seed(18)
    weights = [torch.randn(D, D, generator=gen, dtype=F64) / D**0.5 for _ in range(2 * layers)]
    mixers = [randomize(DepthMixer(D, EPS).double(), seed=100 + j) for j in range(2 * layers + 1)]
    embedding = inputs(2, 3, seed=19)

    def mixer_for(j):
        return None if mode == "none" or j == 0 else mixers[j]  # the first sublayer sees one source

    stream = ResidualStream.start(mode, embedding)
    inputs_seen = []
    for i in range(layers):
        for s in range(2):
            j = 2 * i + s
            h = stream.sublayer_input(mixer_for(j))
            inputs_seen.append(h)
            stream = stream.plus(torch.tanh(h @ weights[j]))
        stream = stream.end_layer(i, block_size)
    out = stream.sublayer_input(None if mode == "none" else mixers[-1])

    sources = ref.DepthSources(mode, block_size, embedding)
    expected = []
    for i in range(layers):
        for s in range(2):
            j = 2 * i + s
            m = mixers[j]
            h = sources.input(m.query, m.norm.weight, EPS)
            expected.append(h)
            sources.add(torch.tanh(h @ weights[j]))
        sources.layer_done(i)
    want = sources.input(mixers[-1].query, mixers[-1].norm.weight, EPS)
    for j, (got, exp) in enumerate(zip(inputs_seen, expected)):
        assert rel(got, exp) < FLOAT64_RTOL, f"input of sublayer {j}"
    leaves = {"embedding": embedding, **({} if mode == "none" else {"final query": mixers[-1].query})}
    assert_matches(lambda: out, lambda: want, leaves)


# ----------------------------------------------------------------------------- LatentMoE
MOE = MoEConfig(num_routed=6, top_k=2, num_shared=2, latent_dim=8, expert_hidden=12, routing_scale=2.5)
MOE_CASES = {
    "latent-two-shared-scale-2.5": MOE,
    "no-latent-no-shared": dataclasses.replace(MOE, latent_dim=None, num_shared=0),
    "swiglu-one-shared-top-3": dataclasses.replace(MOE, activation="swiglu", num_shared=1, top_k=3,
                                                            routing_scale=1.0),
    "sign-balancing": dataclasses.replace(MOE, balancing="sign"),  # selects with its own top-k, not QB's cutoff
    "separate-projections": dataclasses.replace(MOE, fused_projections=False),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_latent_moe(case):
    moe = randomize(LatentMoE(D, MOE_CASES[case], EPS).double(), seed=20, bias_scale=0.15).eval()
    x = inputs(2, 20, seed=21, scale=2.0)
    flat = x.detach().reshape(-1, D)
    scores_only = torch.sigmoid(moe.router(flat)).topk(moe.cfg.top_k, -1).indices.sort(-1).values
    with_bias = ref.routed_experts(moe, flat).sort(-1).values
    changed = (scores_only != with_bias).any(-1).float().mean()
    assert changed > 0.2, f"the bias changes the selection of only {changed:.0%} of the tokens"
    leaves = {"x": x, **parameters_of(moe)}
    assert_matches(lambda: moe(x), lambda: ref.latent_moe(moe, x.reshape(-1, D), EPS).reshape(x.shape), leaves)


def test_moe_input_projections_are_one_gemm_for_plain_weights(monkeypatch):
    """fused_projections (test_latent_moe checks its math) computes the router's logits, z and the
    shared experts' gate and input projections as one GEMM of x; where the shared experts' weights
    are not plain nn.Linears (float8, tensor parallelism) the router and W_down stay stacked and the
    shared experts run on their own, and with fused_projections off the router, W_down and the shared experts each run their own."""
    linears = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a: linears.append(w.shape[0]) or real_linear(x, w, *a))
    cfg = MOE
    moe = randomize(LatentMoE(D, cfg, EPS).double(), seed=20, bias_scale=0.15).eval()
    x = inputs(2, 20, seed=21, scale=2.0)
    want = moe(x)
    shared = 2 * cfg.num_shared * cfg.expert_hidden
    E, latent = cfg.num_routed, cfg.latent_dim
    assert linears == [E + latent + shared, D, D]  # stacked; W_up; the shared experts' W_out

    class OtherLinear(torch.nn.Linear):
        pass

    other = OtherLinear(D, moe.shared.w_gate.out_features, bias=False).double()
    other.weight.data.copy_(moe.shared.w_gate.weight)
    moe.shared.w_gate = other
    linears.clear()
    assert rel(moe(x), want) < FLOAT64_RTOL
    assert linears == [E + latent, D, shared // 2, shared // 2, D]
    separate = LatentMoE(D, dataclasses.replace(cfg, fused_projections=False), EPS).double().eval()
    separate.load_state_dict(moe.state_dict())
    linears.clear()
    assert rel(separate(x), want) < FLOAT64_RTOL
    assert linears == [E, latent, D, shared, D]  # the shared experts stack their own two (GatedFFN)


def test_router_scores_are_fp32_for_bf16_activations():
    moe = LatentMoE(D, MOE, EPS).bfloat16()
    scores, _, weights = moe.route(moe.router(torch.randn(5, D).bfloat16()))
    assert scores.dtype == torch.float32 and weights.dtype == torch.float32
    assert rel(weights.sum(-1), torch.full((5,), MOE.routing_scale)) < 1e-6


def test_gated_mla_in_bf16_is_limited_by_the_attention_not_by_its_output_tail(monkeypatch):
    """Under bf16 autocast the layer output is within the bf16 budget (1e-2) of float64, and running the
    output gate and W_o in fp32 from the same bf16 attention output would remove little of that error
    (measured ~10%: the error is made upstream, in the bf16 projections and SDPA): why the layer has no
    fp32-output option (docs/model.md, numerics)."""
    cfg = MLAConfig(num_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_dim=64, qk_rope_dim=32, v_dim=64)
    d = 256
    layer = randomize(GatedMLA(d, cfg, EPS), seed=30)
    x = torch.randn(1, 256, d, generator=torch.Generator().manual_seed(31))
    want = ref.mla_layer(layer.double(), x[0].double(), None, EPS).detach()
    layer.float()
    seen = {}
    attention = mla.causal_document_attention

    def recorded(*args, **kwargs):
        seen["o"] = attention(*args, **kwargs)
        return seen["o"]

    monkeypatch.setattr(mla, "causal_document_attention", recorded)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)[0]
        gate_logits = layer.gate_proj(x)[0]
    o = seen["o"].transpose(1, 2).reshape(256, -1)
    assert y.dtype == o.dtype == torch.bfloat16
    fp32_tail = (torch.sigmoid(gate_logits.float()) * o.float()) @ layer.o_proj.weight.T
    err, err_fp32_tail = rel(y, want), rel(fp32_tail, want)
    assert err < 1e-2
    assert err_fp32_tail > 0.8 * err, (err, err_fp32_tail)


def test_fused_projections_are_two_gemms_and_one_convolution_for_plain_weights(monkeypatch):
    """fused_projections (the cases above check its math) runs the six projections of x as two GEMMs
    and one short convolution over the stacked channels; a group whose projections are not all
    plain nn.Linears (float8 linears, tensor parallelism's DTensor weights) keeps its own calls."""
    import moe_lc.model.kda as kda_module
    from moe_lc.model.short_conv import ShortConv

    convs, linears = [], []
    real_conv, real_linear = kda_module.short_conv_pieces, torch.nn.functional.linear
    monkeypatch.setattr(kda_module, "short_conv_pieces",
                        lambda *a, **k: convs.append(a[0].shape[-1]) or real_conv(*a, **k))
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, *a: linears.append(w.shape[0]) or real_linear(x, w, *a))
    per_module = []
    real_forward = ShortConv.forward
    monkeypatch.setattr(ShortConv, "forward", lambda self, *a, **k: per_module.append(1) or real_forward(self, *a, **k))
    cfg = KDAConfig(num_heads=3, head_dim=4, conv_size=3)
    layer = randomize(KDAttention(D, cfg, EPS).double(), seed=8)
    x = inputs(1, 9, seed=3)
    want = layer(x)
    inner, H, K = cfg.inner_dim, cfg.num_heads, cfg.head_dim
    # stacked q, k, v; stacked beta, decay down, gate; decay up; o_proj
    assert convs == [3 * inner] and per_module == [] and linears == [3 * inner, H + K + inner, inner, D]

    class OtherLinear(torch.nn.Linear):
        pass

    for name in ("q_proj", "beta_proj"):
        other = OtherLinear(D, getattr(layer, name).out_features, bias=False).double()
        other.weight.data.copy_(getattr(layer, name).weight)
        setattr(layer, name, other)
        convs.clear(), linears.clear(), per_module.clear()
        got = layer(x)
        assert rel(got, want) < FLOAT64_RTOL
        if name == "q_proj":  # q, k, v one by one, the small group still stacked
            assert convs == [] and len(per_module) == 3 and linears == [inner] * 3 + [H + K + inner, inner, D]
        else:  # both groups one by one
            assert convs == [] and len(per_module) == 3 and linears == [inner] * 3 + [H, K, inner, inner, D]


@pytest.mark.parametrize("layer,cfg", [(KDAttention, KDAConfig(num_heads=2, head_dim=8)),
                                       (GatedMLA, MLA_CASES["low-rank-q-shared-key-gate"])], ids=["kda", "mla"])
def test_fused_projections_under_autocast_match_the_separate_ones(layer, cfg):
    """Under bf16 autocast the fused path (KDA's six projections of x, MLA's four) casts x once and
    gives the separate projections' result within bf16 rounding (both round the same bf16 operands;
    only the order of the sums may differ)."""
    torch.manual_seed(0)
    fused = layer(D, cfg, EPS)
    separate = layer(D, dataclasses.replace(cfg, fused_projections=False), EPS)
    separate.load_state_dict(fused.state_dict())
    x = torch.randn(1, 21, D)
    cu = torch.tensor(CU, dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fused(x, **packed(cu)), separate(x, **packed(cu))
    assert a.dtype == b.dtype == torch.bfloat16
    assert rel(a.float(), b.float()) < 4 * torch.finfo(torch.bfloat16).eps
