"""Named model presets (docs/design.md §1.4).

`k3` and `kimi-linear-48b` are for planning (accounting, meta-device builds, layout
checks); `k3-small` keeps K3's shape ratios at a size that fills one H200 (honest MFU
figures need GEMMs of realistic width); `proxy` is a smaller model with realistic head and
expert shapes that trains fast on one GPU; `tiny` is for CI.
"""

from __future__ import annotations

import copy
from typing import Callable

from moe_lc.config import AttnResConfig, ConfigError, KDAConfig, MLAConfig, MoEConfig, ModelConfig


def _tiny() -> ModelConfig:
    return ModelConfig(
        name="tiny",
        d_model=64,
        num_layers=5,
        vocab_size=512,
        vocab_multiple=64,
        layer_pattern="KKKMM",
        kda=KDAConfig(num_heads=2, head_dim=32),
        mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_dim=16),
        attn_res=AttnResConfig(mode="block", block_size=2),
        moe=MoEConfig(num_routed=8, top_k=2, num_shared=1, latent_dim=32, expert_hidden=64, dense_hidden=128),
    )


def _proxy() -> ModelConfig:
    return ModelConfig(
        name="proxy",
        d_model=1024,
        num_layers=9,
        vocab_size=32768,
        kda=KDAConfig(num_heads=8, head_dim=128),
        mla=MLAConfig(num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_dim=128, qk_rope_dim=64, v_dim=128),
        attn_res=AttnResConfig(mode="block", block_size=3),
        moe=MoEConfig(
            num_routed=64, top_k=4, num_shared=1, latent_dim=512, expert_hidden=512, dense_hidden=2816
        ),
    )


def _k3_small() -> ModelConfig:
    """K3's ratios at d_model 2048: 3:1 KDA:MLA, head dim 128, 64 experts top-8, latent d/2,
    expert hidden ~0.86 latent, two shared experts, dense FFN ~2.6 d: 4.3B total / 1.27B active."""
    return ModelConfig(
        name="k3-small",
        d_model=2048,
        num_layers=20,
        vocab_size=65536,
        kda=KDAConfig(num_heads=16, head_dim=128),
        mla=MLAConfig(num_heads=16, q_lora_rank=512, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_dim=128),
        attn_res=AttnResConfig(mode="block", block_size=4),
        moe=MoEConfig(
            num_routed=64, top_k=8, num_shared=2, latent_dim=1024, expert_hidden=896, dense_hidden=5376
        ),
    )


def _kimi_linear_48b() -> ModelConfig:
    return ModelConfig(
        name="kimi-linear-48b",
        d_model=2304,
        num_layers=27,
        vocab_size=163840,
        kda=KDAConfig(num_heads=32, head_dim=128, gate="softplus", output_gate="low_rank"),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                      v_dim=128, gate=False),
        attn_res=AttnResConfig(mode="none"),
        moe=MoEConfig(
            num_routed=256, top_k=8, num_shared=1, latent_dim=None, expert_hidden=1024, dense_hidden=9216,
            activation="swiglu", routing_scale=2.446, balancing="sign",
        ),
    )


def _k3() -> ModelConfig:
    return ModelConfig(
        name="k3",
        d_model=7168,
        num_layers=93,
        vocab_size=163840,
        kda=KDAConfig(num_heads=96, head_dim=128),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_dim=128),
        attn_res=AttnResConfig(mode="block", block_size=12),
        moe=MoEConfig(
            num_routed=896, top_k=16, num_shared=2, latent_dim=3584, expert_hidden=3072, dense_hidden=18432
        ),
        mtp=True,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": _tiny,
    "proxy": _proxy,
    "k3-small": _k3_small,
    "kimi-linear-48b": _kimi_linear_48b,
    "k3": _k3,
}


def get_preset(name: str) -> ModelConfig:
    """A fresh, validated copy of a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name]()).validate()
