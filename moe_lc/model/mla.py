"""Gated multi-head latent attention with no positional encoding (docs/design.md §3).

    c_q = RMSNorm(W_dq x)         q = W_uq c_q            (or q = W_q x without q_lora_rank)
    c_kv = RMSNorm(W_dkv x)       [k_nope, v] = W_ukv c_kv
    k_shared = W_ks x             (the "rope" slot of DeepSeek MLA; never rotated, one per token,
                                   broadcast to every head)
    o = softmax(q k^T / sqrt(d_nope + d_shared)) v   causal, within each document
    y = W_o [ sigmoid(W_g x) * o ]

Keys and values come from c_kv and k_shared of every token of the row (``keys_of_row``): this
layer's own tokens, or under context parallelism all ranks' (moe_lc.parallel.context_mla).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_lc.config import MLAConfig
from moe_lc.model.norm import RMSNorm
from moe_lc.ops.attention import causal_document_attention, keys_of_row
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.mla_keys import mla_keys
from moe_lc.ops.output_gate import gated_output
from moe_lc.ops.stacked_linear import stackable, stacked_linear


class GatedMLA(nn.Module):
    def __init__(self, d_model: int, cfg: MLAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.num_heads
        if cfg.q_lora_rank is not None:
            self.q_down = nn.Linear(d_model, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, H * cfg.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, H * cfg.qk_dim, bias=False)
        self.kv_down = nn.Linear(d_model, cfg.kv_lora_rank, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, norm_eps)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_dim), bias=False)
        self.k_shared = nn.Linear(d_model, cfg.qk_rope_dim, bias=False) if cfg.qk_rope_dim > 0 else None
        self.gate_proj = nn.Linear(d_model, H * cfg.v_dim, bias=False) if cfg.gate else None
        self.o_proj = nn.Linear(H * cfg.v_dim, d_model, bias=False)
        self.scale = cfg.qk_dim**-0.5

    def x_projections(self) -> list[nn.Linear]:
        """The linears that read x, in the order ``projections`` returns their outputs."""
        first_q = self.q_down if self.cfg.q_lora_rank is not None else self.q_proj
        return [m for m in (self.kv_down, self.k_shared, first_q, self.gate_proj) if m is not None]

    def projections(self, x: torch.Tensor) -> list[Optional[torch.Tensor]]:
        """[W_dkv x, W_ks x, W_dq x (or W_q x), W_g x], None where the layer has no such projection.

        With ``fused_projections`` and plain weights (``stackable``) they are one GEMM over the stacked
        weights, split by columns: x is cast to autocast's dtype and kept for backward once instead of
        four times, and dx is one GEMM instead of four and their sum (docs/design.md §3)."""
        linears = self.x_projections()
        fused = self.cfg.fused_projections and all(stackable(m) for m in linears)
        if fused:
            outputs = list(stacked_linear(x, [m.weight for m in linears]).split([m.out_features for m in linears], -1))
        else:
            outputs = [m(x) for m in linears]
        kv_low = outputs.pop(0)
        shared = outputs.pop(0) if self.k_shared is not None else None
        q_in = outputs.pop(0)
        gate = outputs.pop(0) if self.gate_proj is not None else None
        if fused:  # the two that backward keeps (their norms', or attention's, input) as tensors of their own:
            # a column view would keep the whole stacked output, the gate's H v columns included, alive
            kv_low, q_in = kv_low.contiguous(), q_in.contiguous()
        return [kv_low, shared, q_in, gate]

    def forward(self, x: torch.Tensor, docs: Optional[DocumentBounds] = None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        kv_low, shared, q_in, gate_logits = self.projections(x)
        latents = [self.kv_norm(kv_low)] + ([shared] if shared is not None else [])
        row = keys_of_row(latents, docs)  # started before the queries' up-projection, so that a gather overlaps it
        q = self.q_up(self.q_norm(q_in)) if c.q_lora_rank is not None else q_in
        q = q.view(B, T, -1, c.qk_dim)  # heads from the shape: H/tp under tensor parallelism
        H = q.shape[2]
        c_kv, *shared_key = row.wait()  # [B, S, r] (S = T, or the whole row's length under context parallelism)
        S = c_kv.shape[1]
        kv = self.kv_up(c_kv).view(B, S, H, c.qk_nope_dim + c.v_dim)
        if shared_key:  # k = [k_nope, the shared key] per head
            k, v = mla_keys(kv, shared_key[0], c.qk_nope_dim, c.keys_backend)
        else:
            k, v = kv.split([c.qk_nope_dim, c.v_dim], dim=-1)
        # one call for all documents; the mask is built once per batch and shared by the MLA layers
        o = causal_document_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale,
            mask=docs.attention_mask if docs is not None else None,
        ).transpose(1, 2)  # [B, T, H, v_dim]
        o = o.reshape(B, T, H * c.v_dim)
        if gate_logits is not None:
            o = gated_output(o, gate_logits, backend=c.gate_backend)
        return self.o_proj(o)
