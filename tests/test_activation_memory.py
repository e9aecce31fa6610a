"""The plan's activation memory model against what the real model keeps (CPU reference path, fp32).

`moe_lc.parallel.activation_memory` counts analytically, per layer and policy, the bytes a forward
keeps for backward; `moe_lc.metrics.saved_activations` measures them by running the model. They
must agree within 15% for every layer and in total, for the tiny model in several variants and
for the proxy model's shapes at a short sequence.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import ModelConfig
from moe_lc.metrics.saved_activations import measure_saved_activations
from moe_lc.model.init import build_model
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, CheckpointMode, apply_activation_checkpointing
from moe_lc.parallel.activation_memory import (GPU_AUTOCAST, REFERENCE_FP32, estimate_activations,
                                              fused_kda_kept_prep_bytes_per_head, fused_kda_kept_states_bytes_per_head)
from configs import preset_with

TOLERANCE = 0.15


def config(name: str, **overrides) -> ModelConfig:
    return preset_with(name, **{"kda.backend": "torch", **overrides})


VARIANTS = {
    "tiny": config("tiny"),
    "tiny, full AttnRes, MTP, SwiGLU": config("tiny", **{"attn_res.mode": "full", "mtp": True, "moe.activation": "swiglu"}),
    "tiny, plain residual, no latent or shared experts, low-rank gate": config(
        "tiny", **{"attn_res.mode": "none", "moe.latent_dim": None, "moe.num_shared": 0, "kda.output_gate": "low_rank",
                   "mla.q_lora_rank": None, "mla.gate": False, "mla.fp32_output": False}),
    "proxy shapes (16 experts)": config("proxy", **{"moe.num_routed": 16}),
}


def measured_and_estimated(cfg: ModelConfig, mode: CheckpointMode, tokens: int = 128):
    model = build_model(cfg, "cpu", seed=0)
    policy = ActivationCheckpointing(mode)
    apply_activation_checkpointing(model, policy)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    measured = measure_saved_activations(model, ids, labels, backward=False)
    return measured, estimate_activations(cfg, policy, tokens, REFERENCE_FP32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_estimate_matches_the_measured_bytes_per_layer_and_policy(variant):
    cfg = VARIANTS[variant]
    for mode in CheckpointMode:
        measured, estimate = measured_and_estimated(cfg, mode)
        assert set(estimate.by_layer) == set(measured.bytes_by_layer), f"{variant}, {mode}: layers differ"
        for label, predicted in estimate.by_layer.items():
            got = measured.per_token(label)
            assert abs(predicted / got - 1) < TOLERANCE, f"{variant}, {mode}, {label}: plan {predicted:.0f} B/token, " \
                                                         f"measured {got:.0f}"
        assert abs(estimate.per_token / measured.per_token() - 1) < TOLERANCE


def test_every_n_counts_only_the_checkpointed_layers():
    cfg = VARIANTS["tiny"]
    none = estimate_activations(cfg, ActivationCheckpointing(), 128, REFERENCE_FP32).by_layer
    full = estimate_activations(cfg, ActivationCheckpointing("full"), 128, REFERENCE_FP32).by_layer
    every2 = estimate_activations(cfg, ActivationCheckpointing("full", every=2), 128, REFERENCE_FP32).by_layer
    assert [every2[f"layer{i}"] for i in range(5)] == [none["layer0"], full["layer1"], none["layer2"],
                                                       full["layer3"], none["layer4"]]


@pytest.mark.parametrize("what", ["kda_states", "kda_prep"])
def test_kept_kda_states_add_their_bytes_to_each_kda_layer_the_fused_kernels_run(what):
    cfg = VARIANTS["tiny"]
    per_head = {"kda_states": fused_kda_kept_states_bytes_per_head,
                "kda_prep": fused_kda_kept_prep_bytes_per_head}[what](cfg.kda.head_dim, cfg.kda.head_dim)
    per_layer = cfg.kda.num_heads * per_head
    for policy in (ActivationCheckpointing(), ActivationCheckpointing("full", every=2)):
        plain = estimate_activations(cfg, policy, 128, GPU_AUTOCAST).by_layer
        kept = estimate_activations(cfg, ActivationCheckpointing(policy.mode, policy.every, **{what: True}), 128,
                                    GPU_AUTOCAST).by_layer
        for i, kind in enumerate(cfg.pattern):  # a fully checkpointed layer keeps its inputs only
            adds = per_layer if kind == "K" and not policy.checkpoints(i) else 0.0
            assert kept[f"layer{i}"] - plain[f"layer{i}"] == pytest.approx(adds, abs=1e-9), (policy, i)
        assert kept["other"] == plain["other"] and kept.get("mtp") == plain.get("mtp")
    # the torch reference KDA (CPU) keeps what autograd saves: the setting changes nothing there
    ref = ActivationCheckpointing(**{what: True})
    assert estimate_activations(cfg, ref, 128, REFERENCE_FP32).by_layer == \
        estimate_activations(cfg, ActivationCheckpointing(), 128, REFERENCE_FP32).by_layer
