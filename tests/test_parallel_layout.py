"""Layout validation, mesh construction and fail-fast behaviour (SPEC 3)."""

from __future__ import annotations

import time

import pytest
import torch

from moe_lc.config import ConfigError
from moe_lc.parallel import ParallelLayout, build_mesh
from moe_lc.presets import get_preset
from parallel_harness import run_distributed


def tiny():
    return get_preset("tiny")


@pytest.mark.parametrize(
    "layout, world, needles",
    [
        (dict(tp=2, dp_shard=2), 8, ["needs 4 ranks", "world has 8", "dp_shard=4"]),
        (dict(tp=3), 3, ["kda.num_heads=2", "tp=3"]),
        (dict(ep=3, dp_shard=3), 3, ["num_routed=8", "ep=3"]),
        (dict(ep=4, dp_shard=2), 2, ["ep=4", "dp_shard*cp*tp=2*1*1=2"]),
        (dict(tp=2, sequence_parallel=False), 2, ["sequence_parallel=true"]),
        (dict(pp=2), 2, ["pipeline parallelism is not implemented"]),
        (dict(cp=2), 2, ["context parallelism is not implemented"]),
        (dict(dp_mode="zero3"), 1, ["dp_mode='zero3'", "fsdp, zero1"]),
        (dict(tp=0), 1, ["parallel.tp=0"]),
    ],
)
def test_invalid_layouts_name_the_numbers_and_the_fix(layout, world, needles):
    with pytest.raises(ConfigError) as err:
        ParallelLayout(**layout).validate(tiny(), world_size=world)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_tensor_parallel_divisibility_of_model_sizes():
    cfg = tiny()
    cfg.mla.num_heads = 3
    cfg.kda.num_heads = 4
    with pytest.raises(ConfigError, match=r"mla.num_heads=3 is not divisible by tp=2"):
        ParallelLayout(tp=2).validate(cfg, world_size=2)
    cfg = tiny()
    cfg.vocab_multiple = 1
    cfg.vocab_size = 511
    with pytest.raises(ConfigError, match=r"padded vocabulary 511 .* not divisible by tp=2; set vocab_multiple"):
        ParallelLayout(tp=2).validate(cfg, world_size=2)
    cfg = tiny()
    cfg.moe.expert_hidden = 63
    with pytest.raises(ConfigError, match=r"shared expert hidden .*=63 is not divisible by tp=2"):
        ParallelLayout(tp=2).validate(cfg, world_size=2)


def test_layouts_for_the_large_presets_validate_without_any_process_group():
    # planning on a laptop: k3 on 1024 ranks, experts over 64 ranks folded over dp_shard x tp
    k3 = get_preset("k3")
    layout = ParallelLayout(dp_replicate=2, dp_shard=64, tp=8, ep=64).validate(k3, world_size=1024)
    assert (layout.edp, layout.dp) == (8, 128)
    ParallelLayout(dp_shard=16, tp=4, ep=32).validate(get_preset("kimi-linear-48b"), world_size=64)
    with pytest.raises(ConfigError, match="ep=7"):
        ParallelLayout(dp_shard=14, tp=8, ep=7).validate(k3, world_size=112)


def test_build_mesh_without_a_process_group_says_how_to_launch():
    with pytest.raises(ConfigError, match="torchrun"):
        build_mesh(ParallelLayout(tp=2))


def mesh_and_failures() -> dict:
    """Worker (4 ranks): mesh/group facts, then misconfigurations that must raise, not hang."""
    import torch.distributed as dist

    from moe_lc.model.init import build_model
    from moe_lc.parallel import (
        balance_group,
        build_expert_mesh,
        data_parallel_info,
        parallelize,
    )

    out: dict = {}
    layout = ParallelLayout(dp_shard=2, tp=2, ep=2)
    mesh = build_mesh(layout)
    experts = build_expert_mesh(layout, mesh)
    out["tp_group"] = dist.get_process_group_ranks(mesh.get_group("tp"))
    out["ep_group"] = dist.get_process_group_ranks(experts.get_group("ep"))
    out["edp_group"] = dist.get_process_group_ranks(experts.get_group("edp"))
    out["dp_info"] = data_parallel_info(mesh)
    out["balance_group"] = dist.get_process_group_ranks(balance_group(mesh))
    wide = ParallelLayout(dp_shard=4, ep=2)
    out["ep_group_dp"] = dist.get_process_group_ranks(build_expert_mesh(wide, build_mesh(wide)).get_group("ep"))

    errors, seconds = [], []

    def expect_failure(kind, call):
        start = time.monotonic()
        try:
            call()
        except kind as err:
            errors.append(str(err))
        seconds.append(time.monotonic() - start)

    expect_failure(ConfigError, lambda: build_mesh(ParallelLayout(tp=2)))
    expect_failure(ConfigError, lambda: build_mesh(ParallelLayout(dp_shard=2, tp=2, ep=3)))
    cfg = get_preset("tiny")
    cfg.kda.num_heads = 3  # cannot split 3 heads over tp=2
    model = build_model(cfg, "cpu", seed=0)
    expect_failure(ConfigError, lambda: parallelize(model, layout, mesh))
    model = parallelize(build_model(get_preset("tiny"), "cpu", seed=0), layout, mesh)
    # 15 tokens cannot be split over tp=2 sequence shards
    expect_failure(ValueError, lambda: model(torch.zeros(1, 15, dtype=torch.long)))
    dist.barrier()  # the process group is still healthy after all of that
    out["errors"], out["seconds"] = errors, seconds
    return out


@pytest.mark.timeout(120)
def test_mesh_groups_and_misconfigurations_fail_fast_on_four_ranks():
    ranks = run_distributed(mesh_and_failures, 4, timeout=90)
    r0, r1, r2, r3 = ranks
    # dense mesh is row-major with tp innermost; ep=2 over tp=2 coincides with the tp group
    assert (r0["tp_group"], r3["tp_group"]) == ([0, 1], [2, 3])
    assert (r0["ep_group"], r2["ep_group"]) == ([0, 1], [2, 3])
    assert (r0["edp_group"], r1["edp_group"]) == ([0, 2], [1, 3])
    assert [r["dp_info"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert r0["balance_group"] == [0, 1, 2, 3]  # every rank routes its own tokens (dp x tp)
    assert (r0["ep_group_dp"], r3["ep_group_dp"]) == ([0, 1], [2, 3])  # ep borrows neighbouring dp ranks
    for r in ranks:
        errors = r["errors"]
        assert len(errors) == 4, errors
        assert "needs 2 ranks but the world has 4" in errors[0] and "dp_shard=2" in errors[0]
        assert "ep=3" in errors[1]
        assert "kda.num_heads=3" in errors[2]
        assert "15 tokens" in errors[3] and "multiple of tp=2" in errors[3]
        # a collective left waiting would only give up after the 60 s process-group timeout
        assert max(r["seconds"]) < 20, r["seconds"]
