"""Host copies of cu_seqlens: one copy per tensor, invalidated by in-place changes."""

from __future__ import annotations

import torch

from moe_lc.ops import documents
from moe_lc.ops.documents import host_bounds, remember_host_bounds


def count_copies(monkeypatch) -> list:
    """Count device-to-host copies of cu_seqlens (host_bounds makes them with .cpu())."""
    calls = []
    original = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(documents, "_latest", None)
    return calls


def test_one_copy_per_unchanged_tensor(monkeypatch):
    copies = count_copies(monkeypatch)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert host_bounds(cu) == [0, 3, 10] and len(copies) == 1
    assert host_bounds(cu) == [0, 3, 10] and len(copies) == 1  # reused
    cu[1] = 5  # in place: the version counter moves, the copy is stale
    assert host_bounds(cu) == [0, 5, 10] and len(copies) == 2
    other = torch.tensor([0, 5, 10], dtype=torch.int32)  # equal values, another tensor
    assert host_bounds(other) == [0, 5, 10] and len(copies) == 3
    returned = host_bounds(other)
    returned.append(99)  # callers get their own list
    assert host_bounds(other) == [0, 5, 10] and len(copies) == 3


def test_remembered_bounds_need_no_copy(monkeypatch):
    copies = count_copies(monkeypatch)
    cu = torch.tensor([0, 4, 8, 9], dtype=torch.int32)
    remember_host_bounds(cu, [0, 4, 8, 9])
    assert host_bounds(cu) == [0, 4, 8, 9] and not copies
    del cu  # a dead tensor's copy is never returned for a new one
    fresh = torch.tensor([0, 1, 9], dtype=torch.int32)
    assert host_bounds(fresh) == [0, 1, 9] and len(copies) == 1
