"""Stage-end evaluation: is the longer context being used?

1. Loss by token position: per-token cross-entropy on held-out sequences of the stage's
   length, averaged in buckets of the position inside its document segment
   ([0, 64), [64, 128), [128, 256), ... doubling up to seq_len). Later positions see more
   context; if the model uses it, their loss is lower.
2. Passkey retrieval at the stage's length (moe_lc.data.synthetic): loss and accuracy on the
   answer tokens of a number stated once, at a random depth, and asked for at the end.

Under context parallelism every cp rank runs its shard of each row and computes the per-token
losses (and argmax hits) of its own positions; those per-token values, not the logits, are
gathered into the row, so the result equals one process's. Under a pipeline the row goes through
the stages in order, forward only, and the last stage's per-token values are broadcast to every
rank of the pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from moe_lc.ops.documents import DocumentBounds, upload
from moe_lc.parallel.context import ContextShard, shard_documents, shard_row, unshard_row

IGNORE_INDEX = -100
FIRST_BUCKET = 64
LOGIT_CHUNK = 8192  # positions per fp32 cross-entropy chunk (bounds the upcast's memory)


def position_buckets(seq_len: int, first: int = FIRST_BUCKET) -> list[tuple[int, int]]:
    """[0, first), [first, 2 first), [2 first, 4 first), ... ending at seq_len."""
    edges = [0]
    edge = min(first, seq_len)
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    edges.append(seq_len)
    return list(zip(edges[:-1], edges[1:]))


def positions_in_documents(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """For each of `length` packed positions, its offset from the start of its document segment."""
    cu = cu_seqlens.long().cpu()
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(length) - starts


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy in fp32 (0 where ignored), chunked to bound memory. logits [1, N, V]."""
    logits = _full(logits).reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).to(logits.device)
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, labels.shape[0], LOGIT_CHUNK):
        out[s : s + LOGIT_CHUNK] = F.cross_entropy(
            logits[s : s + LOGIT_CHUNK].float(), labels[s : s + LOGIT_CHUNK], ignore_index=IGNORE_INDEX, reduction="none"
        )
    return out


def answer_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position 1.0 where the argmax is the label (0 where ignored). logits [1, N, V]."""
    logits = _full(logits).reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).to(logits.device)
    return ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).float()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def bucket_losses(losses: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, seq_len: int) -> list[dict[str, Any]]:
    """Mean loss and token count per position bucket (labelled positions only)."""
    labels = labels.reshape(-1).cpu()
    losses = losses.cpu().double()
    valid = labels != IGNORE_INDEX
    out = []
    for lo, hi in position_buckets(seq_len):
        sel = valid & (positions >= lo) & (positions < hi)
        n = int(sel.sum())
        out.append({"lo": lo, "hi": hi, "tokens": n, "loss_sum": float(losses[sel].sum()) if n else 0.0})
    return out


def merge_buckets(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged = [dict(b) for b in parts[0]]
    for part in parts[1:]:
        for m, b in zip(merged, part):
            m["tokens"] += b["tokens"]
            m["loss_sum"] += b["loss_sum"]
    for m in merged:
        m["loss"] = m["loss_sum"] / m["tokens"] if m["tokens"] else None
        del m["loss_sum"]
    return merged


@torch.no_grad()
def evaluate_stage(
    model: torch.nn.Module,
    eval_dataset: Any,
    seq_len: int,
    sequences: int,
    passkey_documents: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    tokenizer: str = "byte",
    seed: int = 0,
    context: Optional[Callable[[int], ContextShard]] = None,
    pipeline: Optional[Any] = None,
) -> dict[str, Any]:
    """Loss by position on `sequences` held-out sequences and passkey retrieval; restores train mode.

    ``context``: under cp > 1, this rank's ContextShard for a row of a given length; ``pipeline``:
    under pp > 1, the rank's ``moe_lc.parallel.pipeline_runtime.Pipeline`` (every rank of the
    model calls this together)."""
    from moe_lc.data import answer_batch, collate, synthetic_documents

    was_training = model.training
    model.eval()
    result: dict[str, Any] = {"seq_len": seq_len}
    try:
        parts, total, count = [], 0.0, 0
        for i in range(sequences):
            batch = collate([eval_dataset[i]])
            losses, = _per_token(model, batch, device, autocast, context, pipeline, token_losses)
            positions = positions_in_documents(batch.cu_seqlens, batch.input_ids.shape[1])
            parts.append(bucket_losses(losses, batch.labels, positions, seq_len))
            total += float(losses.double().sum())
            count += batch.num_label_tokens
        if parts:
            result["buckets"] = merge_buckets(parts)
            result["loss"] = total / count if count else None
            result["tokens"] = count
        if passkey_documents > 0:
            docs = synthetic_documents("passkey", passkey_documents, seq_len, seed=seed, tokenizer=tokenizer)
            batch = answer_batch(docs)
            losses, hits = _per_token(model, batch, device, autocast, context, pipeline, token_losses, answer_hits)
            answers = batch.labels.reshape(-1) != IGNORE_INDEX
            if not bool(answers.any()):
                raise ValueError("the passkey batch has no answer labels")
            result["passkey_loss"] = float(losses.cpu().double()[answers].mean())
            result["passkey_accuracy"] = float(hits.cpu().double()[answers].mean())
    finally:
        model.train(was_training)
    return result


def _per_token(model: torch.nn.Module, batch: Any, device: torch.device, autocast: Callable,
               context: Optional[Callable[[int], ContextShard]], pipeline: Optional[Any],
               *measures: Callable) -> list[torch.Tensor]:
    """Each of ``measures(logits, labels)`` for every position of the batch's row, [N]: one forward of
    the row (through the pipeline's stages with pp > 1), or of this rank's shard of it under cp with
    the per-position values gathered."""
    input_ids, docs = _on_device(batch, device)
    labels = batch.labels
    shard = context(input_ids.shape[-1]) if context is not None else None
    if shard is not None:
        input_ids, docs, labels = shard_row(input_ids, shard), shard_documents(docs, shard), shard_row(labels, shard)
    if pipeline is not None:
        from moe_lc.parallel.loss_weights import TermWeights
        from moe_lc.parallel.pipeline_stage import StageBatch

        unused = TermWeights.whole(0, torch.ones((), dtype=torch.float64, device=device))
        stage_batch = StageBatch(batch.input_ids.shape[-1], input_ids, upload(labels, device), docs, unused,
                                 measures=measures)
        values = pipeline.evaluate(stage_batch, autocast)
    else:
        with autocast():
            logits = model(input_ids, docs=docs).logits
        values = [measure(logits, labels) for measure in measures]
    if shard is None:
        return values
    return [unshard_row(v.reshape(1, -1), shard).reshape(-1) for v in values]


def _on_device(batch: Any, device: torch.device) -> tuple[torch.Tensor, DocumentBounds]:
    """(input ids, document bounds) on ``device`` without stream syncs: pinned uploads, and the host
    copy of the boundaries handed to the layers (as the training step does)."""
    return upload(batch.input_ids, device), DocumentBounds.from_host(batch.cu_seqlens, device)


def describe_eval(result: dict[str, Any]) -> Optional[str]:
    """One console line: mean loss, first and last position bucket, passkey accuracy."""
    parts = []
    if result.get("loss") is not None:
        parts.append(f"eval loss {result['loss']:.4f}")
        buckets = [b for b in result.get("buckets", []) if b["loss"] is not None]
        if len(buckets) >= 2:
            first, last = buckets[0], buckets[-1]
            parts.append(
                f"pos [{first['lo']},{first['hi']}) {first['loss']:.3f} -> [{last['lo']},{last['hi']}) {last['loss']:.3f}"
            )
    if "passkey_accuracy" in result:
        parts.append(f"passkey acc {result['passkey_accuracy']:.2f} (loss {result['passkey_loss']:.3f})")
    return ", ".join(parts) or None
