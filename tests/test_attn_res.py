"""The AttnRes depth mixture: its math against float64 written from the formula, and what it keeps.

    h = sum_i a_i v_i,    a = softmax_i( w . (g * v_i / rms(v_i)) ),    rms(v) = sqrt(mean(v^2) + eps)
"""

from __future__ import annotations

import math

import torch

from moe_lc.model.attn_res import DepthMixer
from moe_lc.model.norm import RMSNorm

D = 16
EPS = 1e-6


def reference_mixture(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """The formula, token by token in float64 (independent of the module's vectorised code)."""
    B, T, _ = sources[0].shape
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            vs = [s[b, t].double() for s in sources]
            logits = [sum(query[c] * gain[c] * v[c] / math.sqrt(sum(x * x for x in v) / D + EPS) for c in range(D))
                      for v in vs]
            top = max(logits)
            weights = [math.exp(l - top) for l in logits]
            total = sum(weights)
            out[b, t] = sum(w / total * v for w, v in zip(weights, vs))
    return out


def mixer_with_random_parameters(dtype=torch.float64) -> DepthMixer:
    mixer = DepthMixer(D, EPS).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mixer.query.copy_(torch.randn(D, generator=g, dtype=dtype))
        mixer.norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, dtype=dtype))
    return mixer


def random_sources(n: int, dtype=torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, D, generator=g, dtype=torch.float64) * (i + 1)).to(dtype).requires_grad_()
            for i in range(n)]


def test_mixture_and_its_gradients_match_the_formula_in_float64():
    mixer = mixer_with_random_parameters()
    sources = random_sources(4)
    out = mixer(sources)
    query, gain = mixer.query.detach(), mixer.norm.weight.detach()
    expected = reference_mixture([s.detach() for s in sources], query.tolist(), gain.tolist())
    assert (out - expected).abs().max() < 1e-12
    # gradients: against autograd through the same formula written with tensor ops
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [*sources, mixer.query, mixer.norm.weight], grad_out)
    ref_inputs = [s.detach().clone().requires_grad_() for s in sources]
    q_ref, g_ref = query.clone().requires_grad_(), gain.clone().requires_grad_()
    logits = torch.stack([(q_ref * g_ref * v / v.pow(2).mean(-1, keepdim=True).add(EPS).sqrt()).sum(-1)
                          for v in ref_inputs])
    a = torch.softmax(logits, dim=0)
    ref_out = sum(a[i].unsqueeze(-1) * v for i, v in enumerate(ref_inputs))
    ref_grads = torch.autograd.grad(ref_out, [*ref_inputs, q_ref, g_ref], grad_out)
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-12 * max(1.0, want.abs().max().item())


def test_one_source_is_that_source_and_zero_query_is_the_mean():
    mixer = DepthMixer(D, EPS).double()
    sources = random_sources(3)
    assert mixer(sources[:1]) is sources[0]
    assert torch.allclose(mixer(sources), torch.stack(sources).mean(0), rtol=0, atol=1e-12)


def test_fp32_embedding_with_bf16_partial_sums_mixes_in_fp32():
    """With ``fp32_embedding`` under autocast the embedding is fp32 and the block sums bf16: the
    mixture is fp32, computed from the bf16 values as they are (fp32 rounding only)."""
    mixer = mixer_with_random_parameters(torch.float32)
    sources = [s.detach().float() for s in random_sources(3)]
    sources = [sources[0]] + [s.bfloat16() for s in sources[1:]]
    out = mixer(sources)
    assert out.dtype == torch.float32
    expected = reference_mixture(sources, mixer.query.tolist(), mixer.norm.weight.tolist())
    assert (out.double() - expected).abs().max() < 1e-5 * expected.abs().max()


def saved_new_bytes(fn, inputs: list[torch.Tensor]) -> int:
    """Bytes of the storages autograd saves while ``fn`` runs, each storage once, not counting ``inputs``'."""
    known = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_the_mixture_keeps_its_sources_and_two_numbers_per_source_and_token():
    S, B, T = 4, 2, 64
    mixer = mixer_with_random_parameters(torch.float32)
    sources = [torch.randn(B, T, D, requires_grad=True) for _ in range(S)]
    params = [mixer.query, mixer.norm.weight]
    kept = saved_new_bytes(lambda: mixer(sources), sources + params)
    assert kept == 2 * S * B * T * 4  # the softmax weights and the inverse rms, fp32 [S, B, T] each

    def stacked():  # the former formulation: one [S, B, T, d] copy of the sources, normed, kept by autograd
        v = torch.stack(sources)
        logits = (RMSNorm.forward(mixer.norm, v) * mixer.query).sum(-1)
        return (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0)

    assert saved_new_bytes(stacked, sources + params) >= 3 * S * B * T * D * 4
