"""Test configurations: a preset with a few fields changed by dotted name."""

from __future__ import annotations

from moe_lc.config import ModelConfig
from moe_lc.presets import get_preset


def set_fields(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    """Set ``{"moe.top_k": 3, ...}`` on ``cfg`` in place (no validation: tests of bad values need that)."""
    for key, value in overrides.items():
        obj = cfg
        *path, last = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return cfg


def preset_with(name: str, **overrides) -> ModelConfig:
    """A preset with dotted-name overrides (``preset_with("tiny", **{"moe.top_k": 1})``), validated."""
    return set_fields(get_preset(name), overrides).validate()


def tiny(**overrides) -> ModelConfig:
    """The tiny preset with dotted-name overrides (``tiny(**{"attn_res.mode": "full"})``), validated."""
    return preset_with("tiny", **overrides)
