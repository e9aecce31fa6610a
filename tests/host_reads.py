"""A stand-in for the device ``cu_seqlens`` that fails a test when the boundaries are read back to
the host, for tests that show a code path takes them from ``DocumentBounds.host`` instead."""

from __future__ import annotations

import contextlib

import torch

from moe_lc.ops.documents import DocumentBounds


class HostRead(AssertionError):
    pass


class GuardedBounds(torch.Tensor):
    """Stands in for the device cu_seqlens: while ``armed``, reading it, or any integer tensor
    computed from it (slices, casts, searchsorted positions), back to the host raises. Float
    results (a mask turned into activations) are plain tensors again, so the guard does not spread
    into the activations, whose reads (MoE routing counts) are none of its business."""

    armed = False
    HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
                  torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
                  # outputs whose size depends on the values: the host waits for them too
                  torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                  torch.unique, torch.Tensor.unique}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.armed and (func in cls.HOST_READS or cls._masks(func, args)):
            raise HostRead(f"the device boundaries were read back to the host ({func.__name__})")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if isinstance(out, (list, tuple)) and not isinstance(out, torch.Size):
                return type(out)([cls._rewrap(t) for t in out])
            return cls._rewrap(out)

    @classmethod
    def _masks(cls, func, args) -> bool:
        """Indexing with a boolean mask computed from the boundaries (its size depends on the values)."""
        if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) or len(args) < 2:
            return False
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, cls) and i.dtype == torch.bool for i in index)

    @classmethod
    def _rewrap(cls, t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.as_subclass(torch.Tensor if t.is_floating_point() or t.is_complex() else cls)


@contextlib.contextmanager
def forbid_host_reads():
    GuardedBounds.armed = True
    try:
        yield
    finally:
        GuardedBounds.armed = False


def guarded(host: list[int]) -> DocumentBounds:
    return DocumentBounds(torch.tensor(host, dtype=torch.int32).as_subclass(GuardedBounds), tuple(host))
