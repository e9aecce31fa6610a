"""`moe-lc train` / `python -m moe_lc.train`: compose a recipe and train it; `moe-lc plan`: print its
plan; `moe-lc bench`: time one of its stages.

    moe-lc train                                   # the smoke recipe
    moe-lc train recipe=proxy-8k optim.lr=1e-3     # any recipe, any field
    moe-lc plan k3-8k                              # validate every stage and print the plan
    moe-lc plan k3-8k --gpus 1024 --gpu-memory 141 # the recommended layout of every stage on 1024 GPUs
    moe-lc bench proxy-8k --steps 10 --profile     # tokens/s, MFU, memory, time per component
    moe-lc train --cfg                             # print the composed config
    moe-lc train --list                            # recipes and config-group options

Arguments are Hydra overrides (key=value, group=option, +new_key=value, ~key) composed with
Hydra's compose API; `recipe=NAME` picks the top-level recipe file and `recipes_dir=DIR`
(or $MOE_LC_RECIPES) another recipe tree.

Exit codes of `moe-lc train` (a launcher requeues on 3 and 4):
    0  done (the stages asked for are trained, or max_steps reached)
    1  diverged (too many skipped non-finite steps, or a state that is not finite)
    2  bad configuration or input (one line naming the fix), or run_dir in use by another trainer
    3  stopped by a signal (SIGTERM, SIGUSR1, SIGINT) after saving a checkpoint: resume=auto continues
    4  a collective failed: another rank stopped responding or died; restarting resumes
  130  interrupted (Ctrl-C twice): no checkpoint of the current step
With $MOE_LC_STATUS_FILE set, rank 0 also writes its exit code there: torchrun reports only
whether its workers failed, so the launch scripts read the trainer's code from that file.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from moe_lc.config import ConfigError

if TYPE_CHECKING:
    from moe_lc.plan.hardware import ClusterRequest

FLAGS = ("--cfg", "--list", "--help", "-h")
EXIT_DONE, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_COLLECTIVE_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
STATUS_FILE_ENV = "MOE_LC_STATUS_FILE"


def _usage() -> str:
    return "usage: moe-lc train [recipe=NAME] [key=value ...] [--cfg | --list | --help]\n" + __doc__.split("\n", 1)[1]


def _listing() -> str:
    from moe_lc.train.recipes import GROUPS, available_options, available_recipes, recipes_dir

    root = recipes_dir()
    lines = [f"recipes ({root}): {', '.join(available_recipes(root))}"]
    lines += [f"  {g}=  {', '.join(available_options(g, root))}" for g in GROUPS]
    return "\n".join(lines)


def run_train_cli(argv: Optional[Sequence[str]] = None) -> int:
    """The exit code (see the module docstring); also written to $MOE_LC_STATUS_FILE by rank 0."""
    from omegaconf import OmegaConf

    from moe_lc.train.recipes import compose_recipe, recipes_dir, split_recipe_args

    args = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        print(f"error: unknown option(s) {' '.join(unknown)}; options: {' '.join(FLAGS)}; "
              "everything else is key=value (plan a recipe with `moe-lc plan NAME`)", file=sys.stderr)
        return 2
    if "-h" in flags or "--help" in flags:
        print(_usage())
        print(_listing())
        return 0

    def compose_and_train() -> int:
        if "--list" in flags:
            print(_listing())
            return EXIT_DONE
        recipe, rdir, rest = split_recipe_args(overrides)
        cfg = compose_recipe(recipe, rest, recipes_dir(rdir))
        if "--cfg" in flags:
            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return EXIT_DONE
        from moe_lc.train.trainer import train as run

        return EXIT_STOPPED if run(cfg).stopped_early else EXIT_DONE

    code = _exit_code(compose_and_train)
    _write_status(code)
    return code


def _write_status(code: int) -> None:
    """Rank 0's exit code into $MOE_LC_STATUS_FILE, for a launcher behind torchrun."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            f.write(f"{code}\n")


def run_plan_cli(recipe: str, overrides: Sequence[str] = (), cluster: Optional["ClusterRequest"] = None,
                 runners_up: int = 3) -> int:
    """`moe-lc plan RECIPE [key=value ...] [--gpus N ...]`: compose, check every stage and print the plan.

    Without a cluster: the recipe's own layouts for `layout.world_size` ranks when the recipe pins
    it, else for $WORLD_SIZE (1 when unset), so `layout.world_size=N` plans a recipe for N ranks.
    With one (`--gpus N --gpu-memory G ...`): the recommended layout of every stage on it.
    """
    from moe_lc.train.recipes import compose_recipe, recipes_dir, split_recipe_args

    def plan() -> None:
        from moe_lc.train.plan import plan_text, recommend_text

        _, rdir, rest = split_recipe_args(overrides)
        cfg = compose_recipe(recipe, rest, recipes_dir(rdir))
        if cluster is not None:
            print(recommend_text(cfg, cluster.resolve(), runners_up))
            return
        print(plan_text(cfg, cfg.layout.world_size or int(os.environ.get("WORLD_SIZE", "1"))))

    return _exit_code(plan)


BENCH_USAGE = """usage: moe-lc bench [RECIPE | recipe=NAME] [key=value ...] [--stage NAME] [--steps N] [--warmup W]
                    [--json PATH] [--profile] [--trace DIR]

Builds a stage of the recipe as `moe-lc train` would (the first stage it would run, or --stage)
for the devices present (one process, or every rank under torchrun), runs W warm-up and N timed
steps on its data and prints tokens/s, TFLOP/s and MFU per device (against the datasheet peak
and a matmul peak measured here), peak memory and the mean step time; --profile adds the time
per model component and the device's idle share from one profiled step; --trace DIR (implies
--profile) also writes that step's Chrome trace and its ops by self time into DIR, and on a GPU
where the device waits for the host in a step of two micro-batches (DIR/rank*_gaps.txt, from its
trace DIR/rank*_step_trace.json). Writes nothing into run_dir and never resumes or saves a run."""


def run_bench_cli(argv: Sequence[str]) -> int:
    """`moe-lc bench ...`; exit code 2 for bad configuration or input (an out-of-memory step included)."""
    import argparse

    from moe_lc.train.bench import run_bench
    from moe_lc.train.recipes import compose_recipe, recipes_dir, split_recipe_args

    parser = argparse.ArgumentParser(prog="moe-lc bench", usage=BENCH_USAGE.split("\n\n")[0][len("usage: "):],
                                     description=BENCH_USAGE.split("\n\n", 1)[1])
    parser.add_argument("args", nargs="*", help="a recipe name and Hydra overrides (key=value)")
    parser.add_argument("--stage", default=None, help="the stage to bench (default: the first the recipe runs)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps before them (default 2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number to PATH as JSON")
    parser.add_argument("--profile", action="store_true", help="profile one more step: time per component")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="with the profiled step, write its Chrome trace, an ops table and the GPU's waits into DIR")
    opts = parser.parse_intermixed_args(list(argv))
    named = [a for a in opts.args if "=" not in a and not a.startswith(("+", "~"))]
    if len(named) > 1:
        print(f"error: one recipe at a time, got {' '.join(named)}", file=sys.stderr)
        return 2
    overrides = [f"recipe={name}" for name in named] + [a for a in opts.args if a not in named]

    def bench() -> None:
        recipe, rdir, rest = split_recipe_args(overrides)
        cfg = compose_recipe(recipe, rest, recipes_dir(rdir))
        cfg.max_steps = None  # a bench runs its own steps
        if opts.stage is not None:
            if opts.stage not in cfg.curriculum.stages:
                raise ConfigError(f"--stage {opts.stage}: recipe {recipe} has stages "
                                  f"{', '.join(cfg.curriculum.stages)}")
            cfg.curriculum.run = [opts.stage]
        run_bench(cfg, opts.steps, opts.warmup, opts.profile or opts.trace is not None, opts.json, trace_dir=opts.trace)

    return _exit_code(bench)


def _exit_code(job: Callable[[], Optional[int]]) -> int:
    """Run `job` (its return value is the exit code; None: 0); the errors a user can act on become one
    line on stderr and their exit code (see the module docstring)."""
    from moe_lc.checkpoint import CheckpointError
    from moe_lc.storage import StorageError
    from moe_lc.train.hangs import CollectiveFailure
    from moe_lc.train.runlock import RunLockLost

    try:
        return job() or EXIT_DONE
    except KeyboardInterrupt:
        print("interrupted: the newest checkpoint is the last complete state (resume=auto continues from it)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except FloatingPointError as err:  # a diverged run: its checkpoints are intact, the message says what to try
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except CollectiveFailure as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_COLLECTIVE_FAILED
    except (ConfigError, CheckpointError, StorageError, FileNotFoundError, RunLockLost) as err:
        # bad input; checkpoint and data errors carry their own fix: shown without a traceback
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
