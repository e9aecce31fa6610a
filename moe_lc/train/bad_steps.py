"""Steps that must not count, and state that must not be saved.

- A step whose loss or gradient norm is not finite changes nothing: no optimizer update, the
  expert biases kept. The decision is made from the globally reduced loss and gradient norm,
  which every rank holds alike, so every rank skips together. With a fused AdamW (the default
  on GPUs) the skip happens on the device (the kernel's `found_inf` input), so the step still
  waits for the device only at its end; any other optimizer reads the flag back first.
- `BadStepBudget` stops the run (FloatingPointError, exit code 1) after too many skips in a
  row or in all, and `SpikeDetector` sees a loss far above the recent ones.
- `nonfinite_state` is the check before a checkpoint: one fused norm over every parameter,
  buffer and optimizer tensor of each rank, one all-reduce, one read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_lc.train.config import BadStepConfig

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None


# ----------------------------------------------------------------------------- the update


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can skip its update from a device flag: torch's fused Adam/AdamW."""
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def step_if_finite(optimizer: torch.optim.Optimizer, finite: torch.Tensor,
                   grad_divisor: Optional[torch.Tensor] = None) -> None:
    """`optimizer.step()` where `finite` (a device bool, the same on every rank) is true, else nothing:
    parameters, moments and step counts stay as they were. ``grad_divisor`` (a device scalar; only
    where ``skips_on_device``): the fused kernel divides every gradient by it as it reads them
    (gradient clipping folded into the update, ``moe_lc.optim.clip.clip_divisor``)."""
    if grad_divisor is not None and not skips_on_device(optimizer):
        raise ValueError("step_if_finite: grad_divisor needs torch's fused Adam/AdamW; clip the gradients first")
    if skips_on_device(optimizer):
        optimizer.found_inf = (~finite).to(torch.float32)  # the fused kernel returns early where it is 1
        optimizer.grad_scale = grad_divisor.to(torch.float32) if grad_divisor is not None else None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif bool(finite):  # this optimizer cannot skip on the device: read the flag first
        optimizer.step()


def update_biases_if_finite(balancers: Iterable[nn.Module], group: Optional[object], finite: torch.Tensor) -> None:
    """Every balancer's update (its statistics are reduced and cleared on every step, a collective),
    keeping the old bias where the step is skipped: a non-finite forward routes on garbage."""
    for balancer in balancers:
        before = balancer.bias.clone()
        balancer.update(group)
        balancer.bias.copy_(torch.where(finite, balancer.bias, before))


# ----------------------------------------------------------------------------- the run's budget


class BadStepBudget:
    """Counts skipped steps; FloatingPointError once `max_consecutive_skips` in a row or `max_skips`
    in this launch were skipped."""

    def __init__(self, cfg: BadStepConfig) -> None:
        self.cfg = cfg
        self.in_a_row = 0
        self.total = 0

    def count(self, step: int, skipped: bool, loss: float, grad_norm: float, lr: float) -> None:
        """Account for step `step` (1-based) just taken."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        over = []
        if self.in_a_row >= self.cfg.max_consecutive_skips:
            over.append(f"{self.in_a_row} in a row (bad_steps.max_consecutive_skips)")
        if self.total >= self.cfg.max_skips:
            over.append(f"{self.total} in this launch (bad_steps.max_skips)")
        if over:
            raise FloatingPointError(
                f"step {step} had loss {loss} and gradient norm {grad_norm} (lr {lr:.3g}): too many skipped "
                f"steps, {' and '.join(over)}; the newest checkpoint holds the last finite state: lower "
                "optim.lr or check the data, then resume with resume=auto"
            )


@dataclass(frozen=True)
class Spike:
    loss: float
    mean: float
    std: float
    sigmas: float

    def describe(self) -> str:
        return (f"loss {self.loss:.4f} > mean {self.mean:.4f} + {self.sigmas:g} x std {self.std:.4f} of the "
                "previous steps")


class SpikeDetector:
    """A loss above mean + k std of the last `window` finite, non-spiking losses is a spike
    (k = `sigmas`; 0 turns detection off). Nothing is judged until the window is full."""

    def __init__(self, window: int, sigmas: float) -> None:
        self.sigmas = sigmas
        self.window = window
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, step: int, loss: float) -> Optional[Spike]:
        if self.sigmas <= 0 or not math.isfinite(loss):
            return None
        if len(self._recent) == self.window:
            values = [v for _, v in self._recent]
            mean = math.fsum(values) / len(values)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            if loss > mean + self.sigmas * std:
                return Spike(loss, mean, std, self.sigmas)  # not added: a spike would widen the window
        self._recent.append((step, loss))
        return None

    def rewind(self, step: int) -> None:
        """Forget the losses of steps after `step` (they are redone after a rollback)."""
        while self._recent and self._recent[-1][0] > step:
            self._recent.pop()


# ----------------------------------------------------------------------------- state before a save


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _named_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's floating-point tensors of the model and the optimizer, by name."""
    for name, t in model.named_parameters():
        yield name, _local(t.detach())
    for name, t in model.named_buffers():
        yield name, _local(t)
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            for key, t in st.items():
                if isinstance(t, torch.Tensor):
                    yield f"optimizer {key} of {names.get(id(p), '?')}", _local(t)


def nonfinite_state(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], device: torch.device, distributed: bool
) -> Optional[str]:
    """None when every rank's weights, buffers and optimizer state are finite; else what is not
    (the first tensor on this rank, or "another rank"). Collective when `distributed`."""
    named = [(n, t) for n, t in _named_state(model, optimizer) if t.is_floating_point() and t.numel()]
    norms = torch._foreach_norm([t for _, t in named])  # a NaN or inf anywhere in a tensor makes its norm one
    finite = torch.stack([n.float().to(device) for n in norms]).isfinite() if named else torch.ones(0, device=device)
    bad = (~finite.all()).to(torch.int32).reshape(1)
    if distributed:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bool(bad):
        return None
    mine = [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
    return f"{mine[0]} (and {len(mine) - 1} more on this rank)" if mine else "a tensor on another rank"
