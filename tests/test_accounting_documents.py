"""Attention FLOPs stop at document ends: the keys counted per query match a brute-force mask count."""

import torch

from moe_lc.model.accounting import causal_keys_per_token, mixing_flops_per_token
from moe_lc.presets import get_preset


def _mask_keys_per_token(lengths: list[int]) -> float:
    """Count the ones of the block-diagonal causal mask directly."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = torch.arange(len(doc))
    allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    return allowed.sum().item() / len(doc)


def test_keys_per_token_counts_the_document_mask():
    for lengths in ([17], [5, 1, 9, 3], [1] * 7, [64, 2]):
        assert abs(causal_keys_per_token(lengths) - _mask_keys_per_token(lengths)) < 1e-12


def test_one_document_is_the_default_and_packing_lowers_the_attention_flops():
    cfg = get_preset("proxy")
    T = 4096
    assert mixing_flops_per_token(cfg, T) == mixing_flops_per_token(cfg, T, causal_keys_per_token([T]))
    packed = mixing_flops_per_token(cfg, T, causal_keys_per_token([1024] * 4))
    # only the MLA term depends on the keys: its per-key cost times the keys saved
    m = cfg.mla
    per_key = 2 * m.num_heads * (m.qk_dim + m.v_dim) * cfg.pattern.count("M")
    saved = (T + 1) / 2 - causal_keys_per_token([1024] * 4)
    assert abs(mixing_flops_per_token(cfg, T) - packed - per_key * saved) < 1e-6 * packed
