"""Optimizers (docs/design.md §7.6): AdamW, Muon with per-head blocks, the cosine schedule and gradient clipping."""

from moe_lc.optim.build import build_optimizer
from moe_lc.optim.clip import clip_divisor, clip_grad_norm
from moe_lc.optim.config import OptimConfig
from moe_lc.optim.groups import ParamRole, muon_param_groups, param_groups, parameter_roles
from moe_lc.optim.muon import Muon, muon_direction
from moe_lc.optim.newton_schulz import newton_schulz, orthogonalized_update, rms_matching_scale
from moe_lc.optim.schedule import apply_lr, lr_at, warmup_steps

__all__ = [
    "Muon",
    "OptimConfig",
    "ParamRole",
    "apply_lr",
    "build_optimizer",
    "clip_divisor",
    "clip_grad_norm",
    "lr_at",
    "muon_direction",
    "muon_param_groups",
    "newton_schulz",
    "orthogonalized_update",
    "param_groups",
    "parameter_roles",
    "rms_matching_scale",
    "warmup_steps",
]
