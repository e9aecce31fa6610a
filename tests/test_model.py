"""Model-level behaviour of the plain-PyTorch reference (docs/design.md §1-§7)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.model.attn_res import ResidualStream
from moe_lc.model.ffn import situ_glu, swiglu
from moe_lc.model.init import build_model
from moe_lc.ops.attention import causal_document_attention
from moe_lc.model.short_conv import causal_depthwise_conv
from moe_lc.model.transformer import IGNORE_INDEX
from moe_lc.ops.documents import DocumentBounds
from moe_lc.presets import get_preset
from configs import set_fields, tiny


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- SiTU-GLU ------------------------------------------------------------------------------
def test_situ_is_bounded_by_beta_product():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(100_000, generator=g, dtype=torch.float64) * 1e3
    c = torch.randn(100_000, generator=g, dtype=torch.float64) * 1e3
    out = situ_glu(a, c, 4.0, 25.0)
    assert out.abs().max() <= 4.0 * 25.0
    assert out.abs().max() > 0.9 * 100.0  # the bound is approached, not a loose guess


def test_situ_matches_swiglu_to_first_order_with_each_betas_own_correction():
    """b tanh(x / b) = x - x^3 / (3 b^2) + O(x^5), so
    SiTU(a, c) - SwiGLU(a, c) = -sigmoid(a) [a^3 c / (3 b1^2) + a c^3 / (3 b2^2)] + O(eps^6) at a, c ~ eps:
    the leading correction names which constant bounds which factor (a != c tells b1 from b2)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g, dtype=torch.float64)
    c = torch.randn(1000, generator=g, dtype=torch.float64)
    for eps in (1e-1, 1e-2):
        x, y = eps * a, eps * c
        correction = -torch.sigmoid(x) * (x**3 * y / (3 * 4.0**2) + x * y**3 / (3 * 25.0**2))
        diff = situ_glu(x, y) - swiglu(x, y)
        # the next term is O(eps^6), i.e. O(eps^2) relative to the correction; 10 eps^2 bounds it here
        assert rel(diff, correction) < 10 * eps**2


# -- Attention residuals -------------------------------------------------------------------
def test_attn_res_block_sources_follow_block_size():
    emb = torch.randn(1, 3, 8)
    s = ResidualStream.start("block", emb)
    for layer in range(5):
        before = s
        s = s.plus(torch.full_like(emb, float(layer))).plus(torch.full_like(emb, 10.0 * layer))
        s = s.end_layer(layer, block_size=2)
        assert len(before.sources) == 1 + layer // 2  # updates return a new stream; the old one is unchanged
    # blocks {0,1}, {2,3} completed, {4} partial -> embedding + 2 block sums + partial
    assert len(s.sources) == 3 and s.partial is not None
    assert torch.allclose(s.sources[1], torch.full_like(emb, 0 + 0 + 1 + 10))
    assert torch.allclose(s.partial, torch.full_like(emb, 4 + 40))


@pytest.mark.parametrize("mode", ["block", "none"])
def test_under_autocast_the_embedding_enters_the_stream_in_autocasts_dtype_unless_fp32_embedding(mode):
    """The stream's other sources are sublayer outputs in autocast's dtype; an fp32 embedding would make
    every mixture (and every sublayer input) fp32. ``fp32_embedding`` keeps the weights' dtype; without
    autocast nothing changes."""
    ids = torch.tensor([[1, 2, 3, 4]])
    for fp32_embedding, want in ((False, torch.bfloat16), (True, torch.float32)):
        model = build_model(tiny(**{"attn_res.mode": mode, "fp32_embedding": fp32_embedding}), seed=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stream = model.start_stream(ids)
        first = stream.all_sources()[0] if mode == "block" else stream.partial
        assert first.dtype == want
        assert torch.equal(first, model.embed.weight[ids].to(want))
        assert model.start_stream(ids).all_sources()[0].dtype == torch.float32


def test_the_mixture_backend_and_the_fused_loss_come_from_the_config():
    """``attn_res.backend`` reaches every depth mixer and ``fused_loss`` the model, so a recipe can run
    the reference paths (compare_paths, a same-run baseline); a wrong backend is a config error."""
    from moe_lc.model.attn_res import DepthMixer

    model = build_model(tiny(**{"attn_res.backend": "torch", "fused_loss": False}), seed=0)
    mixers = [m for m in model.modules() if isinstance(m, DepthMixer)]
    assert mixers and all(m.norm.backend == "torch" for m in mixers)
    assert model.fused_loss is False and not model.fuses_head_and_loss()
    default = build_model(tiny(), seed=0)
    assert all(m.norm.backend == "auto" for m in default.modules() if isinstance(m, DepthMixer))
    assert default.fused_loss is True and default.fuses_head_and_loss()
    with pytest.raises(ConfigError, match="attn_res.backend"):
        tiny(**{"attn_res.backend": "cuda"})
    with pytest.raises(ConfigError, match="moe.dispatch_backend='cuda': use auto, torch or triton"):
        tiny(**{"moe.dispatch_backend": "cuda"})


def test_attn_res_none_is_plain_residual():
    cfg = tiny(**{"attn_res.mode": "none"})
    model = build_model(cfg, seed=0).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    h = model.embed(ids)
    for layer in model.layers:
        h = h + layer.attn(layer.attn_norm(h))
        h = h + layer.ffn(layer.ffn_norm(h))
    expected = model.final_norm(h)
    model.eval()
    assert rel(model.hidden_states(ids), expected) < 1e-12


# -- masking and document independence -----------------------------------------------------
def test_causal_document_attention_matches_masked_softmax():
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 23, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 23, 6, generator=g, dtype=torch.float64)  # v narrower than q/k, as in MLA
    cu = torch.tensor([0, 5, 6, 17, 23])
    out = causal_document_attention(q, k, v, 0.3, mask=DocumentBounds.of(cu).attention_mask)
    doc = torch.searchsorted(cu[1:], torch.arange(23), right=True)
    t = torch.arange(23)
    allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    scores = (q @ k.transpose(-1, -2)) * 0.3
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    assert rel(out, ref) < 1e-12


def test_short_conv_restarts_at_document_boundaries():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 20, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 2, 9, 20])
    packed = causal_depthwise_conv(x, w, cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        # reference: torch's conv1d on the document alone, left-padded with zeros
        xd = x[:, s:e].transpose(1, 2)
        ref = F.conv1d(F.pad(xd, (3, 0)), w.unsqueeze(1), groups=6).transpose(1, 2)
        assert rel(packed[:, s:e], ref) < 1e-12


def packed_bounds(lengths: list[int]) -> DocumentBounds:
    return DocumentBounds.from_host([0, *itertools.accumulate(lengths)], "cpu")


def test_packed_documents_are_independent():
    cfg = tiny()
    model = build_model(cfg, seed=0).double().eval()
    g = torch.Generator().manual_seed(6)
    lens = [7, 70, 1, 30]
    docs = [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in lens]
    packed = torch.cat(docs, dim=1)
    out = model(packed, docs=packed_bounds(lens)).logits
    alone = torch.cat([model(d).logits for d in docs], dim=1)
    assert rel(out, alone) < 1e-10


def test_packed_losses_are_the_token_weighted_losses_of_each_document_alone():
    """LM and MTP losses of a packed row equal the label-weighted means of every document run
    alone: no layer mixes documents and MTP never predicts across a boundary (its label at each
    document's last token, the next document's first label, is dropped: a lone document has none)."""
    cfg = tiny(mtp=True)
    model = build_model(cfg, seed=0).double().eval()
    g = torch.Generator().manual_seed(8)
    lens = [9, 40, 2, 25]
    ids = [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in lens]
    labels = [torch.cat([d[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1) for d in ids]
    labels[1][0, 5:9] = IGNORE_INDEX  # ragged ignored labels inside a document
    for n in (0, 2):  # cut mid-document (a window edge): the last label is the stream's next token
        labels[n][0, -1] = 3
    packed = model(torch.cat(ids, dim=1), labels=torch.cat(labels, dim=1), docs=packed_bounds(lens))

    lm_sum = mtp_sum = lm_tokens = mtp_tokens = 0.0
    for d, lab in zip(ids, labels):
        alone = model(d, labels=lab)
        n_lm = int((lab != IGNORE_INDEX).sum())
        kept = lab != IGNORE_INDEX
        n_mtp = int((kept[:, :-1] & kept[:, 1:]).sum())  # MTP targets labels[t + 1] where labels[t] is kept
        lm_sum, lm_tokens = lm_sum + n_lm * alone.lm_loss, lm_tokens + n_lm
        if n_mtp:
            mtp_sum, mtp_tokens = mtp_sum + n_mtp * alone.mtp_loss, mtp_tokens + n_mtp
    assert rel(packed.lm_loss, lm_sum / lm_tokens) < 1e-10
    assert rel(packed.mtp_loss, mtp_sum / mtp_tokens) < 1e-10


def test_packed_documents_must_fit_the_batch():
    model = build_model(tiny(), seed=0)
    ids = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="last boundary 9"):
        model(ids, docs=packed_bounds([4, 5]))
    with pytest.raises(ValueError, match=r"input_ids \[1, T\]"):
        model(torch.zeros(2, 5, dtype=torch.long), docs=packed_bounds([4, 6]))
    with pytest.raises(TypeError, match="DocumentBounds.from_host"):
        model(ids, docs=torch.tensor([0, 4, 10]))


def test_causality_future_tokens_do_not_change_past_outputs():
    cfg = tiny()
    model = build_model(cfg, seed=0).double().eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    ids2 = ids.clone()
    ids2[:, 25:] = torch.randint(0, cfg.vocab_size, (2, 15), generator=g)
    a, b = model(ids).logits, model(ids2).logits
    assert rel(a[:, :25], b[:, :25]) < 1e-12
    assert rel(a[:, 25:], b[:, 25:]) > 1e-3


# -- initialisation ------------------------------------------------------------------------
def test_initialisation_follows_spec():
    cfg = tiny()
    model = build_model(cfg, seed=0)
    for layer in model.layers:
        assert torch.all(layer.ffn_mixer.query == 0)
        assert (layer.attn_mixer is None) == (layer.layer_idx == 0)  # the first sublayer has one source
        assert layer.attn_mixer is None or torch.all(layer.attn_mixer.query == 0)
        if layer.kind == "K":
            kda = layer.attn
            assert torch.all(kda.A_log == 0)
            # at z = 0 the initial per-step decay -g spans [1e-3, 0.1]
            g = cfg.kda.g_min * torch.sigmoid(kda.dt_bias)
            assert (-g).min() >= 1e-3 * 0.999 and (-g).max() <= 0.1 * 1.001
            assert (-g).max() / (-g).min() > 10  # several time scales, not one
    assert torch.all(model.out_mixer.query == 0)
    std = model.layers[1].attn.q_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_softplus_gate_init_spans_time_scales():
    cfg = tiny(**{"kda.gate": "softplus"})
    kda = build_model(cfg, seed=0).layers[0].attn
    dt = F.softplus(kda.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001


# -- training ------------------------------------------------------------------------------
def test_tiny_model_learns_a_fixed_batch():
    torch.manual_seed(0)
    cfg = tiny()
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, cfg.vocab_size, (4, 33), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(50):
        out = model(inputs, labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        for moe in model.moe_layers():
            moe.balancer.update()
        losses.append(out.lm_loss.item())
    assert losses[0] > 5.5  # ~ln(512) at init
    assert losses[-1] < 0.5 * losses[0], losses


def test_padding_labels_are_ignored():
    cfg = tiny()
    model = build_model(cfg, seed=0).double().eval()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 10), generator=g)
    masked = labels.clone()
    masked[:, 6:] = -100
    out = model(ids, masked)
    logp = torch.log_softmax(out.logits, -1)
    ref = -logp[:, :6].gather(-1, labels[:, :6, None]).mean()
    assert rel(out.lm_loss, ref) < 1e-12


# -- configuration errors ------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"layer_pattern": "KKKM"}, "layer_pattern"),
        ({"layer_pattern": "KKKMK"}, "must end with 'M'"),
        ({"layer_pattern": "KKXMM"}, "may only contain"),
        ({"moe.top_k": 8}, "moe.top_k"),
        ({"moe.latent_dim": 1000}, "moe.latent_dim"),
        ({"moe.balancing": "loss"}, "moe.balancing"),
        ({"kda.gate": "relu"}, "kda.gate"),
        ({"kda.g_min": 1.0}, "kda.g_min"),
        ({"attn_res.mode": "dense"}, "attn_res.mode"),
        ({"mla.kv_lora_rank": 0}, "mla.kv_lora_rank"),
        ({"moe.first_dense_layers": 5}, "moe.first_dense_layers"),
    ],
)
def test_invalid_configs_raise_clear_errors(overrides, needle):
    bad = set_fields(get_preset("tiny"), overrides)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        bad.validate()


def test_unknown_config_keys_are_named():
    with pytest.raises(ConfigError, match="lattent_dim"):
        ModelConfig.from_dict({"moe": {"lattent_dim": 3}})
    with pytest.raises(ConfigError, match="unknown model preset"):
        get_preset("k4")


def test_every_parameter_gets_a_gradient():
    """Optimizers and checkpoint loaders expect state for every parameter: none may be dead."""
    for overrides in ({}, {"attn_res.mode": "full"}, {"attn_res.mode": "none"}, {"mtp": True}):
        cfg = tiny(**overrides)
        model = build_model(cfg, seed=0)
        ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(11))
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        dead = [n for n, p in model.named_parameters() if p.grad is None]
        assert not dead, (overrides, dead)


def test_chunked_lm_loss_equals_full_loss_and_gradients():
    cfg = tiny()
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    labels[0, 5:30] = -100  # a whole chunk without targets must not produce NaN
    results = []
    for chunk_elements in (None, 7 * 512):
        model = build_model(cfg, seed=0).double()
        if chunk_elements is not None:
            model.loss_chunk_elements = chunk_elements  # 7 tokens per chunk
        out = model(ids, labels, return_logits=chunk_elements is None)
        out.loss.backward()
        results.append((out.lm_loss.detach(), model.lm_head.weight.grad.clone(), model.embed.weight.grad.clone()))
    (l_full, gh_full, ge_full), (l_chunk, gh_chunk, ge_chunk) = results
    assert torch.isfinite(l_chunk)
    assert rel(l_chunk, l_full) < 1e-12
    assert rel(gh_chunk, gh_full) < 1e-10 and rel(ge_chunk, ge_full) < 1e-10
