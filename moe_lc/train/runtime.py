"""Process-level setup: device, torch.distributed, precision, and a few collective helpers.

A plain `python -m moe_lc.train` is one process; under `torchrun` (WORLD_SIZE > 1) the
process group is initialised here (NCCL on GPUs, gloo on CPU) and each rank takes the GPU
of its LOCAL_RANK. Every process group of the launch gets `distributed.collective_timeout_s`
(`moe_lc.train.hangs`), so a rank that stops responding is an error on the others, not a hang.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from moe_lc.config import ConfigError
from moe_lc.train.config import DistributedConfig
from moe_lc.train.hangs import collective_timeouts

T = TypeVar("T")


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    compute_dtype: torch.dtype  # bf16 (autocast over fp32 weights), fp32, or fp64 (float64 weights)
    started_process_group: bool
    collective_timeout_s: float = 0.0  # of every process group (0: one process, none)
    float8: bool = False  # precision=fp8: the dense linears' GEMMs in float8 (moe_lc.parallel.float8)

    @property
    def precision_label(self) -> str:
        return self.describe_precision()

    def describe_precision(self, float8_experts: bool = False) -> str:
        """What computes in which precision (``float8_experts``: ``float8.experts=true``)."""
        if self.float8:
            return f"fp8 linears{' and experts' if float8_experts else ''}, bf16 autocast, fp32 weights"
        return {torch.bfloat16: "bf16 autocast, fp32 weights", torch.float64: "fp64"}.get(self.compute_dtype, "fp32")

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

    def step_weight_casts(self) -> contextlib.AbstractContextManager:
        """Held around a step's micro-batches so that autocast casts each weight once a step, not once a
        micro-batch: autocast drops its cache of the bf16 weight copies only when the outermost autocast
        context exits, and this one is that context, itself disabled (the backward passes between the
        micro-batches' forwards run without autocast, as they would without it). The weights must not
        change inside it (the optimizer steps after)."""
        if self.compute_dtype == torch.bfloat16:
            return torch.autocast(self.device.type, enabled=False)
        return contextlib.nullcontext()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def rank0_first(self, fn: Callable[[], T]) -> None:
        """Run `fn` on rank 0, then (after a barrier) let the others proceed, e.g. to build a cache."""
        if self.is_main:
            fn()
        self.barrier()

    def shutdown(self, after_collective_failure: bool = False) -> None:
        """Destroy the process group this runtime started; after a failed collective NCCL's is aborted
        instead (a graceful destroy would wait for the peer that stopped responding)."""
        if not (self.started_process_group and dist.is_initialized()):
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if after_collective_failure and self.device.type == "cuda" and abort is not None:
            abort()
        else:
            dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError as err:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an integer") from err


def pick_device(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """The device of this process: one GPU per process of the node (``LOCAL_RANK``), as NCCL needs."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
        if requested == "cuda":
            gpus, procs = torch.cuda.device_count(), max(local_world_size, local_rank + 1)
            if procs > gpus:  # two ranks on one GPU: NCCL stops at its first collective
                raise ConfigError(f"{procs} processes on this node but {gpus} GPU"
                                  f"{'s are' if gpus > 1 else ' is'} visible: launch at most {gpus} per node "
                                  f"(torchrun --nproc-per-node {gpus}, NPROC={gpus} for launch/), or device=cpu")
            return torch.device("cuda", local_rank)
        return torch.device(requested)
    if requested != "cpu":
        raise ConfigError(f"device={requested!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if precision == "fp8":  # bf16 around the float8 GEMMs; only GPUs with FP8 tensor cores
        from moe_lc.parallel.float8 import check_float8_device

        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        check_float8_device(device.type, capability)
        return torch.bfloat16
    # fp64: float64 weights and compute, so that runs under different layouts or batch splits can be
    # compared far below the size of any real error (tests; slow)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[precision]


def elastic_attempt_store(world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """Under `torchrun --max-restarts`, the store of this attempt: torchrun's store, shared by every
    attempt, under a prefix of its own.

    torchrun keeps one store for all attempts, so the keys a process group publishes (each
    rank's address) are still there, stale, when the restarted ranks look for their peers;
    a rank that reads a dead peer's address fails ("Connection refused"), and every restart
    after it may too. None outside torchelastic (torch's env:// rendezvous then).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"moe_lc/attempt_{attempt}", store)


def init_runtime(
    device: str = "auto",
    precision: str = "auto",
    threads: Optional[int] = None,
    distributed: Optional[DistributedConfig] = None,
    flight_recorder_dir: Optional[Path] = None,
) -> Runtime:
    """Pick the device, start torch.distributed when launched by torchrun, set the compute dtype.

    distributed: the collective timeout and NCCL's flight recorder (defaults when None), whose
    dumps go to `flight_recorder_dir`.
    """
    distributed = distributed or DistributedConfig()
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if threads is not None:
        torch.set_num_threads(threads)
    dev = pick_device(device, local_rank, _env_int("LOCAL_WORLD_SIZE", 1))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = compute_dtype(precision, dev)  # before the process group: a precision this device lacks fails here
    started = False
    if world > 1 and not dist.is_initialized():
        timeout = collective_timeouts(distributed.collective_timeout_s, distributed.flight_recorder_entries,
                                      flight_recorder_dir)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        store = elastic_attempt_store(world, timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        started = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    timeout_s = distributed.collective_timeout_s if world > 1 else 0.0
    return Runtime(rank, world, local_rank, dev, dtype, started, timeout_s, float8=precision == "fp8")
