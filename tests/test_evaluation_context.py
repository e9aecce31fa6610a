"""The stage-end evaluation under context parallelism equals one process's: loss by position and
passkey retrieval, with every cp rank running its zigzag shard of each row (two gloo ranks, float64:
the runs differ only in summation order)."""

from __future__ import annotations

import pytest
import torch

from configs import tiny
from moe_lc.data import Sample
from moe_lc.model.init import build_model
from moe_lc.train.evaluation import evaluate_stage
from parallel_harness import make_samples, run_distributed

SEQ_LEN = 128


def _dataset() -> list[Sample]:
    """Held-out rows of two documents each, some labels ignored."""
    samples = []
    for ids, labels, lengths in make_samples(3, SEQ_LEN, 258, seed=11):
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        samples.append(Sample(ids, labels, cu))
    return samples


def _evaluate(cp: int) -> dict:
    """Worker (or, with cp=1, one process): evaluate the tiny model with MTP off, in float64."""
    model = build_model(tiny(), "cpu", seed=0, dtype=torch.float64)
    context = None
    if cp > 1:
        from moe_lc.parallel import ParallelLayout, build_mesh, parallelize
        from moe_lc.parallel.context import ContextShard

        layout = ParallelLayout(cp=cp, dp_shard=1)
        mesh = build_mesh(layout)
        model = parallelize(model, layout, mesh)

        def context(row: int) -> ContextShard:
            return ContextShard.from_mesh(mesh, row)

    return evaluate_stage(model, _dataset(), SEQ_LEN, 3, 2, torch.device("cpu"), context=context)


@pytest.mark.timeout(100)
def test_evaluation_under_cp_equals_one_process():
    want = _evaluate(1)
    got = run_distributed(_evaluate, 2, 2)
    assert got[0] == got[1]  # every cp rank has the whole result
    result = got[0]
    assert result["tokens"] == want["tokens"] and [b["tokens"] for b in result["buckets"]] == \
        [b["tokens"] for b in want["buckets"]]
    assert result["loss"] == pytest.approx(want["loss"], rel=1e-10)
    for a, b in zip(result["buckets"], want["buckets"]):
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-10), a
    assert result["passkey_loss"] == pytest.approx(want["passkey_loss"], rel=1e-10)
    assert result["passkey_accuracy"] == want["passkey_accuracy"]
