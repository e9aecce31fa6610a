"""Activation checkpointing from outside the model: bitwise-neutral, and it keeps what its policy says.

Every policy must give exactly (bit for bit, CPU fp32) the loss, every gradient and the QB
statistics of the same step without checkpointing: the recompute runs the same ops on the same
inputs, and the balancers count each token once. The tiny model covers KDA and MLA layers, dense
and MoE FFNs, the MTP layer and packed documents; AttnRes in block and full modes.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.metrics.saved_activations import measure_saved_activations
from moe_lc.model.init import build_model
from moe_lc.ops.documents import DocumentBounds
from moe_lc.parallel.activation_checkpointing import (
    ActivationCheckpointing,
    CheckpointMode,
    activation_checkpointing_of,
    apply_activation_checkpointing,
)
from moe_lc.presets import get_preset

T = 64
BOUNDS = [0, 20, 45, T]  # three packed documents (KDA chunks are 64 tokens: one chunk split three ways)


def tiny(attn_res: str) -> ModelConfig:
    cfg = get_preset("tiny")
    cfg.attn_res.mode = attn_res
    cfg.mtp = True
    cfg.kda.backend = "torch"
    return cfg.validate()


def batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    return ids, labels, DocumentBounds.from_host(BOUNDS, "cpu")


def train_step(cfg: ModelConfig, policy: ActivationCheckpointing) -> dict:
    """Loss, gradients, the balancers' step statistics and their next biases after one step."""
    model = build_model(cfg, "cpu", seed=0)
    apply_activation_checkpointing(model, policy)
    model.train()
    ids, labels, docs = batch(cfg)
    out = model(ids, labels=labels, docs=docs, return_logits=False)
    out.loss.backward()
    loads = torch.stack([m.balancer.step_loads.clone() for m in model.moe_layers()])
    counts = torch.stack([m.balancer.histogram.counts.clone() for m in model.moe_layers()])
    for m in model.moe_layers():
        m.balancer.update()
    return dict(
        loss=out.loss.detach(),
        grads={n: p.grad for n, p in model.named_parameters()},
        loads=loads,
        counts=counts,
        biases=torch.stack([m.balancer.bias for m in model.moe_layers()]),
    )


POLICIES = [
    ActivationCheckpointing("selective"),
    ActivationCheckpointing("full"),
    ActivationCheckpointing("selective", every=2),
    ActivationCheckpointing("full", every=3),
    ActivationCheckpointing("selective", offload=True),
    ActivationCheckpointing("none", offload=True),
]


@pytest.mark.parametrize("attn_res", ["block", "full"])
def test_every_policy_gives_the_same_step_bit_for_bit(attn_res):
    cfg = tiny(attn_res)
    ref = train_step(cfg, ActivationCheckpointing())
    for policy in POLICIES:
        got = train_step(cfg, policy)
        what = f"{policy.describe()} (attn_res {attn_res})"
        assert torch.equal(got["loss"], ref["loss"]), f"{what}: loss {got['loss']} vs {ref['loss']}"
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert torch.equal(got["grads"][name], g), f"{what}: gradient of {name} differs"
        assert torch.equal(got["loads"], ref["loads"]), f"{what}: the recompute counted tokens again"
        assert torch.equal(got["counts"], ref["counts"]), f"{what}: QB histograms differ"
        assert torch.equal(got["biases"], ref["biases"]), f"{what}: next biases differ"


def stored_by_layer(cfg: ModelConfig, policy: ActivationCheckpointing) -> dict[str, float]:
    model = build_model(cfg, "cpu", seed=0)
    apply_activation_checkpointing(model, policy)
    model.train()
    ids, labels, docs = batch(cfg)
    saved = measure_saved_activations(model, ids, labels, docs)
    return {k: saved.per_token(k) for k in saved.bytes_by_layer}


def test_policies_keep_less_and_full_keeps_only_the_stream():
    cfg = tiny("block")
    none, selective, full = (stored_by_layer(cfg, ActivationCheckpointing(m)) for m in CheckpointMode)
    d = cfg.d_model
    for layer in [k for k in none if k != "other"]:
        assert full[layer] < selective[layer] < none[layer], layer
        assert full[layer] == 4 * d, f"{layer}: full keeps one fp32 stream tensor per token, got {full[layer]} B"
    every2 = stored_by_layer(cfg, ActivationCheckpointing("full", every=2))
    assert [every2[f"layer{i}"] == full[f"layer{i}"] for i in range(cfg.num_layers)] == [False, True, False, True, False]
    assert every2["mtp"] == full["mtp"]  # the MTP layer counts as layer num_layers = 5: the 6th


def test_policy_changes_in_place_and_leaves_the_parameters_alone():
    cfg = tiny("block")
    model = build_model(cfg, "cpu", seed=0)
    names = list(model.state_dict())
    apply_activation_checkpointing(model, ActivationCheckpointing("selective", every=2))
    assert list(model.state_dict()) == names
    assert activation_checkpointing_of(model) == ActivationCheckpointing("selective", every=2)
    apply_activation_checkpointing(model, ActivationCheckpointing())
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    assert all("recurrence" not in m.__dict__ for m in model.modules())
    model.eval()  # and without autograd a checkpointed layer just runs
    ids, labels, docs = batch(cfg)
    with torch.no_grad():
        plain = model(ids, docs=docs).logits
        apply_activation_checkpointing(model, ActivationCheckpointing("full"))
        assert torch.equal(model(ids, docs=docs).logits, plain)


def test_the_kda_states_and_prep_settings_reach_every_kda_layer_and_are_undone_with_the_policy():
    from moe_lc.model.kda import KDAttention

    cfg = tiny("block")
    model = build_model(cfg, "cpu", seed=0)
    kda = [m for m in model.modules() if isinstance(m, KDAttention)]
    assert kda and not any(m.keep_states or m.keep_prep for m in kda)
    apply_activation_checkpointing(model, ActivationCheckpointing("full", every=2, kda_states=True))
    assert all(m.keep_states and not m.keep_prep for m in kda)
    assert "kda states" in activation_checkpointing_of(model).describe()
    apply_activation_checkpointing(model, ActivationCheckpointing(kda_prep=True))
    assert all(m.keep_prep and not m.keep_states for m in kda)
    assert "kda prep" in activation_checkpointing_of(model).describe()
    apply_activation_checkpointing(model, ActivationCheckpointing())
    assert not any(m.keep_states or m.keep_prep for m in kda)


def test_bad_policies_name_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="activation_checkpointing.mode='partial': use one of none, selective, full"):
        ActivationCheckpointing("partial")
    with pytest.raises(ConfigError, match="activation_checkpointing.every=0 must be a positive integer"):
        ActivationCheckpointing("full", every=0).check()
    with pytest.raises(ConfigError, match="offload with mode full and every 1 moves nothing"):
        ActivationCheckpointing("full", offload=True).check()
    with pytest.raises(ConfigError, match="activation_checkpointing.kda_states='yes' must be true or false"):
        ActivationCheckpointing(kda_states="yes").check()
    with pytest.raises(ConfigError, match="activation_checkpointing.kda_prep=1 must be true or false"):
        ActivationCheckpointing(kda_prep=1).check()
