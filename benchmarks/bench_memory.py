"""Activation memory of the real training model under each checkpointing policy, against `moe-lc plan`.

For a recipe (its model, optimizer and first stage's layout, on one GPU) and each policy and
sequence length, one training forward + backward of a packed row of documents:

- stored: memory allocated after the forward minus before, in bytes per token (what the forward
  keeps for backward), and by decoder layer (``moe_lc.metrics.saved_activations``, the same
  quantity counted per layer);
- peak: the allocator's peak over the forward and backward, after one warm-up step (so the
  optimizer state and the compiled kernels exist);
- time: the forward + backward's wall time (what the recompute costs);
- the plan's prediction of each (``moe_lc.parallel.activation_memory`` on the GPU path), and the
  ratio measured / predicted.

Run from the repository root with the package installed (``pip install -e .``), on a GPU:

    python benchmarks/bench_memory.py [--recipe proxy-8k] [--seq-lens 8192,65536]
                                      [--policies none,selective,full] [--documents 8]
                                      [--out memory.json] [key=value ...]   # recipe overrides

A policy that does not fit is reported as "oom". The ratios are what calibrates the GPU path's
named constants in ``moe_lc/parallel/activation_memory.py`` (the fused kernels' extra tensors and
the backward's working memory).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any

import torch

from moe_lc.metrics.saved_activations import measure_saved_activations
from moe_lc.ops.documents import DocumentBounds
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from moe_lc.parallel.activation_memory import estimate_activations, gpu_execution_path, layer_activations
from moe_lc.train.curriculum import plan_curriculum
from moe_lc.train.model_setup import build_model_state
from moe_lc.train.plan import estimate_stage
from moe_lc.train.recipes import compose_recipe
from moe_lc.train.runtime import init_runtime

GiB = 1024**3


def packed_row(seq_len: int, documents: int, vocab: int, device: torch.device, seed: int = 0):
    """Random tokens in ``documents`` equal documents (the last takes the remainder)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = torch.randint(0, vocab, (1, seq_len), generator=g)
    step = max(1, seq_len // documents)
    bounds = [*range(0, seq_len - step + 1, step)][:documents] + [seq_len]
    return ids.to(device), labels.to(device), DocumentBounds.from_host(bounds, device)


def forward_backward(state, batch, autocast) -> tuple[int, int, float]:
    """(bytes kept after the forward, peak bytes, seconds) of one training forward + backward."""
    ids, labels, docs = batch
    device = ids.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with autocast():
        out = state.model(ids, labels=labels, docs=docs, return_logits=False)
    torch.cuda.synchronize(device)
    stored = torch.cuda.memory_allocated(device) - before
    out.loss.backward()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return stored, peak, seconds


def train_step(state, batch, autocast) -> None:
    """One optimizer step (the warm-up: optimizer state allocated, kernels compiled)."""
    ids, labels, docs = batch
    with autocast():
        out = state.model(ids, labels=labels, docs=docs, return_logits=False)
    out.loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def measure(cfg, state, runtime, policy: ActivationCheckpointing, seq_len: int, documents: int) -> dict[str, Any]:
    apply_activation_checkpointing(state.model, policy)
    autocast = runtime.autocast if state.autocast_forward else contextlib.nullcontext
    stage = dataclasses.replace(plan_curriculum(cfg, 1)[0], seq_len=seq_len, micro_batch=1,
                                global_batch_tokens=seq_len, checkpointing=policy)
    predicted = estimate_stage(cfg, stage)
    path = gpu_execution_path(stage.layout, cfg.compile)
    per_layer = estimate_activations(cfg.model, policy, seq_len, path, layer_activations(cfg.model, path))
    row: dict[str, Any] = dict(policy=policy.describe(), seq_len=seq_len, documents=documents,
                               predicted_stored_per_token=predicted.activations_gib * GiB / seq_len,
                               predicted_peak_gib=predicted.total_gib,
                               predicted_by_layer=per_layer.by_layer)
    batch = packed_row(seq_len, documents, cfg.model.vocab_size, runtime.device)
    try:
        train_step(state, batch, autocast)
        stored, peak, seconds = forward_backward(state, batch, autocast)
        with autocast():
            by_layer = measure_saved_activations(state.model, *batch[:2], docs=batch[2], backward=True)
        state.optimizer.zero_grad(set_to_none=True)
    except torch.cuda.OutOfMemoryError:
        state.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        row.update(result="oom")
        return row
    row.update(result="ok", stored_per_token=stored / seq_len, peak_gib=peak / GiB, seconds=seconds,
               by_layer={k: v / by_layer.tokens for k, v in by_layer.bytes_by_layer.items()})
    row["stored_ratio"] = row["stored_per_token"] / row["predicted_stored_per_token"]
    row["peak_ratio"] = row["peak_gib"] / row["predicted_peak_gib"]
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'policy':<18}{'seq_len':>9}{'stored B/tok':>14}{'plan':>10}{'ratio':>7}"
             f"{'peak GiB':>10}{'plan':>8}{'ratio':>7}{'f+b s':>8}"]
    for r in rows:
        if r["result"] != "ok":
            lines.append(f"{r['policy']:<18}{r['seq_len']:>9}{'oom':>14}{r['predicted_stored_per_token']:>10.0f}"
                         f"{'':>7}{'':>10}{r['predicted_peak_gib']:>8.1f}")
            continue
        lines.append(f"{r['policy']:<18}{r['seq_len']:>9}{r['stored_per_token']:>14.0f}"
                     f"{r['predicted_stored_per_token']:>10.0f}{r['stored_ratio']:>7.2f}{r['peak_gib']:>10.1f}"
                     f"{r['predicted_peak_gib']:>8.1f}{r['peak_ratio']:>7.2f}{r['seconds']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="proxy-8k")
    ap.add_argument("--seq-lens", default="8192,65536")
    ap.add_argument("--policies", default="none,selective,full", help="modes, or mode:every (selective:2)")
    ap.add_argument("--documents", type=int, default=8, help="documents packed into each row")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args, overrides = ap.parse_known_args(argv)
    cfg = compose_recipe(args.recipe, overrides)
    runtime = init_runtime(cfg.device, cfg.precision, cfg.threads)
    if runtime.device.type != "cuda":
        print("bench_memory.py needs a GPU (on CPU use moe_lc.metrics.saved_activations)", file=sys.stderr)
        return 2
    layout = plan_curriculum(cfg, 1)[0].layout
    state = build_model_state(cfg.model, cfg.optim, layout, runtime, cfg.seed)
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for spec in args.policies.split(","):
            mode, _, every = spec.partition(":")
            policy = ActivationCheckpointing(mode, int(every or 1)).check()
            rows.append(measure(cfg, state, runtime, policy, seq_len, args.documents))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\nrecipe {args.recipe} ({cfg.model.name}), {torch.cuda.get_device_name(runtime.device)}")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
