"""The padded attention's cuDNN plans, built before a stage's first step instead of inside its steps.

cuDNN builds an execution plan for every new sequence length it meets (~0.3 s forward and backward
on an H200). The "padded" attention (``moe_lc.ops.attention``) rounds each document up to one of a
few lengths so that a run builds each plan once, but left to the batches those builds land in the
first tens of steps, wherever a new length first appears: a timed step of ``moe-lc bench`` among
them, which then reads a few percent slow (docs/performance.md §12.15). Here every length a
stage's documents can pad to runs once through one MLA layer, forward and backward, before the
first step: the same seconds, paid once and up front.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from moe_lc.model.mla import GatedMLA
from moe_lc.ops.attention import PADDED_MIN_MEAN_LENGTH, padded_lengths, resolve_backend
from moe_lc.ops.documents import DocumentBounds
from moe_lc.train.curriculum import StagePlan
from moe_lc.train.runtime import Runtime

# Stages whose documents can be longer run few steps a minute and meet few lengths per doubling
# (16): their builds are a small share of the stage, and one attention call on a 1M-token
# document is itself seconds. Left to the steps.
PREBUILD_MAX_DOCUMENT = 65536


def prebuild_rows(max_document: int, row_tokens: int) -> list[tuple[int, ...]]:
    """Document lengths of rows of ``row_tokens`` tokens (a micro-batch's packed row, so that every
    other op of the layer meets the shape it trains at: no compiled norm compiles again) that meet
    every length documents of up to ``max_document`` tokens pad to: per length P, a document of P - 1
    tokens (padded to P, as every document not exactly P long is), then the rest of the row in
    documents of at most ``max_document`` - 1 tokens. Only rows whose mean document length is one
    that "auto" runs padded (PADDED_MIN_MEAN_LENGTH) are kept."""
    rows = []
    for length in padded_lengths(min(max_document, row_tokens)):
        docs, rest = [length - 1], row_tokens - (length - 1)
        while rest > 0:
            docs.append(min(rest, max_document - 1))
            rest -= docs[-1]
        if row_tokens / len(docs) >= PADDED_MIN_MEAN_LENGTH:
            rows.append(tuple(docs))
    return rows


def attention_layer(model: nn.Module) -> Optional[GatedMLA]:
    """The model's first MLA layer whose weights are plain tensors here (a layer sharded by FSDP or
    tensor parallelism runs inside its own wrappers only), or None."""
    for module in model.modules():
        if isinstance(module, GatedMLA):
            return module if all(type(p.data) is torch.Tensor for p in module.parameters()) else None
    return None


def run_rows(layer: GatedMLA, rows: list[tuple[int, ...]], runtime: Runtime) -> None:
    """Forward and backward of ``layer`` over each row of documents, in the run's compute dtype under its
    autocast, gradients taken for the input only (the layer's weights and their ``.grad`` are left as
    they were)."""
    d = layer.o_proj.out_features
    for docs in rows:
        bounds = [0]
        for n in docs:
            bounds.append(bounds[-1] + n)
        x = torch.randn(1, bounds[-1], d, device=runtime.device, dtype=runtime.compute_dtype, requires_grad=True)
        with runtime.autocast():
            out = layer(x, DocumentBounds.from_host(bounds, runtime.device))
        torch.autograd.grad(out, x, torch.randn_like(out))


def prebuild_attention_plans(model: nn.Module, max_document: int, row_tokens: int, runtime: Runtime,
                             context_parallel: bool = False) -> tuple[int, float]:
    """Build the plans of every length documents of up to ``max_document`` tokens pad to, in rows of
    ``row_tokens``, where training would build them: on CUDA, with the padded attention available, an
    MLA layer with plain weights, no context parallelism (whose queries run another path) and
    documents of at most PREBUILD_MAX_DOCUMENT tokens. (rows run, seconds taken); (0, 0.0) where
    nothing ran."""
    device = runtime.device
    if (device.type != "cuda" or context_parallel or max_document > PREBUILD_MAX_DOCUMENT
            or resolve_backend("auto", device, True, mean_document_length=max_document) != "padded"):
        return 0, 0.0
    layer = attention_layer(model)
    rows = prebuild_rows(max_document, row_tokens)
    if layer is None or not rows:
        return 0, 0.0
    start = time.perf_counter()
    run_rows(layer, rows, runtime)
    torch.cuda.synchronize(device)
    return len(rows), time.perf_counter() - start


def prebuild_stage_attention_plans(model: nn.Module, plan: StagePlan, runtime: Runtime) -> tuple[int, float]:
    """:func:`prebuild_attention_plans` for a curriculum stage: its documents are at most ``seq_len``
    long (the packing cuts them at each sequence's end) and a micro-batch is one row of
    ``micro_batch`` sequences."""
    return prebuild_attention_plans(model, plan.seq_len, plan.micro_batch * plan.seq_len, runtime,
                                    context_parallel=plan.layout.cp > 1)


def describe(rows: int, seconds: float) -> str:
    """The log line of a prebuild that ran."""
    return f"attention: cuDNN plans for {rows} padded document lengths built before the first step ({seconds:.1f}s)"
