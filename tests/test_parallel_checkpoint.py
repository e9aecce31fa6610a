"""Checkpoints are layout-independent: dp_shard=2 x tp=2 (and ZeRO-1, EP) <-> one process (docs/design.md §8.7).

One process trains a step and saves; the ranks of a layout (e.g. FSDP2 over dp_shard, TP over tp) resume it
and must produce the single-process next-step loss. The four ranks then save after their step
and train one more; one process resumes their checkpoint and must produce that loss. Model, AdamW state and QB
biases all travel through the checkpoint (the next step's routing uses the saved biases), and so does each
balancer's extra state (a dict of tensors, replicated on every rank), entry by entry.

In float64: the routes differ only in summation order, so their losses agree to rounding (~1e-16). In
fp32 a rounding-level difference can flip a token's expert and move the loss far beyond rounding.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.checkpoint import CheckpointManager
from moe_lc.model.init import build_model
from moe_lc.presets import get_preset
from parallel_harness import make_samples, pack, rank_micro_batches, run_distributed, train_step

LAYOUTS = [dict(dp_shard=2, tp=2), dict(dp_shard=2, dp_mode="zero1"), dict(dp_shard=2, ep=2)]
LR, EPS = 1e-3, 1e-4
RTOL = 1e-10  # float64 routes that differ only in summation order


def samples(step: int) -> list:
    return make_samples(4, 16, 512, seed=200 + step)


def fresh_model():
    return build_model(get_preset("tiny"), "cpu", seed=0, dtype=torch.float64)


def balancer_states(model) -> list[dict[str, list]]:
    """Every MoE layer's balancer extra state, as plain lists (comparable across processes)."""
    return [{k: v.tolist() for k, v in moe.balancer.get_extra_state().items()} for moe in model.moe_layers()]


def parallel_side(layout_kwargs: dict, single_root: str, parallel_root: str) -> dict:
    """Resume the one-process checkpoint (step 1), train step 2, save it, train step 3."""
    from moe_lc.parallel import ParallelLayout, build_mesh, build_optimizer, data_parallel_info, parallelize

    layout = ParallelLayout(**layout_kwargs)
    mesh = build_mesh(layout)
    dp_rank, dp_size = data_parallel_info(mesh)
    model = parallelize(fresh_model(), layout, mesh)
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS)
    trainer_state, _ = CheckpointManager(single_root).load(None, model, optimizer)
    loaded_balancers = balancer_states(model)
    resumed = train_step(model, optimizer, rank_micro_batches(samples(1), dp_rank, dp_size, 1), mesh)
    CheckpointManager(parallel_root).save(2, {"model": model, "optim": optimizer, "trainer": {"step": 2}})
    saved_balancers = balancer_states(model)
    continued = train_step(model, optimizer, rank_micro_batches(samples(2), dp_rank, dp_size, 1), mesh)
    return dict(resumed=resumed, continued=continued, trainer=trainer_state, loaded_balancers=loaded_balancers,
                saved_balancers=saved_balancers)


@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:checkpoint .* was written by 4 ranks")
@pytest.mark.filterwarnings("ignore:checkpoint .* was written by 2 ranks")
@pytest.mark.filterwarnings("ignore:checkpoint .* was written by 1 ranks")
@pytest.mark.parametrize("LAYOUT", LAYOUTS, ids=["dp2xtp2", "zero1_dp2", "dp2xep2"])
def test_checkpoint_moves_between_one_process_and_a_layout(tmp_path, LAYOUT):
    single_root, parallel_root = str(tmp_path / "single"), str(tmp_path / "parallel")

    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    train_step(model, optimizer, [pack(samples(0))])
    CheckpointManager(single_root).save(1, {"model": model, "optim": optimizer, "trainer": {"step": 1}, "rng": None})
    single_balancers = balancer_states(model)
    single_losses = [train_step(model, optimizer, [pack(samples(s))]) for s in (1, 2)]

    world = LAYOUT.get("dp_shard", 1) * LAYOUT.get("tp", 1)
    ranks = run_distributed(parallel_side, world, LAYOUT, single_root, parallel_root, timeout=100)

    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    trainer_state, _ = CheckpointManager(parallel_root).load(None, model, optimizer)
    balancers_from_parallel = balancer_states(model)
    from_parallel = train_step(model, optimizer, [pack(samples(2))])

    assert trainer_state == {"step": 2}
    for rank, r in enumerate(ranks):
        assert r["trainer"] == {"step": 1}
        assert (r["resumed"], r["continued"]) == (ranks[0]["resumed"], ranks[0]["continued"])
        assert r["loaded_balancers"] == single_balancers, f"rank {rank} loaded other balancer state"
        assert r["saved_balancers"] == ranks[0]["saved_balancers"]  # replicated: the same on every rank
    # The saved histogram range is the one of step 2's (non-zero) bias, not the fresh model's [-1, 1].
    assert all(b["hist_range"] != [-1.0, 1.0] for b in ranks[0]["saved_balancers"])
    assert balancers_from_parallel == ranks[0]["saved_balancers"]
    resumed, continued = ranks[0]["resumed"], ranks[0]["continued"]
    assert abs(resumed - single_losses[0]) / single_losses[0] < RTOL, (
        f"a one-process checkpoint resumed on {LAYOUT} gives next-step loss {resumed}, one process {single_losses[0]}"
    )
    assert abs(from_parallel - continued) / continued < RTOL, (
        f"a {LAYOUT} checkpoint resumed on one process gives next-step loss {from_parallel}, "
        f"the {LAYOUT} run continued with {continued}"
    )
    assert abs(from_parallel - single_losses[1]) / single_losses[1] < RTOL  # all routes agree
