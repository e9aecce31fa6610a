"""Checkpoints are layout-independent: dp_shard=2 x tp=2 <-> one process (SPEC 3).

One process trains a step and saves; four ranks (FSDP2 over dp_shard, TP over tp) resume it
and must produce the single-process next-step loss. Four ranks train a step and save; one
process resumes it and must produce the four-rank next-step loss. Model, AdamW state and QB
biases all travel through the checkpoint (the next step's routing uses the saved biases).
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.checkpoint import CheckpointManager
from moe_lc.model.init import build_model
from moe_lc.presets import get_preset
from moe_lc.train.balancer_state import pack_balancer_state
from parallel_harness import make_samples, pack, rank_micro_batches, run_distributed, train_step

LAYOUT = dict(dp_shard=2, tp=2)
LR, EPS = 1e-3, 1e-4


def samples(step: int) -> list:
    return make_samples(4, 16, 512, seed=200 + step)


def fresh_model():
    return pack_balancer_state(build_model(get_preset("tiny"), "cpu", seed=0))


def parallel_side(single_ckpt: str, parallel_root: str) -> dict:
    """Resume the single-process checkpoint; separately, train + save + continue on this layout."""
    from moe_lc.parallel import ParallelLayout, build_mesh, build_optimizer, data_parallel_info, parallelize

    layout = ParallelLayout(**LAYOUT)
    mesh = build_mesh(layout)
    dp_rank, dp_size = data_parallel_info(mesh)

    def parallel_model():
        model = parallelize(fresh_model(), layout, mesh)
        return model, build_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS)

    model, optimizer = parallel_model()
    manager = CheckpointManager(single_ckpt)
    trainer_state, _ = manager.load(None, model, optimizer)
    resumed = train_step(model, optimizer, rank_micro_batches(samples(1), dp_rank, dp_size, 1), mesh)

    model, optimizer = parallel_model()
    train_step(model, optimizer, rank_micro_batches(samples(0), dp_rank, dp_size, 1), mesh)
    CheckpointManager(parallel_root).save(1, {"model": model, "optim": optimizer, "trainer": {"step": 1}})
    continued = train_step(model, optimizer, rank_micro_batches(samples(1), dp_rank, dp_size, 1), mesh)
    return dict(resumed=resumed, continued=continued, trainer=trainer_state)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:checkpoint .* was written by 4 ranks")
def test_checkpoint_moves_between_one_process_and_dp2_tp2(tmp_path):
    single_root, parallel_root = str(tmp_path / "single"), str(tmp_path / "parallel")

    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    train_step(model, optimizer, [pack(samples(0))])
    CheckpointManager(single_root).save(1, {"model": model, "optim": optimizer, "trainer": {"step": 1}, "rng": None})
    single_next = train_step(model, optimizer, [pack(samples(1))])

    ranks = run_distributed(parallel_side, 4, single_root, parallel_root, timeout=80)

    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer_state, _ = CheckpointManager(parallel_root).load(None, model, optimizer)
    from_parallel_next = train_step(model, optimizer, [pack(samples(1))])

    for rank, r in enumerate(ranks):
        assert r["trainer"] == {"step": 1}
        assert abs(r["resumed"] - single_next) / single_next < 1e-5, (
            f"rank {rank}: one-process checkpoint resumed on {LAYOUT} gives next-step loss {r['resumed']}, "
            f"one process gives {single_next}"
        )
        assert r["continued"] == ranks[0]["continued"]
    assert trainer_state == {"step": 1}
    assert abs(from_parallel_next - ranks[0]["continued"]) / ranks[0]["continued"] < 1e-5, (
        f"{LAYOUT} checkpoint resumed on one process gives next-step loss {from_parallel_next}, "
        f"the parallel run continued with {ranks[0]['continued']}"
    )
    # and the two routes agree with each other (same data, same seed)
    assert abs(from_parallel_next - single_next) / single_next < 1e-5
