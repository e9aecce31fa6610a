"""Layout resolution and validation, mesh construction and fail-fast behaviour."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from moe_lc.config import ConfigError
from moe_lc.parallel import ParallelLayout, build_mesh
from moe_lc.parallel.layout import DPMode, ParamDType
from moe_lc.presets import get_preset
from parallel_harness import run_distributed


def tiny():
    return get_preset("tiny")


@pytest.mark.parametrize(
    "layout, world, needles",
    [
        (dict(tp=2, dp_shard=2), 8, ["needs 4 ranks", "world has 8", "dp_shard=4"]),
        (dict(world_size=8), 2, ["layout.world_size=8", "world has 2", "layout.world_size=null"]),
        (dict(tp=3), 8, ["pp*dp_replicate*tp", "= 3 does not divide", "8 rank(s)"]),
        (dict(cp=3, world_size=8), 8, ["layout.cp=3", "= 3 does not divide"]),
        (dict(tp=0), 1, ["layout.tp=0 must be a positive integer"]),
        (dict(dp_shard=0), 1, ["layout.dp_shard=0", "or -1 (fill the world)"]),
        (dict(world_size=0), 1, ["layout.world_size=0", "or null"]),
    ],
)
def test_resolve_errors_name_the_field_and_the_fix(layout, world, needles):
    with pytest.raises(ConfigError) as err:
        ParallelLayout(**layout).resolve(world)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "layout, world, needles",
    [
        (dict(tp=3), 3, ["kda.num_heads=2", "tp=3"]),
        (dict(ep=3, dp_shard=3), 3, ["num_routed=8", "ep=3"]),
        (dict(ep=4, dp_shard=2), 2, ["layout.ep=4", "dp_shard*cp*tp=2*1*1=2"]),
        (dict(tp=2, sequence_parallel=False), 2, ["sequence_parallel=true"]),
        (dict(dp_shard=2, dp_mode="zero1", fsdp_reduce_every_micro_batch=True), 2,
         ["fsdp_reduce_every_micro_batch=true needs dp_mode=fsdp"]),
        (dict(pp=8), 8, ["layout.pp=8 x 1 stage(s) per rank = 8 pipeline stages exceed the model's 5 layers"]),
        (dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=3), 2, ["pp_schedule=zbv runs 2 stage(s) per rank",
                                                                 "pp_stages_per_rank=2"]),
        (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=1), 2, ["runs at least 2 stage(s)"]),
        (dict(pp=2, pp_stage_layers=[2, 2]), 2, ["pp_stage_layers=[2, 2] must list 2 positive layer counts",
                                                 "summing to the model's 5 layers"]),
        (dict(pp=2, pp_schedule="zbv", pp_stage_layers=[2, 3]), 2, ["must list 4 positive layer counts"]),
    ],
)
def test_invalid_layouts_name_the_numbers_and_the_fix(layout, world, needles):
    with pytest.raises(ConfigError) as err:
        ParallelLayout(**layout).resolve(world).validate(tiny())
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_bad_choices_name_the_field_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"layout.dp_mode='zero3': use one of fsdp, zero1"):
        ParallelLayout(dp_mode="zero3")
    with pytest.raises(ConfigError, match=r"layout.param_dtype='fp16': use one of auto, float32, bfloat16"):
        ParallelLayout(param_dtype="fp16")
    layout = ParallelLayout(dp_mode="zero1", param_dtype="bfloat16")
    assert layout.dp_mode is DPMode.zero1 and layout.param_dtype is ParamDType.bfloat16
    assert layout.dp_mode == "zero1" and f"{layout.param_dtype}" == "bfloat16"


def test_an_unpinned_layout_fits_cp_and_ep_to_the_world():
    """cp, then ep, become the largest divisor of the asked value that the world allows."""
    asked = ParallelLayout(cp=8, ep=8)
    for world in (1, 2, 3, 4, 6, 8, 16):
        got = asked.resolve(world)
        cp = max(c for c in range(1, 9) if 8 % c == 0 and world % c == 0)
        ep = max(e for e in range(1, 9) if 8 % e == 0 and (world // cp * cp) % e == 0)
        assert (got.cp, got.dp_shard, got.ep, got.world_size) == (cp, world // cp, ep, world), world
        assert got.resolve(world) == got  # a resolved layout is pinned: resolving again changes nothing
    assert ParallelLayout(tp=2, ep=8).resolve(4).ep == 4  # ep folds over dp_shard x cp x tp
    assert asked.resolve(2).lowered_from(asked) == ["cp 8 -> 2", "ep 8 -> 2"]
    assert asked.resolve(8).lowered_from(asked) == []


def test_a_pinned_layout_is_taken_as_written():
    with pytest.raises(ConfigError, match="ep=8 must divide dp_shard"):
        ParallelLayout(ep=8, dp_shard=2).resolve(2).validate()
    with pytest.raises(ConfigError, match="needs 8 ranks but the world has 2"):
        ParallelLayout(cp=8, dp_shard=1).resolve(2)
    pinned = ParallelLayout(cp=2, ep=8, world_size=8).resolve(8)
    assert (pinned.cp, pinned.dp_shard, pinned.ep) == (2, 4, 8)
    with pytest.raises(ConfigError, match="layout.world_size=8 but the world has 2"):
        ParallelLayout(ep=8, world_size=8).resolve(2)


def test_resolved_layout_quantities_and_serialisation():
    layout = ParallelLayout(pp=2, dp_replicate=2, cp=2, tp=2, ep=4, dp_mode="zero1", gpus_per_node=4).resolve(32)
    assert (layout.dp_shard, layout.dp, layout.edp, layout.state_shards) == (2, 4, 2, 16)
    assert layout.mesh_shape() == (2, 2, 2, 2, 2) and math.prod(layout.mesh_shape()) == 32
    assert layout.expert_mesh_shape() == (2, 2, 2, 4)
    assert layout.describe() == ("pp=2 dp_replicate=2 dp_shard=2 cp=2 tp=2 ep=4 (world 32, 8 nodes; pipeline "
                                 "one_f_one_b, 2 stages)")
    assert str(layout) == "pp=2 x dp_replicate=2 x dp_shard=2 x cp=2 x tp=2 x ep=4 (zero1)"
    saved = json.loads(json.dumps(layout.as_dict()))  # what a checkpoint's trainer state holds
    assert saved["dp_mode"] == "zero1" and saved["param_dtype"] == "auto" and saved["world_size"] == 32
    assert ParallelLayout(**saved) == layout
    assert ParallelLayout(**{**saved, "gpus_per_node": 8}) == layout  # planning only: not part of equality
    assert ParallelLayout(**{**saved, "ep": 2}) != layout
    assert saved["pp_schedule"] == "one_f_one_b" and saved["pp_stage_layers"] is None
    layout.validate(tiny(), seq_len=64)  # pp x dp_replicate x dp_shard x cp x tp x ep all run together
    with pytest.raises(ConfigError, match="seq_len=30 divisible by 2\\*cp"):
        layout.validate(tiny(), seq_len=30, runnable=False)
    with pytest.raises(ConfigError, match="cp=2 x tp=4 needs seq_len=36 divisible by cp\\*tp"):
        ParallelLayout(cp=2, tp=4).resolve(8).validate(seq_len=36)  # each cp rank's 18 tokens do not split over tp
    ParallelLayout(cp=2).resolve(2).validate(tiny(), seq_len=64)  # context parallelism runs
    ParallelLayout(pp=2).resolve(2).validate(tiny(), seq_len=64)  # and so does pipeline parallelism
    with pytest.raises(ConfigError, match="= 8 pipeline stages exceed the model's 5 layers"):
        ParallelLayout(pp=8).resolve(8).validate(tiny(), runnable=False)


def test_an_unresolved_layout_refuses_what_needs_the_world():
    for use in (lambda L: L.dp, lambda L: L.mesh_shape(), lambda L: L.describe(), lambda L: L.validate()):
        with pytest.raises(ConfigError, match=r"call layout.resolve\(world_size\) first"):
            use(ParallelLayout(tp=2))
    with pytest.raises(ConfigError, match="resolve"):  # degrees that do not multiply out to world_size
        ParallelLayout(dp_shard=2, world_size=4).validate()


def test_tensor_parallel_divisibility_of_model_sizes():
    cfg = tiny()
    cfg.mla.num_heads = 3
    cfg.kda.num_heads = 4
    with pytest.raises(ConfigError, match=r"mla.num_heads=3 is not divisible by tp=2"):
        ParallelLayout(tp=2).resolve(2).validate(cfg)
    cfg = tiny()
    cfg.vocab_multiple = 1
    cfg.vocab_size = 511
    with pytest.raises(ConfigError, match=r"padded vocabulary 511 .* not divisible by tp=2; set vocab_multiple"):
        ParallelLayout(tp=2).resolve(2).validate(cfg)
    cfg = tiny()
    cfg.moe.expert_hidden = 63
    with pytest.raises(ConfigError, match=r"shared expert hidden .*=63 is not divisible by tp=2"):
        ParallelLayout(tp=2).resolve(2).validate(cfg)


def test_layouts_for_the_large_presets_validate_without_any_process_group():
    # planning on a laptop: k3 on 1024 ranks, experts over 64 ranks folded over dp_shard x tp
    k3 = get_preset("k3")
    layout = ParallelLayout(dp_replicate=2, tp=8, ep=64, world_size=1024).resolve(1024).validate(k3)
    assert (layout.dp_shard, layout.edp, layout.dp) == (64, 8, 128)
    ParallelLayout(dp_shard=16, tp=4, ep=32).resolve(64).validate(get_preset("kimi-linear-48b"))
    with pytest.raises(ConfigError, match="ep=7"):
        ParallelLayout(dp_shard=14, tp=8, ep=7).resolve(112).validate(k3)


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
    layout = ParallelLayout(tp=2, ep=2)  # dp_shard=-1: filled from the 4 ranks
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

    expect_failure(ConfigError, lambda: build_mesh(ParallelLayout(tp=2, dp_shard=1)))
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
