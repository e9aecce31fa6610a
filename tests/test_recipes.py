"""Recipes compose and validate; the curriculum and layout arithmetic; clear errors for bad names."""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

import pytest

from moe_lc.config import ConfigError
from moe_lc.model.accounting import count_parameters
from moe_lc.train.curriculum import next_step_to_run, plan_curriculum, stage_at, total_steps
from moe_lc.train.layout import resolve_layout
from moe_lc.train.config import LayoutConfig
from moe_lc.train.main import run_train_cli
from moe_lc.train.plan import estimate_stage, plan_text
from moe_lc.train.recipes import available_options, available_recipes, compose_recipe, recipes_dir

SHIPPED = {"smoke", "proxy-8k", "proxy-64k", "proxy-256k", "proxy-1m", "proxy-curriculum",
           "k3-8k", "k3-64k", "k3-256k", "k3-1m"}


def test_shipped_recipes_and_groups_exist():
    assert SHIPPED <= set(available_recipes())
    assert {"tiny", "proxy", "kimi-linear-48b", "k3"} <= set(available_options("model"))
    assert {"smoke", "proxy", "k3"} <= set(available_options("curriculum"))
    assert {"default", "passkey-mix", "custom"} <= set(available_options("data"))
    assert {"single", "dp2", "tp2"} <= set(available_options("layout"))


def test_recipes_ship_inside_the_package():
    """The default lookup is the installed package moe_lc_recipes, and pyproject's package-data
    globs cover every recipe file, so a wheel install (no source tree) finds them all."""
    import moe_lc_recipes

    tomllib = pytest.importorskip("tomllib")
    root = recipes_dir()
    assert root == Path(moe_lc_recipes.__file__).resolve().parent
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["moe_lc_recipes"]
    files = [p.relative_to(root).as_posix() for p in root.rglob("*.yaml")]
    assert len(files) > len(SHIPPED)
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)] == []


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_every_recipe_composes_validates_and_plans(recipe):
    cfg = compose_recipe(recipe)
    world = cfg.layout.world_size or 1
    plans = plan_curriculum(cfg, world)
    assert [p.name for p in plans] == list(cfg.curriculum.stages)
    for p in plans:  # every layout multiplies out to the world it is meant for
        L = p.layout
        assert L.pp * L.dp_replicate * L.dp_shard * L.cp * L.tp == world
        assert p.sequences_per_step == p.micro_batch * p.grad_accum * L.dp
    text = plan_text(cfg, world)
    for p in plans:
        assert p.name in text
    assert "memory per GPU" in text


def test_stage_recipes_select_their_stage_and_share_one_schedule():
    full = compose_recipe("proxy-curriculum")
    only = compose_recipe("proxy-64k")
    assert only.curriculum.run == ["ctx64k"] and full.curriculum.run is None
    plans_full, plans_only = plan_curriculum(full, 8), plan_curriculum(only, 8)
    assert total_steps(plans_full) == total_steps(plans_only)  # one LR schedule over the whole curriculum
    assert [p.run for p in plans_only] == [False, True, False, False]
    assert next_step_to_run(plans_only, 0) == plans_only[1].start_step


def test_curriculum_arithmetic_matches_definitions():
    cfg = compose_recipe("smoke", ["curriculum.stages.ctx1k.steps=null", "curriculum.stages.ctx1k.tokens=10000"])
    plans = plan_curriculum(cfg, 1)
    start = 0
    for p, (name, st) in zip(plans, cfg.curriculum.stages.items()):
        assert p.start_step == start
        expected_steps = st.steps if st.steps is not None else math.ceil(st.tokens / st.global_batch_tokens)
        assert p.steps == expected_steps
        assert p.grad_accum == st.global_batch_tokens // (st.micro_batch * st.seq_len * 1)
        start += expected_steps
    assert plans[1].steps == math.ceil(10000 / 4096)
    assert total_steps(plans) == start
    assert stage_at(plans, plans[2].start_step).name == plans[2].name
    assert stage_at(plans, start) is None


def test_every_field_is_overridable_from_the_command_line():
    cfg = compose_recipe("smoke", [
        "model.moe.num_routed=16", "model.d_model=96", "optim.lr=0.01", "optim.betas=[0.8,0.9]",
        "curriculum.stages.ctx1k.micro_batch=4", "layout.tp=1", "data.tokenizer=byte", "checkpoint.keep_last=5",
        "logging.progress=lines", "eval.sequences=3", "seed=7", "run_dir=/tmp/x",
    ])
    assert cfg.model.moe.num_routed == 16 and cfg.model.d_model == 96
    assert cfg.optim.lr == 0.01 and tuple(cfg.optim.betas) == (0.8, 0.9)
    assert cfg.curriculum.stages["ctx1k"].micro_batch == 4
    assert (cfg.checkpoint.keep_last, cfg.logging.progress, cfg.eval.sequences, cfg.seed) == (5, "lines", 3, 7)
    assert cfg.run_dir == "/tmp/x"
    assert compose_recipe("smoke").run_dir == "runs/smoke"  # interpolated from the recipe name


@pytest.mark.parametrize(
    "recipe, overrides, expected",
    [
        ("no-such-recipe", [], ["unknown recipe 'no-such-recipe'", "smoke", "k3-8k"]),
        ("smoke", ["curriculum.run=[ctx2k]"], ["unknown stage 'ctx2k'", "ctx256", "ctx16k"]),
        ("smoke", ["model=huge"], ["unknown model 'huge'", "tiny", "k3"]),
        ("smoke", ["layout=nope"], ["unknown layout 'nope'", "single"]),
        ("smoke", ["data=custom"], ["data.sources"]),
        ("smoke", ["model.no_such_field=1"], ["no_such_field"]),
        ("smoke", ["optim.lr=fast"], ["optim.lr", "fast"]),
        ("smoke", ["curriculum.stages.ctx256.tokens=100"], ["exactly one of steps and tokens"]),
        ("smoke", ["model.moe.top_k=8"], ["moe.top_k"]),
    ],
)
def test_bad_names_and_values_give_clear_errors(recipe, overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_recipe(recipe, overrides)
    for text in expected:
        assert text in str(info.value)


def test_batch_that_does_not_split_is_rejected_with_a_fix():
    cfg = compose_recipe("smoke", ["curriculum.stages.ctx1k.global_batch_tokens=3000"])
    with pytest.raises(ConfigError, match="multiple of seq_len"):
        plan_curriculum(cfg, 1)
    cfg = compose_recipe("smoke", ["curriculum.stages.ctx1k.micro_batch=3"])
    with pytest.raises(ConfigError, match="micro_batch"):
        plan_curriculum(cfg, 1)


def test_layout_resolution_and_world_size_checks():
    tiny = compose_recipe("smoke").model
    r = resolve_layout(LayoutConfig(tp=2, dp_shard=-1), 8, tiny)
    assert (r.dp_shard, r.dp, r.world_size) == (4, 4, 8)
    with pytest.raises(ConfigError, match="world has 8"):
        resolve_layout(LayoutConfig(dp_shard=2), 8, tiny)
    with pytest.raises(ConfigError, match="ep=3"):
        resolve_layout(LayoutConfig(dp_shard=-1, ep=3), 6, tiny)
    with pytest.raises(ConfigError, match="tp=4"):  # tiny has 2 heads
        resolve_layout(LayoutConfig(dp_shard=-1, tp=4), 4, tiny)
    # the smoke recipe on a 2-rank world: dp doubles, accumulation halves
    bigger = ["curriculum.stages.ctx16k.global_batch_tokens=32768"]
    with pytest.raises(ConfigError, match="dp=2"):  # one 16K sequence per step cannot feed two ranks
        plan_curriculum(compose_recipe("smoke", ["layout=dp2"]), 2)
    one = plan_curriculum(compose_recipe("smoke", bigger), 1)
    two = plan_curriculum(compose_recipe("smoke", ["layout=dp2", *bigger]), 2)
    assert [2 * b.grad_accum for b in two] == [a.grad_accum for a in one]


def test_memory_estimate_state_term_is_sixteen_bytes_per_parameter_over_the_shards():
    cfg = compose_recipe("k3-8k")
    plan = plan_curriculum(cfg, 4096)[0]
    est = estimate_stage(compose_recipe("k3-8k", ["optim=adamw"]), plan)
    params = count_parameters(cfg.model).total
    assert est.state_gib == pytest.approx(params * 16 / plan.layout.state_shards / 2**30)
    assert est.activations_recompute_gib < est.activations_gib


def test_cli_plan_only_prints_the_plan_and_rejects_unknown_names(capsys):
    assert run_train_cli(["recipe=k3-8k", "plan_only=true"]) == 0
    out = capsys.readouterr().out
    assert "ctx8k" in out and "4096" in out and "memory per GPU" in out
    assert run_train_cli(["recipe=k3-9k", "plan_only=true"]) == 2
    assert "available recipes" in capsys.readouterr().err
    assert run_train_cli(["--bogus"]) == 2
