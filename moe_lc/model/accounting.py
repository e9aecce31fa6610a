"""Parameter and FLOP accounting from a config alone (no model is built).

Counts are exact: they are checked against a meta-device build of every preset.
Conventions (also printed by `moe-lc info`):
- total parameters: every trainable parameter, the MTP layer included;
- active parameters: what one token's forward pass multiplies with: all dense weights,
  k routed experts per MoE layer (of n), the LM head, but not the embedding table (a
  lookup, not a matmul) and not the MTP layer (a training-time extra);
- training FLOPs per token: 6 x active matmul parameters (forward + backward) plus the
  sequence-length-dependent token mixing: causal softmax attention over the keys each query
  really sees (attention stops at document ends: a packed row of documents of lengths L_i
  attends to sum_i L_i (L_i + 1) / 2 keys, not T (T + 1) / 2), and the KDA chunked recurrence
  (state read/update per token and the intra-chunk work with chunk C = 64).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from moe_lc.config import ModelConfig

KDA_CHUNK = 64


def _kda_params(cfg: ModelConfig) -> int:
    d, k = cfg.d_model, cfg.kda
    inner = k.num_heads * k.head_dim
    rank = k.decay_rank or k.head_dim
    if k.output_gate == "full":
        gate = d * inner
    else:
        r = k.output_gate_rank or k.head_dim
        gate = d * r + r * inner
    return (
        3 * d * inner  # q, k, v projections
        + 3 * inner * k.conv_size  # short convolutions
        + d * k.num_heads  # beta
        + d * rank + rank * inner + inner  # decay logit (low rank) and its bias b
        + k.num_heads  # A
        + gate
        + k.head_dim  # per-head output RMSNorm
        + inner * d  # output projection
    )


def _mla_params(cfg: ModelConfig) -> int:
    d, m = cfg.d_model, cfg.mla
    H = m.num_heads
    q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_dim if m.q_lora_rank else d * H * m.qk_dim
    kv = d * m.kv_lora_rank + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_dim + m.v_dim)
    return q + kv + d * m.qk_rope_dim + (d * H * m.v_dim if m.gate else 0) + H * m.v_dim * d


def _moe_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(dense part, one routed expert, routed total) of one MoE layer."""
    d, e = cfg.d_model, cfg.moe
    width = e.latent_dim if e.latent_dim is not None else d
    latent = (2 * d * e.latent_dim + e.latent_dim) if e.latent_dim is not None else 0
    shared = 3 * d * e.num_shared * e.expert_hidden
    one_expert = 3 * width * e.expert_hidden
    return d * e.num_routed + latent + shared, one_expert, e.num_routed * one_expert


@dataclass
class ParamReport:
    total: int
    active: int
    by_component: "OrderedDict[str, int]" = field(default_factory=OrderedDict)
    active_by_component: "OrderedDict[str, int]" = field(default_factory=OrderedDict)


def count_parameters(cfg: ModelConfig) -> ParamReport:
    cfg.validate()
    d, V = cfg.d_model, cfg.padded_vocab_size
    attn_res = cfg.attn_res.mode != "none"
    moe_dense, one_expert, routed_total = _moe_params(cfg)
    e = cfg.moe
    comp: "OrderedDict[str, int]" = OrderedDict((k, 0) for k in (
        "embedding", "kda", "mla", "dense_ffn", "moe_shared_and_router", "moe_routed_experts",
        "norms_and_attn_res", "lm_head", "mtp"))
    act = OrderedDict(comp)
    comp["embedding"] = V * d
    comp["lm_head"] = act["lm_head"] = V * d
    norms = d + (2 * d if attn_res else 0)  # final norm, output pseudo-query + its norm
    for i, kind in enumerate(cfg.pattern):
        # two pre-norms; two depth mixers (query + norm), except before the first sublayer (one source)
        norms += 2 * d + ((4 * d if i > 0 else 2 * d) if attn_res else 0)
        if kind == "K":
            comp["kda"] += _kda_params(cfg)
        else:
            comp["mla"] += _mla_params(cfg)
        if cfg.is_dense_layer(i):
            comp["dense_ffn"] += 3 * d * e.dense_hidden
        else:
            comp["moe_shared_and_router"] += moe_dense
            comp["moe_routed_experts"] += routed_total
            act["moe_routed_experts"] += e.top_k * one_expert
    comp["norms_and_attn_res"] = norms
    for key in ("kda", "mla", "dense_ffn", "moe_shared_and_router", "norms_and_attn_res"):
        act[key] = comp[key]
    if cfg.mtp:
        mtp_ffn = 3 * d * e.dense_hidden if cfg.is_dense_layer(cfg.num_layers) else moe_dense + routed_total
        comp["mtp"] = 2 * d + 2 * d * d + _mla_params(cfg) + 2 * d + mtp_ffn + d
    return ParamReport(total=sum(comp.values()), active=sum(act.values()), by_component=comp, active_by_component=act)


def causal_keys_per_token(doc_lengths: Iterable[int]) -> float:
    """Mean number of keys a query attends to under causal attention within documents."""
    lengths = [int(n) for n in doc_lengths if n > 0]
    tokens = sum(lengths)
    if tokens == 0:
        return 0.0
    return sum(n * (n + 1) / 2 for n in lengths) / tokens


def mixing_flops_per_layer(cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None) -> dict[str, float]:
    """Forward FLOPs per token of one layer's token mixing, by layer kind ("K": KDA, "M": MLA).

    keys_per_token as in :func:`mixing_flops_per_token`.
    """
    m, k = cfg.mla, cfg.kda
    avg_keys = (seq_len + 1) / 2 if keys_per_token is None else keys_per_token
    mla = 2 * m.num_heads * (m.qk_dim + m.v_dim) * avg_keys
    K = V = k.head_dim
    c = min(KDA_CHUNK, seq_len)
    # inter-chunk: q.S, k.S (for W S), state update k^T(U - W S): 3 matvec-sized products of K x V
    # intra-chunk (per token, over c/2 earlier tokens on average): QK^T, KK^T, attention x (U - W S)
    # and the triangular solve of the UT transform.
    kda = k.num_heads * (2 * 3 * K * V + 2 * (c / 2) * (2 * K + V) + c * c / 3)
    return {"K": kda, "M": mla}


def mixing_flops_per_token(cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None) -> float:
    """Forward FLOPs per token of the sequence-dependent token mixing (not in the parameter count).

    keys_per_token: mean keys per query (:func:`causal_keys_per_token` of the batch's documents);
    None means one document per sequence, (seq_len + 1) / 2.
    """
    per_layer = mixing_flops_per_layer(cfg, seq_len, keys_per_token)
    return sum(per_layer[kind] for kind in cfg.pattern)


def _elementwise_params(cfg: ModelConfig, kind: str, moe: bool) -> int:
    """Parameters of one decoder layer that scale or shift activations instead of entering a matmul:
    KDA's conv taps, decay bias, A and output norm; MLA's q and kv norms; the latent norm of LatentMoE."""
    k, m = cfg.kda, cfg.mla
    if kind == "K":
        inner = k.num_heads * k.head_dim
        mixer = 3 * inner * k.conv_size + inner + k.num_heads + k.head_dim
    else:
        mixer = (m.q_lora_rank or 0) + m.kv_lora_rank
    latent_norm = (cfg.moe.latent_dim or 0) if moe else 0
    return mixer + latent_norm


def layer_matmul_parameters(cfg: ModelConfig, layer_idx: int) -> int:
    """Active parameters of decoder layer ``layer_idx`` that multiply activations in a matmul (its token
    mixer, its dense FFN or the k routed experts, shared experts, router and latent projections of its
    LatentMoE); ``layer_idx = num_layers`` is the MTP layer (Gated MLA)."""
    kind = cfg.pattern[layer_idx] if layer_idx < cfg.num_layers else "M"
    dense = cfg.is_dense_layer(layer_idx)
    mixer = _kda_params(cfg) if kind == "K" else _mla_params(cfg)
    if dense:
        ffn = 3 * cfg.d_model * cfg.moe.dense_hidden
    else:
        moe_dense, one_expert, _ = _moe_params(cfg)
        ffn = moe_dense + cfg.moe.top_k * one_expert
    return mixer + ffn - _elementwise_params(cfg, kind, not dense)


def matmul_parameters(cfg: ModelConfig) -> int:
    """Active parameters that multiply activations in a matmul: 2 FLOPs per token each, forward. The
    decoder layers' and the LM head's (the embedding is a lookup; MTP is not counted as active)."""
    cfg.validate()
    return sum(layer_matmul_parameters(cfg, i) for i in range(cfg.num_layers)) + cfg.padded_vocab_size * cfg.d_model


# The kinds of work a layer's FLOPs run as, each at its own rate on a GPU (`moe_lc.plan.hardware`):
# dense GEMMs, the routed experts' grouped GEMMs, softmax attention and the KDA recurrence.
FLOP_KINDS = ("dense_gemm", "grouped_gemm", "attention", "kda")


def layer_training_flops_by_kind(cfg: ModelConfig, layer_idx: int, seq_len: int,
                                 keys_per_token: Optional[float] = None) -> dict[str, float]:
    """:func:`layer_training_flops` split by ``FLOP_KINDS`` (the parts sum to it)."""
    kind = cfg.pattern[layer_idx] if layer_idx < cfg.num_layers else "M"
    routed = 0 if cfg.is_dense_layer(layer_idx) else cfg.moe.top_k * _moe_params(cfg)[1]
    mixing = 3.0 * mixing_flops_per_layer(cfg, seq_len, keys_per_token)[kind]
    return {"dense_gemm": 6.0 * (layer_matmul_parameters(cfg, layer_idx) - routed), "grouped_gemm": 6.0 * routed,
            "attention": mixing if kind == "M" else 0.0, "kda": mixing if kind == "K" else 0.0}


def layer_training_flops(cfg: ModelConfig, layer_idx: int, seq_len: int, keys_per_token: Optional[float] = None) -> float:
    """Forward + backward FLOPs per token of decoder layer ``layer_idx`` (``num_layers``: the MTP layer):
    3 x (2 x its matmul parameters + its token mixing)."""
    return sum(layer_training_flops_by_kind(cfg, layer_idx, seq_len, keys_per_token).values())


def head_training_flops(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per token of the LM head (over the padded vocabulary) and its loss."""
    return 3.0 * 2.0 * cfg.padded_vocab_size * cfg.d_model


def mtp_training_flops(cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None) -> float:
    """Forward + backward FLOPs per token of multi-token prediction (0 without it): the projection of
    [hidden; next embedding], its decoder layer and a second pass through the LM head. Not part of
    `training_flops_per_token` (MTP is a training-time extra, like its parameters in the active count)."""
    return sum(mtp_training_flops_by_kind(cfg, seq_len, keys_per_token).values())


def mtp_training_flops_by_kind(cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None) -> dict[str, float]:
    """:func:`mtp_training_flops` split by ``FLOP_KINDS`` (all 0 without MTP)."""
    if not cfg.mtp:
        return dict.fromkeys(FLOP_KINDS, 0.0)
    flops = layer_training_flops_by_kind(cfg, cfg.num_layers, seq_len, keys_per_token)
    flops["dense_gemm"] += 3.0 * 2.0 * (2 * cfg.d_model) * cfg.d_model + head_training_flops(cfg)  # projection, head
    return flops


def training_flops_per_token(cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None) -> float:
    """Forward + backward FLOPs per token: 3 x (2 x active matmul params + token mixing).

    keys_per_token as in :func:`mixing_flops_per_token` (None: one document per sequence).
    """
    return 3.0 * (2.0 * matmul_parameters(cfg) + mixing_flops_per_token(cfg, seq_len, keys_per_token))


def layer_training_flops_per_token(
    cfg: ModelConfig, seq_len: int, keys_per_token: Optional[float] = None
) -> list[float]:
    """:func:`layer_training_flops` of every decoder layer; what is left of the total is the LM head's.

    For placing work on pipeline stages: at long context an MLA layer costs many KDA layers.
    """
    return [layer_training_flops(cfg, i, seq_len, keys_per_token) for i in range(cfg.num_layers)]
