"""Known lower bounds of log-decay tensors, so that a kernel that needs a bounded gate does not
read the gate back to the host to check it.

The Triton and fla KDA kernels need every per-step log-decay above a floor (the bounded gate).
Checking ``g.min()`` copies a value back from the GPU, which waits for all queued work: twice per
KDA layer and call, the host could no longer run ahead of the GPU. :func:`moe_lc.ops.kda.kda_gate`
knows the bound it produces and records it here; the record holds while the tensor is the same
object, unmodified.
"""

from __future__ import annotations

import weakref

from torch import Tensor

# id(tensor) -> (weak reference, version counter, floor); an entry leaves with its tensor. (Tensors
# cannot key a WeakKeyDictionary: their == is elementwise.)
_floors: dict[int, tuple[weakref.ref, int, float]] = {}


def remember_gate_floor(g: Tensor, floor: float) -> None:
    """Record that every element of ``g`` is at least ``floor`` (by construction)."""
    key = id(g)

    def forget(ref: weakref.ref) -> None:
        if _floors.get(key, (None,))[0] is ref:
            del _floors[key]

    _floors[key] = (weakref.ref(g, forget), g._version, float(floor))


def known_gate_floor(g: Tensor) -> float | None:
    """The floor recorded for ``g``, or None (never recorded, or modified in place since)."""
    entry = _floors.get(id(g))
    if entry is None or entry[0]() is not g or entry[1] != g._version:
        return None
    return entry[2]
