"""Find, list and compose the Hydra recipes in `recipes/`.

A recipe is a YAML file at the top of the recipe directory (`smoke.yaml`, `proxy-8k.yaml`, ...);
the sub-directories are config groups it composes (`model/`, `layout/`, `curriculum/`,
`data/`, `optim/`). `recipe=NAME` on the command line picks the file; every other argument
is a Hydra override (`key=value`, `group=option`, `+new.key=value`, `~key`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from moe_lc.config import ConfigError
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.train.config import PRESET_GROUP, SCHEMA_NAME, TrainConfig, register_configs

DEFAULT_RECIPE = "smoke"
GROUPS = ("model", "layout", "curriculum", "data", "optim")
RECIPES_ENV = "MOE_LC_RECIPES"


def recipes_dir(override: Optional[str] = None) -> Path:
    """`override`, else $MOE_LC_RECIPES, else the installed recipes (`recipes/` of the source tree,
    packaged as `moe_lc_recipes` so that a wheel install finds them too)."""
    candidates = [override, os.environ.get(RECIPES_ENV), _installed_recipes()]
    for c in candidates:
        if c:
            path = Path(c).expanduser().resolve()
            if not path.is_dir():
                raise ConfigError(f"recipe directory {path} does not exist; point {RECIPES_ENV} or recipes_dir= at one")
            return path
    raise ConfigError("no recipe directory")  # pragma: no cover - the last candidate is always set


def _installed_recipes() -> Path:
    spec = importlib.util.find_spec("moe_lc_recipes")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "recipes"  # a source tree that is not installed


def available_recipes(root: Optional[Path] = None) -> list[str]:
    root = root or recipes_dir()
    return sorted(p.stem for p in root.glob("*.yaml"))


def available_options(group: str, root: Optional[Path] = None) -> list[str]:
    root = root or recipes_dir()
    return sorted(p.stem for p in (root / group).glob("*.yaml"))


def split_recipe_args(args: Sequence[str]) -> tuple[str, Optional[str], list[str]]:
    """(recipe, recipes_dir, remaining Hydra overrides) from `recipe=NAME recipes_dir=DIR key=value ...`."""
    recipe, rdir, rest = DEFAULT_RECIPE, None, []
    for arg in args:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("recipes_dir="):
            rdir = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return recipe, rdir, rest


def compose_recipe(
    recipe: str = DEFAULT_RECIPE, overrides: Sequence[str] = (), root: Optional[Path] = None
) -> TrainConfig:
    """Compose `recipe` with `overrides` into a typed, validated TrainConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    root = root or recipes_dir()
    names = available_recipes(root)
    if recipe not in names:
        raise ConfigError(f"unknown recipe {recipe!r}; available recipes: {', '.join(names)} (in {root})")
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root), version_base=None, job_name="moe_lc_train"):
            composed = compose(config_name=recipe, overrides=[*overrides, f"recipe={recipe}"])
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain_compose_error(err, root)) from err
    finally:
        GlobalHydra.instance().clear()
    try:
        cfg: TrainConfig = OmegaConf.to_object(composed)
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"recipe {recipe!r}: {_first_line(err)}: {getattr(err, 'full_key', '')}; set it in the recipe or on the command line"
        ) from err
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(
            f"recipe {recipe!r} does not build on the trainer schema; start its defaults list with `- {SCHEMA_NAME}`"
        )
    validate_train_config(cfg)
    return cfg


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _explain_compose_error(err: BaseException, root: Path) -> str:
    text = str(err).strip()
    for group in GROUPS:
        if f"Could not find '{group}/" in text:
            missing = text.split(f"Could not find '{group}/", 1)[1].split("'", 1)[0]
            return f"unknown {group} {missing!r}; available: {', '.join(available_options(group, root))}"
    if f"Could not find '{PRESET_GROUP}/" in text:
        from moe_lc.presets import PRESETS

        return f"unknown model preset in a recipes/model file; presets: {', '.join(sorted(PRESETS))}"
    causes = [err]  # Hydra chains the OmegaConf error as the cause (overrides) or the context (recipe files)
    while (causes[-1].__cause__ or causes[-1].__context__) is not None:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    for cause in causes:
        line = explain_field_error(cause)
        if line is not None:
            return line
    hint = [line for line in text.splitlines() if line.startswith("To append")]  # Hydra's own fix, when it has one
    if hint:
        return f"{_first_line(err)} {hint[0]}"
    return ": ".join(_first_line(c) for c in causes)


def explain_field_error(err: BaseException, prefix: str = "") -> Optional[str]:
    """One line for a bad key or value of a schema field, e.g. `layout.dp_mode='fsd': use one of fsdp, zero1`.

    None when `err` is not about a field of a dataclass node (the caller says what it can).
    """
    kind = getattr(err, "object_type", None)
    key = getattr(err, "full_key", None)
    if not (isinstance(err, OmegaConfBaseException) and dataclasses.is_dataclass(kind) and key):
        return None
    where = f"{prefix}.{key}" if prefix else key
    names = [f.name for f in dataclasses.fields(kind)]
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) and err.key not in names:
        return f"{where}: no such field; {kind.__name__} has {', '.join(names)}"
    if not isinstance(err, ValidationError) or err.key not in names:
        return None
    quoted = re.search(r"'(.*?)'", str(err))
    value = f"={quoted.group(1)!r}" if quoted else ""
    wanted = _field_type(kind, err.key)
    if isinstance(wanted, type) and issubclass(wanted, Enum):
        return f"{where}{value}: use one of {', '.join(m.name for m in wanted)}"
    return f"{where}{value}: must be {getattr(wanted, '__name__', wanted)}"


def _field_type(kind: type, name: str) -> Any:
    """The declared type of a dataclass field, Optional[...] unwrapped."""
    hint = typing.get_type_hints(kind)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def stage_override(run_value: Any, where: str, block: Optional[Mapping[str, Any]], example: str) -> Any:
    """The run's structured config ``run_value`` with a stage's block merged over it (OmegaConf checks
    each key and value); ``where`` names the block and ``example`` shows one in the error for a non-mapping."""
    if block is None:
        return run_value
    if not isinstance(block, Mapping):
        section = where.rsplit(".", 1)[-1]
        raise ConfigError(f"{where}={block!r}: give the {section} fields this stage changes, e.g. {example}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(run_value), block)
    except OmegaConfBaseException as err:
        raise ConfigError(explain_field_error(err, where) or f"{where}: {_first_line(err)}") from err
    return OmegaConf.to_object(merged)


def stage_layout(run_layout: ParallelLayout, stage: str, block: Optional[Mapping[str, Any]]) -> ParallelLayout:
    """The run's layout with a stage's `layout:` block merged over it."""
    return stage_override(run_layout, f"curriculum.stages.{stage}.layout", block, "{cp: 2}")


def stage_checkpointing(
    run_policy: ActivationCheckpointing, stage: str, block: Optional[Mapping[str, Any]]
) -> ActivationCheckpointing:
    """The run's activation checkpointing with a stage's `activation_checkpointing:` block merged over it."""
    where = f"curriculum.stages.{stage}.activation_checkpointing"
    policy = stage_override(run_policy, where, block, "{mode: full}")
    try:
        return policy.check()
    except ConfigError as err:
        raise ConfigError(f"curriculum.stages.{stage}: {err}") from err


def validate_train_config(cfg: TrainConfig) -> TrainConfig:
    """Reject settings that cannot run, naming the field and the fix.

    Layouts get their world-independent checks here (keys, choices, positive degrees); the
    world size and the model are checked per stage when the curriculum is planned.
    """

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    cfg.model.validate()
    cfg.optim.validate()
    need(cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:"), f"device={cfg.device!r}: use auto, cpu or cuda")
    need(cfg.precision in ("auto", "fp32", "bf16", "fp8", "fp64"),
         f"precision={cfg.precision!r}: use auto, fp32, bf16, fp8 or fp64")
    need(cfg.max_steps is None or cfg.max_steps >= 0, f"max_steps={cfg.max_steps} must be >= 0 or null")
    need(cfg.threads is None or cfg.threads >= 1, f"threads={cfg.threads} must be >= 1 or null")
    need(
        cfg.logging.progress in ("auto", "bar", "lines", "none"),
        f"logging.progress={cfg.logging.progress!r}: use auto, bar, lines or none",
    )
    need(cfg.logging.every >= 1 and cfg.logging.loads_every >= 1, "logging.every and logging.loads_every must be >= 1")
    need(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every} must be >= 0 (0: stage ends only)")
    need(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    need(cfg.eval.sequences >= 0 and cfg.eval.passkey_documents >= 0, "eval.sequences and eval.passkey_documents must be >= 0")
    need(bool(cfg.data.sources), "data.sources is empty: give at least one {prefix: ..., weight: ...}")

    cfg.layout.check_degrees()
    cfg.activation_checkpointing.check()
    stages = cfg.curriculum.stages
    need(bool(stages), f"curriculum {cfg.curriculum.name!r} has no stages; add some under curriculum.stages")
    for name, st in stages.items():
        where = f"curriculum.stages.{name}"
        layout = stage_layout(cfg.layout, name, st.layout)
        try:
            layout.check_degrees()
            cfg.compile.check(layout.tp)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
        stage_checkpointing(cfg.activation_checkpointing, name, st.activation_checkpointing)
        need(st.seq_len > 1, f"{where}.seq_len={st.seq_len} must be > 1")
        need(st.global_batch_tokens > 0, f"{where}.global_batch_tokens={st.global_batch_tokens} must be > 0")
        need(st.micro_batch >= 1, f"{where}.micro_batch={st.micro_batch} must be >= 1")
        need(
            (st.steps is None) != (st.tokens is None),
            f"{where}: set exactly one of steps and tokens (got steps={st.steps}, tokens={st.tokens})",
        )
        need(st.steps is None or st.steps >= 1, f"{where}.steps={st.steps} must be >= 1")
        need(st.tokens is None or st.tokens >= 1, f"{where}.tokens={st.tokens} must be >= 1")
        for src in (st.data or []) + list(cfg.data.sources):
            need(src.weight > 0, f"data source {src.prefix!r} has weight {src.weight}; weights must be > 0")
    for name in cfg.curriculum.run or []:
        need(
            name in stages,
            f"unknown stage {name!r} in curriculum.run; stages of curriculum {cfg.curriculum.name!r}: {', '.join(stages)}",
        )
    return cfg


def config_to_dict(cfg: TrainConfig) -> dict:
    """A JSON-able snapshot of the whole configuration (saved with every checkpoint)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
