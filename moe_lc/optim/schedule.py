"""One learning-rate schedule over the whole curriculum (docs/design.md §7.6): linear warmup, then cosine to min_lr.

With W warmup steps and N steps in all (0-based step s, the step about to be taken):

    s <  W:  lr = lr_peak (s + 1) / W                           (reaches the peak at s = W - 1)
    s >= W:  lr = min_lr + (lr_peak - min_lr) (1 + cos(pi p)) / 2,   p = (s - W + 1) / (N - W)

so p runs from 1/(N - W) just after the peak to 1 at the last step s = N - 1, where lr = min_lr;
steps past the end stay at min_lr. The only state is the step number, so resuming is exact.
"""

from __future__ import annotations

import math

import torch

from moe_lc.optim.config import OptimConfig


def warmup_steps(total_steps: int, cfg: OptimConfig) -> int:
    """ceil(warmup_frac * N), at least 1 and at most N."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: the schedule needs at least one step")
    return min(total_steps, max(1, math.ceil(cfg.warmup_frac * total_steps)))


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for 0-based optimizer step `step` of a run of `total_steps` steps."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    warmup = warmup_steps(total_steps, cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if total_steps == warmup:
        return cfg.lr
    progress = min(1.0, (step - warmup + 1) / (total_steps - warmup))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr(optimizer: torch.optim.Optimizer, step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Set every param group's lr for this step (call before optimizer.step()); returns it."""
    lr = lr_at(step, total_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
