"""Typed model configuration.

Plain dataclasses so that Hydra can compose them (structured configs) and so that the
parameter/FLOP accounting can read a config without building a model. Every field has
one meaning; `ModelConfig.validate()` rejects impossible combinations with a message
that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration that cannot be built. The message names the field and the fix."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/design.md §2)."""

    num_heads: int = 2
    head_dim: int = 128
    gate: str = "bounded"  # "bounded": g = g_min*sigmoid(e^A z); "softplus": g = -e^A softplus(z)
    g_min: float = -5.0
    decay_rank: Optional[int] = None  # low rank of the decay logit projection; None = head_dim
    output_gate: str = "full"  # "full" or "low_rank" (Kimi Linear)
    output_gate_rank: Optional[int] = None  # for low_rank; None = head_dim
    conv_size: int = 4
    backend: str = "auto"  # chunked-op backend: auto | torch | triton | fla
    gate_backend: str = "auto"  # the gated output norm: auto (Triton on CUDA) | torch | triton (moe_lc.ops.output_gate)
    # the six projections of x as two GEMMs (q, k, v stacked, and beta, decay and gate stacked) and
    # q, k, v's short convolutions as one (depthwise: the same math over the stacked channels): fewer
    # launches for a layer that is host-bound at 8K on an H200 (docs/performance.md §12.3); plain
    # weights only (not tp's DTensors, not float8 linears, which keep six projections)
    fused_projections: bool = True

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass
class MLAConfig:
    """Gated multi-head latent attention without positional encoding (docs/design.md §3)."""

    num_heads: int = 2
    q_lora_rank: Optional[int] = None  # None: q projected directly from x
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64  # the shared-key part; kept for layout compatibility, never rotated
    v_dim: int = 128
    gate: bool = True  # sigmoid output gate (Gated Attention)
    gate_backend: str = "auto"  # that gate: auto (Triton on CUDA) | torch | triton (moe_lc.ops.output_gate)
    # the projections that read x (W_dkv, the shared key, W_dq or W_q, the gate) as one GEMM over their
    # stacked weights: x cast and kept once, dx one GEMM instead of four and their sums. Plain weights
    # only (not tp's DTensors, not float8 linears, which keep their own calls)
    fused_projections: bool = True
    # the keys [k_nope, shared key] per head and v from the up-projected latent: auto (Triton on CUDA) |
    # torch | triton (moe_lc.ops.mla_keys)
    keys_backend: str = "auto"

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim


@dataclass
class AttnResConfig:
    """Attention residuals across depth (docs/design.md §4)."""

    mode: str = "block"  # none | block | full
    block_size: int = 12  # decoder layers per block (mode=block)
    backend: str = "auto"  # the depth mixture: auto (Triton on CUDA) | torch | triton (moe_lc.ops.depth_mixture)
    # The sublayers' pre-norms applied by the mixture's Triton kernels (h never stored; on an H100 the
    # same step with ~2% less memory, docs/performance.md §12.16); where the mixture runs its PyTorch
    # reference, or its parameters are DTensors, the norm runs on its own.
    fused_norm: bool = True


@dataclass
class MoEConfig:
    """Stable LatentMoE channel mixing (docs/design.md §5)."""

    num_routed: int = 8
    top_k: int = 2
    num_shared: int = 1
    latent_dim: Optional[int] = None  # None: experts work at full width (plain MoE)
    expert_hidden: int = 64
    dense_hidden: int = 128  # hidden width of the dense FFN in the first layers
    first_dense_layers: int = 1
    activation: str = "situ"  # situ | swiglu
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0
    routing_scale: float = 1.0
    balancing: str = "qb"  # qb | sign | aux | none
    qb_bins: int = 1024  # histogram bins of the QB estimator (docs/design.md §6.2)
    qb_exact: bool = False  # exact quantile instead of the histogram (single process only)
    qb_ema: float = 0.0  # 0 = no EMA over steps
    sign_rate: float = 1e-3  # sign-update step size
    aux_loss_coef: float = 1e-3
    # The router, the latent down-projection and the shared experts' gate and input projections all
    # read x: one GEMM over their stacked weights (x cast and kept once, dx one GEMM instead of four
    # and their sums). Plain weights only (not tp's DTensors, not float8 linears).
    fused_projections: bool = True
    # the token permutation around the experts (moe_lc.ops.token_permutation): auto | torch | triton
    dispatch_backend: str = "auto"
    # the router's selection, weights and balancing statistics (moe_lc.ops.routing) and the sort by
    # expert (token_permutation.expert_order): torch | auto | triton. torch: the fused kernels were
    # no faster in a whole step on the GPU (docs/performance.md §12.10)
    router_backend: str = "torch"
    # the routed experts' weight gradients (one process, bf16 step copies of fp32 weights): torch
    # (autograd's bf16 product added into .grad) | triton (summed into .grad by the GEMM,
    # moe_lc_kernels.grouped_wgrad) | auto (torch: that GEMM is slower than CUTLASS's, §12.20)
    wgrad_backend: str = "auto"


@dataclass
class ModelConfig:
    """The whole hybrid KDA/MLA LatentMoE language model."""

    name: str = "custom"
    d_model: int = 64
    num_layers: int = 5
    vocab_size: int = 512
    vocab_multiple: int = 128  # embedding rows are padded to a multiple of this (TP-friendly)
    layer_pattern: Optional[str] = None  # e.g. "KKKMM"; None = 3:1 groups closed by one MLA
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    attn_res: AttnResConfig = field(default_factory=AttnResConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mtp: bool = False  # one multi-token-prediction layer
    # Under autocast the token embedding enters the residual stream in autocast's dtype, like every
    # sublayer's output; true keeps it in the weights' dtype (fp32), which makes every AttnRes
    # mixture fp32 and every sublayer input one more cast (docs/design.md, "Precision").
    fp32_embedding: bool = False
    # The training loss computes its gradients chunk by chunk in the forward where the head is plain
    # (docs/design.md §7.1); false: checkpointed chunks whose logits are recomputed in backward.
    fused_loss: bool = True
    # The fused loss's elementwise part (softmax and gradient of each chunk's logits): auto (triton on
    # CUDA, eager elsewhere), torch, compiled or triton (moe_lc.ops.linear_cross_entropy).
    loss_backend: str = "auto"
    norm_eps: float = 1e-6
    init_std: float = 0.02

    # -- derived ------------------------------------------------------------------
    @property
    def pattern(self) -> str:
        """One letter per decoder layer: K = KDA, M = Gated MLA."""
        if self.layer_pattern is not None:
            return self.layer_pattern
        return default_layer_pattern(self.num_layers)

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def is_dense_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` (0-based) uses the dense FFN instead of MoE."""
        return layer_idx < self.moe.first_dense_layers

    # -- validation ----------------------------------------------------------------
    def validate(self) -> "ModelConfig":
        _require(self.d_model > 0, f"d_model={self.d_model} must be positive")
        _require(self.num_layers > 0, f"num_layers={self.num_layers} must be positive")
        _require(self.vocab_size > 0, f"vocab_size={self.vocab_size} must be positive")
        _require(self.vocab_multiple > 0, f"vocab_multiple={self.vocab_multiple} must be positive")
        p = self.pattern
        _require(
            len(p) == self.num_layers,
            f"layer_pattern has {len(p)} letters but num_layers={self.num_layers}; "
            "give one letter per layer or set layer_pattern=null for the default 3:1 pattern",
        )
        _require(set(p) <= {"K", "M"}, f"layer_pattern={p!r} may only contain 'K' (KDA) and 'M' (MLA)")
        _require(p[-1] == "M", f"layer_pattern={p!r} must end with 'M': the last layer is global attention")

        k = self.kda
        if "K" in p:
            _require(k.num_heads > 0 and k.head_dim > 0, "kda.num_heads and kda.head_dim must be positive")
            _require(k.gate in ("bounded", "softplus"), f"kda.gate={k.gate!r}: use 'bounded' or 'softplus'")
            _require(k.g_min < 0, f"kda.g_min={k.g_min} must be negative (it is the lower bound of log-decay)")
            _require(
                k.output_gate in ("full", "low_rank"), f"kda.output_gate={k.output_gate!r}: use 'full' or 'low_rank'"
            )
            _require(k.conv_size >= 1, f"kda.conv_size={k.conv_size} must be >= 1")
            _require(
                k.backend in ("auto", "torch", "triton", "fla"),
                f"kda.backend={k.backend!r}: use auto, torch, triton or fla",
            )
            for name in ("decay_rank", "output_gate_rank"):
                v = getattr(k, name)
                _require(v is None or v > 0, f"kda.{name}={v} must be positive or null")

        m = self.mla
        _require(m.num_heads > 0, f"mla.num_heads={m.num_heads} must be positive")
        _require(m.kv_lora_rank > 0, f"mla.kv_lora_rank={m.kv_lora_rank} must be positive")
        _require(
            m.q_lora_rank is None or m.q_lora_rank > 0,
            f"mla.q_lora_rank={m.q_lora_rank} must be positive, or null to project q directly",
        )
        _require(m.qk_nope_dim > 0, f"mla.qk_nope_dim={m.qk_nope_dim} must be positive")
        _require(m.qk_rope_dim >= 0, f"mla.qk_rope_dim={m.qk_rope_dim} must be >= 0")
        _require(m.v_dim > 0, f"mla.v_dim={m.v_dim} must be positive")
        _require(self.loss_backend in ("auto", "torch", "compiled", "triton"),
                 f"loss_backend={self.loss_backend!r}: use auto, torch, compiled or triton")
        _require(m.keys_backend in ("auto", "torch", "triton"),
                 f"mla.keys_backend={m.keys_backend!r}: use auto, torch or triton")
        _require(m.gate_backend in ("auto", "torch", "triton"),
                 f"mla.gate_backend={m.gate_backend!r}: use auto, torch or triton")
        _require(k.gate_backend in ("auto", "torch", "triton"),
                 f"kda.gate_backend={k.gate_backend!r}: use auto, torch or triton")

        a = self.attn_res
        _require(a.mode in ("none", "block", "full"), f"attn_res.mode={a.mode!r}: use none, block or full")
        _require(a.block_size > 0, f"attn_res.block_size={a.block_size} must be >= 1 decoder layer")
        _require(a.backend in ("auto", "torch", "triton"), f"attn_res.backend={a.backend!r}: use auto, torch or triton")

        e = self.moe
        _require(e.num_routed > 0, f"moe.num_routed={e.num_routed} must be positive")
        _require(
            0 < e.top_k < e.num_routed,
            f"moe.top_k={e.top_k} must be in [1, num_routed-1={e.num_routed - 1}] "
            "(quantile balancing routes with top-(k+1))",
        )
        _require(e.num_shared >= 0, f"moe.num_shared={e.num_shared} must be >= 0")
        _require(e.expert_hidden > 0, f"moe.expert_hidden={e.expert_hidden} must be positive")
        _require(
            e.latent_dim is None or 0 < e.latent_dim <= self.d_model,
            f"moe.latent_dim={e.latent_dim} must be in (0, d_model={self.d_model}], or null for no latent space",
        )
        _require(
            0 <= e.first_dense_layers < self.num_layers,
            f"moe.first_dense_layers={e.first_dense_layers} must be in [0, num_layers-1]",
        )
        _require(e.first_dense_layers == 0 or e.dense_hidden > 0, "moe.dense_hidden must be positive")
        _require(e.activation in ("situ", "swiglu"), f"moe.activation={e.activation!r}: use situ or swiglu")
        _require(
            e.situ_beta1 > 0 and e.situ_beta2 > 0,
            f"moe.situ_beta1={e.situ_beta1}, situ_beta2={e.situ_beta2} must be positive",
        )
        _require(
            e.balancing in ("qb", "sign", "aux", "none"), f"moe.balancing={e.balancing!r}: use qb, sign, aux or none"
        )
        _require(
            e.dispatch_backend in ("auto", "torch", "triton"),
            f"moe.dispatch_backend={e.dispatch_backend!r}: use auto, torch or triton",
        )
        _require(
            e.wgrad_backend in ("auto", "torch", "triton"),
            f"moe.wgrad_backend={e.wgrad_backend!r}: use auto, torch or triton",
        )
        _require(
            e.router_backend in ("auto", "torch", "triton"),
            f"moe.router_backend={e.router_backend!r}: use auto, torch or triton",
        )
        _require(
            e.router_backend != "triton" or (e.balancing != "aux" and not (e.balancing == "qb" and e.qb_exact)),
            f"moe.router_backend=triton keeps the loads and QB's histogram, not balancing={e.balancing!r}"
            f"{' with qb_exact' if e.qb_exact else ''}: use router_backend=torch (or auto) for it",
        )
        _require(e.qb_bins >= 16, f"moe.qb_bins={e.qb_bins} is too few; use ~1000")
        _require(0.0 <= e.qb_ema < 1.0, f"moe.qb_ema={e.qb_ema} must be in [0, 1)")
        return self

    # -- (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _from_dict(cls, d)


def default_layer_pattern(num_layers: int) -> str:
    """Groups of KDA, KDA, KDA, MLA; the last layer is always MLA (docs/design.md §1.1)."""
    letters = ["M" if (i + 1) % 4 == 0 else "K" for i in range(num_layers)]
    letters[-1] = "M"
    return "".join(letters)


def _from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Build a (nested) dataclass from a mapping; unknown keys are an error naming them."""
    if d is None:
        return cls()
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(names)
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} for {cls.__name__}; known: {sorted(names)}")
    kwargs = {}
    for key, value in d.items():
        f = names[key]
        sub = _NESTED.get((cls.__name__, key))
        kwargs[key] = _from_dict(sub, value) if sub is not None and value is not None else value
    return cls(**kwargs)


_NESTED = {
    ("ModelConfig", "kda"): KDAConfig,
    ("ModelConfig", "mla"): MLAConfig,
    ("ModelConfig", "attn_res"): AttnResConfig,
    ("ModelConfig", "moe"): MoEConfig,
}
