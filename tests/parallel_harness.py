"""Multi-process test harness (CPU, gloo) and the shared training step of the parallel tests.

``run_distributed(fn, world_size, *args)`` runs ``fn(*args)`` on ``world_size`` spawned ranks with
a hard timeout, and returns each rank's result. Workers rendezvous through a file store in a
fresh temporary directory (no ports to race for), use one thread each (the machine has two
cores), and always destroy their process group. A worker failure re-raises in the test with
its traceback; a timeout kills the workers this call started.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from moe_lc.model.transformer import IGNORE_INDEX
from moe_lc.ops.documents import DocumentBounds


# ----------------------------------------------------------------------------- spawning
def _worker(fn: Callable, rank: int, world_size: int, store: str, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # full_tensor() of FSDP x TP parameters (test-only gathers) warns about two-step all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    result: dict[str, Any] = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        result["value"] = fn(*args)
        # No rank tears its connections down while another may still be reading from them (a
        # peer that closes early shows up on the others as "connection reset by peer").
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        path = os.path.join(out_dir, f"rank{rank}.pt")
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)  # the parent never reads a half-written result


def _load_result(out_dir: str, rank: int) -> Optional[dict]:
    path = os.path.join(out_dir, f"rank{rank}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _failure_report(out_dir: str, world_size: int, results: dict[int, dict], first: int) -> str:
    """Every failed rank's traceback, the likely cause first: a rank whose peer failed only sees
    the peer's connection close (a gloo transport error), so the other errors come first."""
    for r in range(world_size):
        if r not in results and (res := _load_result(out_dir, r)) is not None:
            results[r] = res
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    order = sorted(errors, key=lambda r: ("gloo/transport" in errors[r], r))
    return "\n".join(f"rank {r} failed{' first' if r == first else ''}:\n{errors[r]}" for r in order)


# Spawned workers inherit an environment that hides the GPUs. The ranks are gloo processes on the
# CPU; on a machine with a GPU, build_mesh's default device type and FSDP2 (which moves a module to
# its mesh's device) would put the model on the GPU, and a test would compare a GPU run with its CPU
# reference (test_float8's FSDP parity failed so on an H200 machine). Setting it inside the worker
# is too late: unpickling the test's function imports modules (torchao) that ask CUDA for its
# devices at import time, and CUDA keeps the first answer.
_WITHOUT_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 100.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; returns the per-rank return values."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moe_lc_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, store, tmp, args), daemon=True)
            for r in range(world_size)
        ]
        with mock.patch.dict(os.environ, _WITHOUT_GPUS):
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout
        results: dict[int, dict] = {}
        failed = None
        while len(results) < world_size and time.monotonic() < deadline:
            for r in range(world_size):
                if r not in results and (res := _load_result(tmp, r)) is not None:
                    results[r] = res
                    if "error" in res and failed is None:
                        failed = r  # the other ranks would only wait for it in a collective
            if failed is not None or any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                # after a failure, a moment for the other ranks to report theirs (the root cause may be there)
                p.join(2 if failed is not None else (1 if len(results) == world_size else 0))
            if p.is_alive():
                p.kill()
                p.join(5)
        if failed is not None:
            raise RuntimeError(_failure_report(tmp, world_size, results, failed))
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            codes = [procs[r].exitcode for r in missing]
            raise TimeoutError(
                f"ranks {missing} of {world_size} reported no result (exit codes {codes}, None = still running "
                f"after {timeout:.0f}s); all workers were stopped"
            )
        return [results[r]["value"] for r in range(world_size)]


# ----------------------------------------------------------------------------- data
@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, N] packed
    labels: torch.Tensor  # [1, N]
    cu_seqlens: torch.Tensor  # [docs + 1] int32

    @property
    def label_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def make_samples(num: int, seq_len: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Deterministic samples (ids, labels, document lengths): two documents each, ragged ignored labels."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        ids = torch.randint(0, vocab, (seq_len,), generator=g)
        cut = int(torch.randint(3, seq_len - 3, (1,), generator=g))
        lengths = [cut, seq_len - cut]
        labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
        start = 0
        for n in lengths:
            labels[start : start + n - 1] = ids[start + 1 : start + n]
            start += n
        drop = torch.rand(seq_len, generator=g) < 0.2
        labels[drop] = IGNORE_INDEX
        samples.append((ids, labels, lengths))
    return samples


def pack(samples: list) -> MicroBatch:
    ids = torch.cat([s[0] for s in samples]).unsqueeze(0)
    labels = torch.cat([s[1] for s in samples]).unsqueeze(0)
    lengths = [n for s in samples for n in s[2]]
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return MicroBatch(ids, labels, cu)


def rank_micro_batches(samples: list, dp_rank: int, dp_size: int, micro: int) -> list[MicroBatch]:
    """This data-parallel rank's contiguous share of the global batch, cut into ``micro`` micro-batches."""
    share = len(samples) // dp_size
    mine = samples[dp_rank * share : (dp_rank + 1) * share]
    per = len(mine) // micro
    return [pack(mine[i * per : (i + 1) * per]) for i in range(micro)]


# ----------------------------------------------------------------------------- training step
def train_step(model, optimizer, micro_batches: list[MicroBatch], mesh=None, grads: Optional[dict] = None) -> float:
    """Forward/backward over the micro-batches, optimizer step and QB update; returns the global mean loss.

    Each micro-batch's summed token loss is divided by the label tokens of the whole step on
    every data-parallel rank (gradients are summed over ranks).
    """
    from moe_lc.parallel import (
        balance_group,
        data_parallel_group,
        finish_gradient_sync,
        global_label_tokens,
        set_gradient_sync,
    )

    local_tokens = sum(mb.label_tokens for mb in micro_batches)
    total = global_label_tokens(local_tokens, mesh)
    loss_sum = torch.zeros(())
    for i, mb in enumerate(micro_batches):
        set_gradient_sync(model, i == len(micro_batches) - 1)
        docs = DocumentBounds.from_host(mb.cu_seqlens, mb.input_ids.device)
        out = model(mb.input_ids, labels=mb.labels, docs=docs, return_logits=False)
        loss = out.lm_loss * (mb.label_tokens / total)
        loss.backward()
        loss_sum += loss.detach()
    finish_gradient_sync(model)
    if grads is not None:  # global gradients before the update (collective under DTensor)
        grads.update({name: full_tensor(p.grad) for name, p in model.named_parameters()})
    optimizer.step()
    optimizer.zero_grad()
    group = balance_group(mesh) if mesh is not None else None
    for moe in model.moe_layers():
        moe.balancer.update(group)
    if mesh is not None and data_parallel_group(mesh) is not None:
        dist.all_reduce(loss_sum, group=data_parallel_group(mesh))
    return float(loss_sum)


def full_tensor(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model) -> dict[str, torch.Tensor]:
    """Global parameter values by name (collective under DTensor: every rank must call it)."""
    return {name: full_tensor(p) for name, p in model.named_parameters()}


def biases(model) -> torch.Tensor:
    return torch.stack([m.balancer.bias.detach().clone() for m in model.moe_layers()])
