"""Whether the run's weights, gradients and optimizer state fit a rank's memory, before anything is built.

They are certain (the parameters, their gradients and AdamW's or Muon's moments, as `moe-lc plan` counts
them for the stage's layout), unlike the activations: a state that alone exceeds the memory can only
fail, after minutes of building, as a CUDA out-of-memory error, a host allocation error or, on a CPU, the
kernel's OOM killer with no message at all. So that is refused up front, in one line; whether the
activations fit is left to the run (on a GPU its out-of-memory error is explained, see training.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import torch

from moe_lc.config import ConfigError
from moe_lc.model.accounting import count_parameters
from moe_lc.plan.memory import GiB
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan
from moe_lc.train.plan import estimate_stage


def rank_memory_bytes(device: torch.device) -> Optional[float]:
    """Memory one rank may fill: a GPU's total memory; on a CPU the host's available memory over the
    node's ranks (LOCAL_WORLD_SIZE); None where it cannot be read."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    available = next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)
    if available is None:
        return None
    return available / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_state_fits(cfg: TrainConfig, plans: Sequence[StagePlan], device: torch.device,
                     memory: Optional[float] = None) -> None:
    """ConfigError when a stage's weights, gradients and optimizer state per rank exceed ``memory`` (by
    default :func:`rank_memory_bytes` of ``device``)."""
    memory = rank_memory_bytes(device) if memory is None else memory
    if memory is None:
        return
    for plan in plans:
        state = estimate_stage(cfg, plan).state_gib * GiB
        if state > memory:
            params = count_parameters(cfg.model).total
            where = ("of this GPU" if device.type == "cuda"
                     else "this CPU rank has (the host's available memory over the node's ranks)")
            raise ConfigError(
                f"stage {plan.name}: model {cfg.model.name}'s weights, gradients and {cfg.optim.name} state "
                f"({params / 1e9:.2f}B parameters) take {state / GiB:.1f} GiB a rank under its layout, more than "
                f"the {memory / GiB:.1f} GiB {where}, before any activation: use a smaller model (model=tiny, "
                f"proxy), more ranks to shard it over, or a device with more memory (moe-lc plan {cfg.recipe} "
                f"--gpus N prices the layouts)")
