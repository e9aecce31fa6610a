"""The stage-end evaluation under context and pipeline parallelism equals one process's: loss by
position and passkey retrieval, with every cp rank running its zigzag shard of each row, and the
rows going forward through a pipeline's stages (gloo ranks, float64: the runs differ only in
summation order)."""

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


def _evaluate(layout: dict) -> dict:
    """Worker (or, with an empty layout, one process): evaluate the tiny model with MTP, in float64."""
    model = build_model(tiny(mtp=True), "cpu", seed=0, dtype=torch.float64)
    context = pipeline = None
    if layout:
        from moe_lc.parallel import ParallelLayout, build_mesh, parallel_context, parallelize
        from moe_lc.parallel.context import ContextShard

        resolved = ParallelLayout(**layout)
        mesh = build_mesh(resolved)
        model = parallelize(model, resolved, mesh, seq_len=SEQ_LEN)
        pipeline = parallel_context(model).pipeline
        if resolved.cp > 1:
            def context(row: int) -> ContextShard:
                return ContextShard.from_mesh(mesh, row)

    return evaluate_stage(model, _dataset(), SEQ_LEN, 3, 2, torch.device("cpu"), context=context, pipeline=pipeline)


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _evaluate({})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, layout", [
    (2, dict(cp=2, dp_shard=1)),
    (2, dict(pp=2, dp_shard=1)),
    (4, dict(pp=2, cp=2, dp_shard=1, pp_schedule="interleaved_1f1b", pp_stage_layers=[1, 1, 2, 1])),
], ids=["cp2", "pp2", "pp2xcp2-interleaved"])
def test_evaluation_under_cp_and_pp_equals_one_process(world, layout, one_process):
    want = one_process
    got = run_distributed(_evaluate, world, layout)
    assert all(g == got[0] for g in got)  # every rank has the whole result
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
