"""Parameter accounting: config-only counts vs meta-device builds, and the published sizes."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import configs
from moe_lc.cli import main as cli_main
from moe_lc.model.accounting import (
    FLOP_KINDS,
    count_parameters,
    head_training_flops,
    layer_training_flops_by_kind,
    matmul_parameters,
    mixing_flops_per_layer,
    mtp_training_flops,
    mtp_training_flops_by_kind,
    training_flops_per_token,
)
from moe_lc.model.init import build_model
from moe_lc.model.moe import RoutedExperts
from moe_lc.presets import PRESETS, get_preset


def _active_from_model(model) -> int:
    """Independent active count: walk the built model, scale routed experts by k/n."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed.") or name.startswith("mtp."):
            continue
        total += p.numel()
    for mod in model.layers.modules():
        if isinstance(mod, RoutedExperts):
            n = sum(p.numel() for p in mod.parameters())
            total -= n - n * cfg.moe.top_k // cfg.moe.num_routed
    return total


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_count_equals_meta_build(preset):
    cfg = get_preset(preset)
    model = build_model(cfg, device="meta")
    rep = count_parameters(cfg)
    assert rep.total == sum(p.numel() for p in model.parameters())
    assert rep.active == _active_from_model(model)


@pytest.mark.parametrize(
    "preset, total, active, tol_active",
    [
        ("k3", 2.78e12, 104.2e9, 0.03),
        # Kimi Linear's "3B activated" is a rounded figure; the exact count of its published
        # shapes (head included, embedding table excluded) is 3.107B, 3.6% above it.
        ("kimi-linear-48b", 48e9, 3e9, 0.04),
    ],
)
def test_published_sizes(preset, total, active, tol_active):
    rep = count_parameters(get_preset(preset))
    assert abs(rep.total / total - 1) < 0.03, rep.total
    assert abs(rep.active / active - 1) < tol_active, rep.active


def test_training_flops_follow_six_n_plus_attention():
    cfg = get_preset("k3")
    rep = count_parameters(cfg)
    short = training_flops_per_token(cfg, 4096)
    assert 6 * rep.active * 0.95 < short < 6 * rep.active * 1.3  # at 4K the matmuls dominate


def counted_flops(cfg, seq_len: int) -> tuple[int, int]:
    """(matmul FLOPs, MLA attention FLOPs) that FlopCounterMode counts in one real forward + backward of
    the model on one sequence (float64 on CPU; the math SDPA kernel runs attention as the batched matmuls
    QK^T and AV over all T x T pairs, masked afterwards)."""
    # imported here, not at the top: it imports Triton, which the kernel tests must first import themselves
    # (after setting TRITON_INTERPRET)
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(cfg, seed=0).double()
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(ids, ids).loss.backward()
    counts = counter.get_flop_counts()
    mla = sum(counts[f"MoELCModel.layers.{i}.attn"].get(torch.ops.aten.bmm, 0)
              for i, kind in enumerate(cfg.pattern) if kind == "M")
    return counts["Global"][torch.ops.aten.mm], mla


def counted_per_token(cfg, seq_len: int) -> tuple[float, float]:
    """Counted (matmul, causal MLA) training FLOPs per token: causal softmax needs the T(T+1)/2 pairs
    with key <= query of the T^2 that the math kernel multiplies."""
    mm, mla_full = counted_flops(cfg, seq_len)
    assert mm == 6 * matmul_parameters(cfg) * seq_len  # 6 FLOPs per matmul parameter and token, exactly
    causal_share = torch.ones(seq_len, seq_len).tril().sum().item() / seq_len**2
    return mm / seq_len, mla_full * causal_share / seq_len


@pytest.mark.parametrize("seq_len", [128, 200])
def test_training_flops_of_an_attention_model_are_its_counted_flops(seq_len):
    """Without KDA layers the accounting is exactly what a real forward + backward multiplies."""
    cfg = configs.tiny(layer_pattern="MMMMM", **{"mla.v_dim": 24})  # v as wide as q, k: CPU SDPA pads a narrower v
    matmuls, attention = counted_per_token(cfg, seq_len)
    assert training_flops_per_token(cfg, seq_len) == pytest.approx(matmuls + attention, rel=1e-12)


def test_kda_flops_do_not_grow_with_context():
    """With KDA layers the rest of the accounting (KDA's chunked recurrence, an estimate of the kernels'
    work) is the same at every context length: only attention grows."""
    cfg = configs.tiny(**{"mla.v_dim": 24})
    rest = []
    for seq_len in (128, 256):
        matmuls, attention = counted_per_token(cfg, seq_len)
        rest.append(training_flops_per_token(cfg, seq_len) - matmuls - attention)
    assert rest[0] > 0 and rest[1] == pytest.approx(rest[0], rel=1e-12)


def test_info_cli_json(capsys):
    assert cli_main(["info", "tiny", "--json", "--seq-len", "256"]) == 0
    info = json.loads(capsys.readouterr().out)
    rep = count_parameters(get_preset("tiny"))
    assert info["total_params"] == rep.total and info["active_params"] == rep.active
    assert info["layer_pattern"] == "KKKMM"


def test_info_cli_rejects_unknown_preset(capsys):
    assert cli_main(["info", "k4"]) == 2
    assert "unknown model preset" in capsys.readouterr().err


def test_k3_builds_on_meta_without_memory():
    model = build_model(get_preset("k3"), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert len(model.layers) == 93 and sum(layer.kind == "M" for layer in model.layers) == 24


@pytest.mark.parametrize("preset", ["proxy", "k3"])
def test_flops_by_kind_split_the_model_flops(preset):
    """Per layer: the routed experts' grouped GEMMs are 6 k/n x the built layer's expert parameters, the
    token mixing is attention in MLA layers and the KDA recurrence in KDA layers, the rest dense GEMMs;
    with the head (dense) they add up to the model's FLOPs, and MTP's to its own."""
    cfg = get_preset(preset)
    model = build_model(cfg, device="meta")
    seq, keys = 65536, 5000.0
    total = head_training_flops(cfg)
    for i, layer in enumerate(model.layers):
        flops = layer_training_flops_by_kind(cfg, i, seq, keys)
        assert set(flops) == set(FLOP_KINDS)
        experts = [m for m in layer.modules() if isinstance(m, RoutedExperts)]
        routed = sum(p.numel() for m in experts for p in m.parameters()) * cfg.moe.top_k / cfg.moe.num_routed
        assert flops["grouped_gemm"] == pytest.approx(6 * routed, rel=1e-12) and (routed > 0) == bool(experts)
        mixing = 3 * mixing_flops_per_layer(cfg, seq, keys)[cfg.pattern[i]]
        mixer = "attention" if cfg.pattern[i] == "M" else "kda"
        other = "kda" if mixer == "attention" else "attention"
        assert flops[mixer] == pytest.approx(mixing, rel=1e-12) and flops[other] == 0
        total += sum(flops.values())
    assert total == pytest.approx(training_flops_per_token(cfg, seq, keys), rel=1e-12)
    mtp = mtp_training_flops_by_kind(cfg, seq, keys)
    assert sum(mtp.values()) == pytest.approx(mtp_training_flops(cfg, seq, keys), rel=1e-12)
    assert (mtp["attention"] > 0) == cfg.mtp and mtp["kda"] == 0
