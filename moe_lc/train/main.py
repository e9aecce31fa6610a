"""`moe-lc train` / `python -m moe_lc.train`: compose a recipe, then plan or train.

    moe-lc train                                   # the smoke recipe
    moe-lc train recipe=proxy-8k optim.lr=1e-3     # any recipe, any field
    moe-lc train recipe=k3-8k plan_only=true       # validate and print the plan
    moe-lc train --cfg                             # print the composed config
    moe-lc train --list                            # recipes and config-group options

Arguments are Hydra overrides (key=value, group=option, +new_key=value, ~key) composed with
Hydra's compose API; `recipe=NAME` picks the top-level recipe file and `recipes_dir=DIR`
(or $MOE_LC_RECIPES) another recipe tree.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from moe_lc.config import ConfigError

FLAGS = ("--cfg", "--plan", "--list", "--help", "-h")


def _usage() -> str:
    return "usage: moe-lc train [recipe=NAME] [key=value ...] [--cfg | --plan | --list | --help]\n" + __doc__.split("\n", 1)[1]


def _listing() -> str:
    from moe_lc.train.recipes import GROUPS, available_options, available_recipes, recipes_dir

    root = recipes_dir()
    lines = [f"recipes ({root}): {', '.join(available_recipes(root))}"]
    lines += [f"  {g}=  {', '.join(available_options(g, root))}" for g in GROUPS]
    return "\n".join(lines)


def run_train_cli(argv: Optional[Sequence[str]] = None) -> int:
    """Exit code: 0 done (or stopped by SIGTERM after a checkpoint), 1 diverged, 2 bad configuration or input."""
    from omegaconf import OmegaConf

    from moe_lc.train.recipes import compose_recipe, recipes_dir, split_recipe_args

    args = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        print(f"error: unknown option(s) {' '.join(unknown)}; options: {' '.join(FLAGS)}; "
              "everything else is key=value", file=sys.stderr)
        return 2
    if "-h" in flags or "--help" in flags:
        print(_usage())
        print(_listing())
        return 0
    try:
        if "--list" in flags:
            print(_listing())
            return 0
        recipe, rdir, rest = split_recipe_args(overrides)
        cfg = compose_recipe(recipe, rest, recipes_dir(rdir))
        if "--cfg" in flags:
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        if cfg.plan_only or "--plan" in flags:
            from moe_lc.train.plan import plan_text

            world = cfg.layout.world_size or int(os.environ.get("WORLD_SIZE", "1"))
            print(plan_text(cfg, world))
            return 0
        from moe_lc.train.trainer import train

        train(cfg)
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # a diverged run: its checkpoints are intact, the message says what to try
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # checkpoint and data errors carry their own fix; show them without a traceback
        from moe_lc.checkpoint import CheckpointError

        if isinstance(err, (CheckpointError, FileNotFoundError)):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
