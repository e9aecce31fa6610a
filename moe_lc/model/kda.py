"""The KDA token mixer (docs/design.md §2): gated delta-rule linear attention with per-channel decay.

    q, k = L2Norm(SiLU(ShortConv(W x)))   v = SiLU(ShortConv(W_v x))   beta = sigmoid(W_beta x)
    (L2Norm(x) = x / sqrt(|x|^2 + 1e-6); norm, gate and sigmoid are fused into the KDA kernels)
    z = W_up W_down x                      g = gate(z + b)   (bounded: g_min * sigmoid(e^A (z + b)))
    o = KDA(q, k, v, g, beta)              y = W_o [ sigmoid(W_g x) * RMSNorm_head(o) ]
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from moe_lc.config import KDAConfig
from moe_lc.model.norm import GatedRMSNorm
from moe_lc.model.short_conv import ShortConv
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.grouped_experts import autocast_operands
from moe_lc.ops.kda_projections import chunk_kda_from_projections
from moe_lc.ops.short_conv import short_conv_pieces
from moe_lc.ops.stacked_linear import stackable, stacked_linear


class KDAttention(nn.Module):
    def __init__(self, d_model: int, cfg: KDAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        H, K = cfg.num_heads, cfg.head_dim
        inner = H * K
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.q_conv = ShortConv(inner, cfg.conv_size)
        self.k_conv = ShortConv(inner, cfg.conv_size)
        self.v_conv = ShortConv(inner, cfg.conv_size)
        self.beta_proj = nn.Linear(d_model, H, bias=False)
        rank = cfg.decay_rank or K
        self.decay_down = nn.Linear(d_model, rank, bias=False)
        self.decay_up = nn.Linear(rank, inner, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(inner))  # b: per head and channel
        self.A_log = nn.Parameter(torch.empty(H))  # A_h: per head, starts at 0
        if cfg.output_gate == "full":
            self.gate_proj = nn.Sequential(nn.Linear(d_model, inner, bias=False))
        else:
            r = cfg.output_gate_rank or K
            self.gate_proj = nn.Sequential(nn.Linear(d_model, r, bias=False), nn.Linear(r, inner, bias=False))
        self.o_norm = GatedRMSNorm(K, norm_eps, backend=cfg.gate_backend)  # sigmoid(W_g x) * RMSNorm_head(o)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        # what the recurrence keeps for backward: set from outside by the activation checkpointing
        # policy (``kda_states``, ``kda_prep``), as a memory trade, not part of the model's math
        self.keep_states = False
        self.keep_prep = False
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """A = 0; decay bias so that initial per-step decays -g span [dt_min, dt_max] log-uniformly.

        softplus gate: b = softplus^-1(dt); bounded gate: b = logit(dt / |g_min|), the matching
        inverse, so that at z = 0 both gates start from the same retention time scales.
        """
        nn.init.zeros_(self.A_log)
        if self.dt_bias.is_meta:
            return
        u = torch.rand(self.dt_bias.shape, device=self.dt_bias.device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        if self.cfg.gate == "softplus":
            b = dt + torch.log(-torch.expm1(-dt))
        else:
            p = dt / abs(self.cfg.g_min)
            b = torch.log(p) - torch.log1p(-p)
        self.dt_bias.copy_(b.to(self.dt_bias.dtype))

    def conv_backend(self) -> str:
        """The short convolutions' backend: the reference with ``backend="torch"``, else the fastest."""
        return "torch" if self.cfg.backend == "torch" else "auto"

    def forward(self, x: torch.Tensor, docs: Optional[DocumentBounds] = None) -> torch.Tensor:
        B, T, _ = x.shape
        K = self.cfg.head_dim  # heads are read from the shapes (-1): tensor parallelism holds H/tp of them
        (q, k, v), (beta_logits, decay_low, gate_low) = self.projections(x, docs)
        q, k, v = (t.view(B, T, -1, K) for t in (q, k, v))
        z = self.decay_up(decay_low).view(B, T, -1, K)
        gate_logits = (self.gate_proj[1](gate_low) if len(self.gate_proj) > 1 else gate_low).view(B, T, -1, K)
        o = self.o_norm(self.recurrence(q, k, v, z, beta_logits, docs), gate_logits)
        return self.o_proj(o.reshape(B, T, -1))

    def projections(
        self, x: torch.Tensor, docs: Optional[DocumentBounds]
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Everything the layer computes from x: SiLU(ShortConv(W x)) for q, k and v [B, T, H*K], and
        the beta logits, the decay's and the output gate's first projections.

        With ``fused_projections`` the six projections are two GEMMs: one over q, k, v's stacked
        weights, whose output the convolution takes as it is (it is per channel, so one convolution
        over the stacked channels is the same math), and one over the three small ones; x is cast to
        autocast's dtype once instead of once per projection (and kept once for backward), and its
        gradient is two GEMMs' sum instead of six. A group fuses only where its weights are plain
        (``stackable``): float8 linears and tensor parallelism's shards keep their own calls.
        """
        conv = dict(activation="silu", backend=self.conv_backend())  # one fused kernel with SiLU on GPUs
        qkv = ((self.q_proj, self.q_conv), (self.k_proj, self.k_conv), (self.v_proj, self.v_conv))
        small = (self.beta_proj, self.decay_down, self.gate_proj[0])
        fuse_qkv = self.cfg.fused_projections and all(stackable(m, (nn.Linear, ShortConv)) for pair in qkv for m in pair)
        fuse_small = self.cfg.fused_projections and all(stackable(m) for m in small)
        if fuse_qkv or fuse_small:
            x, = autocast_operands(x)  # once, not once per projection
        if fuse_qkv:
            stacked = stacked_linear(x, [p.weight for p, _ in qkv])
            q, k, v = short_conv_pieces(stacked, torch.cat([c.weight for _, c in qkv]), 3, docs, **conv)
        else:
            q, k, v = (c(p(x), docs, **conv) for p, c in qkv)
        if fuse_small:
            rest = stacked_linear(x, [p.weight for p in small])
            return (q, k, v), tuple(rest.split([p.out_features for p in small], dim=-1))
        return (q, k, v), tuple(p(x) for p in small)

    def recurrence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor, beta_logits: torch.Tensor,
        docs: Optional[DocumentBounds],
    ) -> torch.Tensor:
        """o = KDA(L2Norm(q), L2Norm(k), v, gate(z + b), sigmoid(beta_logits)): the layer's one expensive
        op, a method of its own so that selective activation checkpointing can keep its result."""
        # the gate's floor is static (g_min; none for softplus), handed down so no kernel reads g to learn it
        lower = self.cfg.g_min if self.cfg.gate == "bounded" else None
        # L2 norm of q and k, the gate and beta's sigmoid run inside the kernels where they can
        o, _ = chunk_kda_from_projections(q, k, v, z, beta_logits, self.A_log, self.dt_bias, lower_bound=lower,
                                          docs=docs, backend=self.cfg.backend, keep_states=self.keep_states,
                                          keep_prep=self.keep_prep)
        return o

