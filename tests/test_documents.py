"""DocumentBounds: device and host boundaries that cannot disagree, and a model path that never
reads the device boundaries back to the host."""

from __future__ import annotations

import pytest
import torch

from host_reads import HostRead, forbid_host_reads, guarded
from moe_lc.model.init import build_model
from moe_lc.ops.documents import DocumentBounds, as_document_bounds
from moe_lc.presets import get_preset


# ----------------------------------------------------------------------------- construction
@pytest.mark.parametrize("source", [[0, 3, 10, 11], torch.tensor([0, 3, 10, 11]), (0, 3, 10, 11)])
def test_from_host_uploads_a_fresh_int32_copy(source):
    docs = DocumentBounds.from_host(source, "cpu")
    assert docs.host == (0, 3, 10, 11) and docs.cu_seqlens.dtype == torch.int32
    assert docs.cu_seqlens.tolist() == [0, 3, 10, 11]
    assert (docs.num_docs, docs.total, docs.lengths, docs.max_len) == (3, 11, (3, 7, 1), 7)
    if isinstance(source, torch.Tensor):
        source[1] = 5  # the caller's tensor is not aliased
        assert docs.cu_seqlens.tolist() == [0, 3, 10, 11]


def test_of_reads_the_device_tensor_once_into_a_copy(monkeypatch):
    cu = torch.tensor([0, 4, 9], dtype=torch.int64)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    docs = DocumentBounds.of(cu)
    monkeypatch.undo()
    assert docs.host == (0, 4, 9) and docs.cu_seqlens.dtype == torch.int32
    assert len(reads) == 2  # of() reads its copy once; the constructor compares a CPU copy's content once
    cu[1] = 5  # later in-place changes to the source cannot make device and host disagree
    assert docs.cu_seqlens.tolist() == [0, 4, 9]


def test_inconsistent_device_and_host_boundaries_cannot_be_built():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="differ"):
        DocumentBounds(cu, (0, 4, 10))
    with pytest.raises(ValueError, match="3 entries and host 2"):
        DocumentBounds(cu, (0, 10))
    with pytest.raises(ValueError, match="int32"):
        DocumentBounds(cu.long(), (0, 3, 10))
    with pytest.raises(ValueError, match="1-D integer"):
        DocumentBounds(cu.float(), (0, 3, 10))
    with pytest.raises(ValueError, match="is on meta, not the host"):
        DocumentBounds.from_host(torch.empty(3, dtype=torch.int32, device="meta"), "cpu")


@pytest.mark.parametrize("bounds, message", [
    ([1, 4, 10], "start at 0"),
    ([0], "at least one document"),
    ([0, 6, 4, 10], "strictly increasing"),
    ([0, 4, 4, 10], "strictly increasing"),
])
def test_bad_boundaries_get_one_clear_error(bounds, message):
    with pytest.raises(ValueError, match=message):
        DocumentBounds.from_host(bounds, "cpu")
    with pytest.raises(ValueError, match=message):
        DocumentBounds.of(torch.tensor(bounds))
    with pytest.raises(TypeError, match="integers"):
        DocumentBounds.from_host([0, 2.5, 4], "cpu")
    with pytest.raises(ValueError, match="1-D integer"):
        DocumentBounds.of(torch.tensor([0.0, 4.0]))


def test_ops_accept_bounds_or_a_plain_tensor():
    docs = DocumentBounds.from_host([0, 2, 5], "cpu")
    assert as_document_bounds(docs) is docs and as_document_bounds(None) is None
    assert as_document_bounds(torch.tensor([0, 2, 5])).host == (0, 2, 5)
    with pytest.raises(TypeError, match="DocumentBounds, a cu_seqlens tensor or None"):
        as_document_bounds([0, 2, 5])


# ----------------------------------------------------------------------------- no host reads
def test_the_guard_catches_reads_of_derived_integer_tensors():
    docs = guarded([0, 3, 8])
    with forbid_host_reads():
        ends = docs.cu_seqlens[1:].long() - 1
        for read in (lambda: ends.tolist(), lambda: int(ends[0]), lambda: docs.cu_seqlens.cpu(),
                     lambda: bool(ends.any()), lambda: ends[ends > 2], lambda: torch.zeros(9)[ends[ends > 2]]):
            with pytest.raises(HostRead):
                read()
        assert type(docs.cu_seqlens.float() * 2) is torch.Tensor


def test_model_forward_and_backward_never_read_the_device_boundaries():
    """KDA (short convolutions, the op's checks and chunk layout), MLA's per-document attention and
    the MTP labels take what they need from ``docs.host``; the device tensor is only indexed with."""
    cfg = get_preset("tiny")
    cfg.mtp = True
    model = build_model(cfg.validate(), seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 50), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, 50), generator=g)
    docs = guarded([0, 7, 30, 31, 50])
    with forbid_host_reads():
        out = model(ids, labels=labels, docs=docs, return_logits=False)
        out.loss.backward()
    assert torch.isfinite(out.loss) and out.mtp_loss is not None
