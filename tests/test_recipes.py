"""Recipes compose and validate; the curriculum and layout arithmetic; clear errors for bad names."""

from __future__ import annotations

import fnmatch
import json
import math
import re
import shutil
from pathlib import Path

import pytest

from moe_lc.config import ConfigError
from moe_lc.model.accounting import count_parameters
from moe_lc.train.curriculum import next_step_to_run, plan_curriculum, stage_at, total_steps
from moe_lc.train.main import run_plan_cli, run_train_cli
from moe_lc.train.plan import estimate_stage, plan_text
from moe_lc.train.recipes import available_options, available_recipes, compose_recipe, config_to_dict, recipes_dir

SHIPPED = {"smoke", "proxy-8k", "proxy-64k", "proxy-256k", "proxy-1m", "proxy-curriculum",
           "k3-8k", "k3-64k", "k3-256k", "k3-1m", "k3-small-8k"}


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


def test_every_package_is_listed_for_the_wheel():
    """pyproject lists packages by hand (kernels/ and recipes/ are mapped), and a package left off
    is missing from a wheel install though an editable install still imports it from the tree."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {"moe_lc": "moe_lc", **tool["package-dir"]}
    found = {
        ".".join([top, *init.parent.relative_to(root / where).parts])
        for top, where in dirs.items()
        for init in (root / where).rglob("__init__.py")
    }
    assert sorted(found - set(tool["packages"])) == []


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_every_recipe_composes_validates_and_plans(recipe):
    cfg = compose_recipe(recipe)
    world = cfg.layout.world_size or 1
    plans = plan_curriculum(cfg, world, every_stage=True)
    assert [p.name for p in plans] == list(cfg.curriculum.stages)
    for p in plans:  # every layout multiplies out to the world it is meant for
        L = p.layout
        assert L.pp * L.dp_replicate * L.dp_shard * L.cp * L.tp == world
        assert p.sequences_per_step == p.micro_batch * p.grad_accum * L.dp
    text = plan_text(cfg, world)
    for p in plans:
        assert p.name in text
    assert "memory per GPU" in text


def test_the_plan_says_which_stage_waits_for_the_host_and_which_key_hides_it():
    """The proxy at one 8K row a micro-batch is priced waiting for its host most of the step (measured on
    an H100: the GPU idle 71%, docs/performance.md §12.14); at its recipe's four rows it is not."""
    line = next(x for x in plan_text(compose_recipe("proxy-8k", ["curriculum.stages.ctx8k.micro_batch=1"]), 1)
                .splitlines() if x.startswith("  ctx8k "))
    assert re.search(r"the GPU waits for the host \d+% of it: more rows a micro-batch "
                     r"\(curriculum.stages.ctx8k.micro_batch\) hide that", line), line
    line = next(x for x in plan_text(compose_recipe("proxy-8k"), 1).splitlines() if x.startswith("  ctx8k "))
    assert "waits for the host" not in line


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
    # tp2 does not pin the world: dp_shard fills it
    plans = plan_curriculum(compose_recipe("smoke", ["layout=tp2", "curriculum.stages.ctx16k.global_batch_tokens=32768"]), 4)
    assert [(p.layout.tp, p.layout.dp_shard, p.layout.dp, p.layout.world_size) for p in plans] == [(2, 2, 2, 4)] * 4
    with pytest.raises(ConfigError, match="stage ctx256: layout.world_size=2 but the world has 8"):
        plan_curriculum(compose_recipe("smoke", ["layout=dp2"]), 8)
    with pytest.raises(ConfigError, match="needs 2 ranks but the world has 8"):
        plan_curriculum(compose_recipe("smoke", ["layout=dp2", "layout.world_size=null"]), 8)
    with pytest.raises(ConfigError, match="stage ctx256: moe.num_routed=8 .* ep=3"):
        plan_curriculum(compose_recipe("smoke", ["layout=dp2", "layout.dp_shard=3", "layout.ep=3",
                                                 "layout.world_size=3"]), 3)
    with pytest.raises(ConfigError, match="kda.num_heads=2 is not divisible by tp=4"):  # tiny has 2 heads
        plan_curriculum(compose_recipe("smoke", ["layout=tp2", "layout.tp=4"]), 4)
    with pytest.raises(ConfigError, match="stage ctx1k: layout.cp=2 needs seq_len=1022"):
        plan_curriculum(compose_recipe("smoke", [
            "layout=cp2", "curriculum.stages.ctx1k.seq_len=1022", "curriculum.stages.ctx1k.global_batch_tokens=4088",
            "curriculum.stages.ctx16k.global_batch_tokens=32768"]), 2)
    # the smoke recipe on a 2-rank world: dp doubles, accumulation halves
    bigger = ["curriculum.stages.ctx16k.global_batch_tokens=32768"]
    with pytest.raises(ConfigError, match="dp=2"):  # one 16K sequence per step cannot feed two ranks
        plan_curriculum(compose_recipe("smoke", ["layout=dp2"]), 2)
    one = plan_curriculum(compose_recipe("smoke", bigger), 1)
    two = plan_curriculum(compose_recipe("smoke", ["layout=dp2", *bigger]), 2)
    assert [2 * b.grad_accum for b in two] == [a.grad_accum for a in one]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_proxy_recipes_fit_the_ranks_launched(world):
    """The proxy recipes run unmodified on 1, 2, 4 or 8 ranks: ep and each stage's cp shrink to the world."""
    expected_cp = {"ctx8k": 1, "ctx64k": 1, "ctx256k": math.gcd(4, world), "ctx1m": math.gcd(8, world)}
    for recipe in ("proxy-curriculum", "proxy-8k", "proxy-64k", "proxy-256k", "proxy-1m"):
        cfg = compose_recipe(recipe)
        plans = plan_curriculum(cfg, world)
        for p in plans:
            assert (p.layout is not None) == p.run, (recipe, p.name)
            if p.layout is None:
                continue
            L = p.layout
            assert (L.cp, L.dp_shard, L.world_size) == (expected_cp[p.name], world // L.cp, world), (recipe, p.name)
            assert L.ep == math.gcd(8, world) and cfg.model.moe.num_routed % L.ep == 0
            assert p.sequences_per_step == p.micro_batch * p.grad_accum * L.dp
    # a first run of one stage: a few steps on whatever machine is at hand
    plans = plan_curriculum(compose_recipe("proxy-8k", ["max_steps=20"]), world)
    assert [p.name for p in plans if p.run] == ["ctx8k"]
    # pinning the world turns fitting off: a hard check of the launch
    if world != 8:
        with pytest.raises(ConfigError, match=f"layout.world_size=8 but the world has {world}"):
            plan_curriculum(compose_recipe("proxy-8k", ["layout.world_size=8"]), world)


def test_only_the_stages_a_launch_runs_are_checked_against_the_world():
    # smoke's layout is pinned to one rank: cp=3 in a stage cannot run there
    bad_last = ["curriculum.stages.ctx16k.layout={cp: 3}"]
    with pytest.raises(ConfigError, match="stage ctx16k: the layout .* needs 3 ranks but the world has 1"):
        plan_curriculum(compose_recipe("smoke", bad_last), 1)
    for selection in (["curriculum.run=[ctx256,ctx1k]"], ["max_steps=20"], ["max_steps=12"]):
        plans = plan_curriculum(compose_recipe("smoke", [*bad_last, *selection]), 1)
        assert [p.steps for p in plans] == [10, 6, 4, 2] and total_steps(plans) == 22  # one schedule over all
        assert plans[3].layout is None and not plans[3].run
    plans = plan_curriculum(compose_recipe("smoke", [*bad_last, "max_steps=12"]), 1)
    assert [p.run for p in plans] == [True, True, False, False]  # ctx4k starts at step 16 >= max_steps
    with pytest.raises(ConfigError, match="stage ctx16k"):  # the plan shows (and checks) every stage
        plan_text(compose_recipe("smoke", [*bad_last, "max_steps=12"]), 1)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["layout.dp_mode=fsd"], "layout.dp_mode='fsd': use one of fsdp, zero1"),
        (["layout.param_dtype=fp16"], "layout.param_dtype='fp16': use one of auto, float32, bfloat16"),
        (["layout.cpp=2"], "layout.cpp: no such field; ParallelLayout has pp, dp_replicate, dp_shard, cp"),
        (["layout.tp=two"], "layout.tp='two': must be int"),
        (["layout.tp=0"], "layout.tp=0 must be a positive integer"),
        (["curriculum.stages.ctx1k.layout={cpp: 2}"], "curriculum.stages.ctx1k.layout.cpp: no such field"),
        (["curriculum.stages.ctx1k.layout={dp_mode: fsd}"],
         "curriculum.stages.ctx1k.layout.dp_mode='fsd': use one of fsdp, zero1"),
        (["curriculum.stages.ctx1k.layout={cp: two}"], "curriculum.stages.ctx1k.layout.cp='two': must be int"),
        (["curriculum.stages.ctx1k.layout={ep: 0}"], "curriculum.stages.ctx1k: layout.ep=0 must be a positive integer"),
        (["curriculum.stages.ctx1k.layout=3"], "curriculum.stages.ctx1k.layout=3: give the layout fields"),
        (["curriculum.stages.ctx1k.layout.cp=2"], "use +curriculum.stages.ctx1k.layout.cp=2"),
    ],
)
def test_bad_layout_values_fail_when_the_recipe_is_composed(overrides, expected):
    with pytest.raises(ConfigError) as info:
        compose_recipe("smoke", overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_bad_layout_values_in_recipe_files_name_the_field(tmp_path):
    root = tmp_path / "recipes"
    shutil.copytree(recipes_dir(), root)
    (root / "layout" / "bad.yaml").write_text("dp_shard: -1\ndp_mode: fsd\n")
    with pytest.raises(ConfigError, match=r"layout.dp_mode='fsd': use one of fsdp, zero1"):
        compose_recipe("smoke", ["layout=bad"], root)
    curriculum = (root / "curriculum" / "smoke.yaml").read_text()
    (root / "curriculum" / "typo.yaml").write_text(curriculum.replace("    steps: 2\n", "    steps: 2\n    layout: {tpp: 2}\n"))
    with pytest.raises(ConfigError, match=r"curriculum.stages.ctx16k.layout.tpp: no such field"):
        compose_recipe("smoke", ["curriculum=typo"], root)


def test_stage_layout_blocks_merge_over_the_run_layout():
    cfg = compose_recipe("smoke", ["layout=tp2", "+curriculum.stages.ctx16k.layout.dp_mode=zero1",
                                   "curriculum.stages.ctx1k.layout={tp: 1, ep: 2}",
                                   "curriculum.stages.ctx16k.global_batch_tokens=32768"])
    plans = plan_curriculum(cfg, 2)
    assert [(p.layout.tp, p.layout.ep, p.layout.dp_shard, str(p.layout.dp_mode)) for p in plans] == [
        (2, 1, 1, "fsdp"), (1, 2, 2, "fsdp"), (2, 1, 1, "fsdp"), (2, 1, 1, "zero1")]
    assert plans[0].layout == plans[2].layout != plans[1].layout  # what makes the trainer rebuild the model


def test_config_snapshot_is_json_with_the_layout_choices_as_strings():
    cfg = compose_recipe("smoke", ["layout.dp_mode=zero1", "layout.param_dtype=bfloat16"])
    snapshot = json.loads(json.dumps(config_to_dict(cfg)))
    assert snapshot["layout"]["dp_mode"] == "zero1" and snapshot["layout"]["param_dtype"] == "bfloat16"


def test_memory_estimate_state_term_is_sixteen_bytes_per_parameter_over_the_shards():
    flat = ["layout.pp=1", "layout.tp=1"]  # one pipeline stage, nothing replicated over tp: every rank holds 1/world
    cfg = compose_recipe("k3-8k", flat)
    plan = plan_curriculum(cfg, 4096)[0]
    est = estimate_stage(compose_recipe("k3-8k", ["optim=adamw", *flat]), plan)
    params = count_parameters(cfg.model).total
    assert est.state_gib == pytest.approx(params * 16 / plan.layout.state_shards / 2**30)
    assert est.by_policy_gib["full"] < est.by_policy_gib["selective"] < est.by_policy_gib["none"]
    assert est.activations_gib == est.by_policy_gib[str(plan.checkpointing.mode)]


def test_cli_plan_prints_the_plan_and_rejects_unknown_names(capsys):
    assert run_plan_cli("k3-8k") == 0
    out = capsys.readouterr().out
    assert "ctx8k" in out and "4096" in out and "memory per GPU" in out
    assert "pipeline one_f_one_b, 16 stages" in out and "pipeline parallelism" not in out
    assert "s15@r15 layers 90-92+head" in out  # the balanced split: the head's and MTP's cost on the last stage
    assert run_plan_cli("proxy-curriculum") == 0  # one rank unless pinned: cp and ep fitted, and said so
    out = capsys.readouterr().out
    assert "fitted to 1 rank(s): ctx8k ep 8 -> 1" in out and "ctx1m cp 8 -> 1, ep 8 -> 1" in out
    assert run_plan_cli("proxy-curriculum", ["layout.world_size=8"]) == 0
    assert "fitted" not in capsys.readouterr().out
    assert run_plan_cli("k3-9k") == 2
    assert "available recipes" in capsys.readouterr().err
    assert run_train_cli(["--bogus"]) == 2
    assert run_train_cli(["--plan"]) == 2  # one planning entry point: moe-lc plan
    assert "moe-lc plan" in capsys.readouterr().err
