"""Build the optimizer a run asks for."""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.optim.config import OptimConfig
from moe_lc.optim.groups import muon_param_groups, param_groups
from moe_lc.optim.muon import Muon


def _resolve_fused(model: nn.Module, requested: bool | None) -> bool:
    on_cuda = all(p.is_cuda for p in model.parameters())
    if requested and not on_cuda:
        raise ValueError("optim.fused=true needs every parameter on CUDA; set optim.fused=null (auto) or false")
    return on_cuda if requested is None else requested


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over `param_groups`, or Muon (+ AdamW inside) over `muon_param_groups`.

    Group lr starts at cfg.lr; the trainer sets it every step with `apply_lr`.
    """
    cfg.validate()
    fused = _resolve_fused(model, cfg.fused)
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None
        )
    return Muon(
        muon_param_groups(model, per_head=cfg.muon_per_head, weight_decay=cfg.weight_decay),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=fused,
    )
