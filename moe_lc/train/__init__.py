"""The trainer: Hydra recipes, the staged context curriculum, the training loop and resume.

Entry points: `moe-lc train` / `python -m moe_lc.train` (`moe_lc.train.main.run_train_cli`),
`moe-lc bench` (`run_bench_cli`: one stage timed and profiled, `moe_lc.train.bench`);
programmatic: `compose_recipe(name, overrides)` then `train(cfg)`.
"""

from moe_lc.train.recipes import available_recipes, compose_recipe


def train(cfg, stream=None):
    """Run a composed TrainConfig (see moe_lc.train.trainer.Trainer)."""
    from moe_lc.train.trainer import train as _train

    return _train(cfg, stream)


__all__ = ["available_recipes", "compose_recipe", "train"]
