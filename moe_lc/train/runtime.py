"""Process-level setup: device, torch.distributed, precision, and a few collective helpers.

A plain `python -m moe_lc.train` is one process; under `torchrun` (WORLD_SIZE > 1) the
process group is initialised here (NCCL on GPUs, gloo on CPU) and each rank takes the GPU
of its LOCAL_RANK.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from moe_lc.config import ConfigError

T = TypeVar("T")


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    compute_dtype: torch.dtype  # bf16 (autocast over fp32 weights), fp32, or fp64 (float64 weights)
    started_process_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast around forward passes when the run computes in bf16 (weights stay fp32)."""
        if self.compute_dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def rank0_first(self, fn: Callable[[], T]) -> None:
        """Run `fn` on rank 0, then (after a barrier) let the others proceed, e.g. to build a cache."""
        if self.is_main:
            fn()
        self.barrier()

    def shutdown(self) -> None:
        if self.started_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError as err:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an integer") from err


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
        if requested == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device(requested)
    if requested != "cpu":
        raise ConfigError(f"device={requested!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    # fp64: float64 weights and compute, so that runs under different layouts or batch splits can be
    # compared far below the size of any real error (tests; slow)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[precision]


def init_runtime(device: str = "auto", precision: str = "auto", threads: Optional[int] = None) -> Runtime:
    """Pick the device, start torch.distributed when launched by torchrun, set the compute dtype."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if threads is not None:
        torch.set_num_threads(threads)
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    started = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        started = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return Runtime(rank, world, local_rank, dev, compute_dtype(precision, dev), started)
