"""What a forward pass leaves in memory for its backward, per decoder layer, measured on the real model.

Every tensor an op creates during the forward is recorded (by storage, so views and in-place
results count once) together with the decoder layer that was running; after the forward, the
storages still alive are what autograd (and activation checkpointing) keep until backward. This
is the same quantity as "memory allocated after the forward minus before" on a GPU, but it works
on any device and splits it by layer, so it measures every checkpointing policy alike (a plain
count of saved tensors would miss what a checkpoint keeps outside autograd's saved tensors).

Storages that existed before the forward (parameters, buffers, the inputs) are not counted.
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_lc.model.transformer import DecoderLayer, MoELCModel
from moe_lc.ops.documents import DocumentBounds

OUTSIDE = "other"  # embedding, output mixer and norm, LM head and loss, the MTP projection


@dataclass
class SavedActivations:
    """Bytes alive after one forward, by where they were allocated: ``layer<i>``, ``mtp`` or ``other``."""

    tokens: int
    bytes_by_layer: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_layer.values())

    def per_token(self, label: Optional[str] = None) -> float:
        """Bytes per token of one layer (``layer3``, ``mtp``, ``other``), or of everything (None)."""
        total = self.total_bytes if label is None else self.bytes_by_layer.get(label, 0)
        return total / self.tokens


def layer_label(layer: DecoderLayer, model: MoELCModel) -> str:
    if model.mtp is not None and layer is model.mtp.layer:
        return "mtp"
    return f"layer{layer.layer_idx}"


class _StorageRecorder(TorchDispatchMode):
    """Records the storage of every op output (first sight only) with the label running at the time."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known  # storages that existed before the forward
        self.labels: list[str] = [OUTSIDE]
        self.records: list[tuple[StorageWeakRef, int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.layout == torch.strided:
                self._record(t.untyped_storage())
        return out

    def _record(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.known:
            return
        self.known.add(key)
        self.records.append((StorageWeakRef(storage), storage.nbytes(), self.labels[-1]))

    def alive_by_label(self) -> dict[str, int]:
        alive: dict[str, int] = defaultdict(int)
        for ref, nbytes, label in self.records:
            if not ref.expired():
                alive[label] += nbytes
        return dict(alive)


@contextlib.contextmanager
def _labelled_layers(model: MoELCModel, recorder: _StorageRecorder) -> Iterator[None]:
    def leave(module: nn.Module, args: Any, output: Any) -> None:
        recorder.labels.pop()

    handles = []
    for layer in (m for m in model.modules() if isinstance(m, DecoderLayer)):
        label = layer_label(layer, model)
        handles.append(layer.register_forward_pre_hook(lambda m, a, label=label: recorder.labels.append(label)))
        handles.append(layer.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _storage_keys(tensors: list[Tensor]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, Tensor) and t.layout == torch.strided}


def measure_saved_activations(
    model: MoELCModel,
    input_ids: Tensor,
    labels: Tensor,
    docs: Optional[DocumentBounds] = None,
    backward: bool = True,
) -> SavedActivations:
    """Run one training forward (``return_logits=False``) and measure what it keeps for backward.

    ``backward``: then run the backward too (so that gradients, QB statistics and a
    checkpointed recompute happen as in training); the measurement is taken before it.
    """
    state = [*model.parameters(), *model.buffers(), input_ids, labels]
    if docs is not None:
        state.append(docs.cu_seqlens)
    recorder = _StorageRecorder(_storage_keys(state))
    with _labelled_layers(model, recorder), recorder:
        out = model(input_ids, labels=labels, docs=docs, return_logits=False)
    # garbage in reference cycles is not kept for backward: collect it first (Triton's interpreter, for
    # one, leaves each launch's tensor arguments in a cycle; measured: every mixture output stayed alive)
    gc.collect()
    result = SavedActivations(tokens=input_ids.numel(), bytes_by_layer=recorder.alive_by_label())
    if backward:
        out.loss.backward()
    return result
