"""Preset model configs with dotted-key overrides, for the tests."""

from __future__ import annotations

from moe_lc.config import ModelConfig
from moe_lc.presets import get_preset


def preset_with(name: str, **overrides) -> ModelConfig:
    """``get_preset(name)`` with fields replaced by dotted key: ``preset_with("tiny", **{"moe.top_k": 1})``."""
    cfg = get_preset(name)
    for key, value in overrides.items():
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg.validate()
