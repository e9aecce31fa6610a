"""Optimizer settings (docs/design.md §7.6): AdamW by default, Muon for hidden matrices, one cosine schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_lc.config import ConfigError

OPTIMIZERS = ("adamw", "muon")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on hidden matrices, AdamW on the rest)
    lr: float = 3e-4  # peak learning rate, shared by both update rules (Muon updates are RMS-matched)
    min_lr: float = 3e-5  # reached at the last step of the curriculum
    weight_decay: float = 0.1  # decoupled; only matrices and embeddings decay (see groups.py)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_per_head: bool = True  # orthogonalise each attention head's block on its own (K3)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    warmup_frac: float = 0.01  # linear warmup over this fraction of all steps (at least one step)
    fused: Optional[bool] = None  # fused AdamW kernel; None = on when every parameter is on CUDA

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # Hydra/OmegaConf hands lists over

    def validate(self) -> "OptimConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.name in OPTIMIZERS, f"optim.name={self.name!r}: use one of {list(OPTIMIZERS)}")
        need(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        need(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must lie in [0, optim.lr={self.lr}]")
        need(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={self.betas} must be two numbers in [0, 1)",
        )
        need(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        need(0 <= self.muon_momentum < 1, f"optim.muon_momentum={self.muon_momentum} must lie in [0, 1)")
        need(self.muon_ns_steps >= 1, f"optim.muon_ns_steps={self.muon_ns_steps} must be >= 1")
        need(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        need(0 <= self.warmup_frac < 1, f"optim.warmup_frac={self.warmup_frac} must lie in [0, 1)")
        return self
