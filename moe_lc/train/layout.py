"""A stage's parallel layout: the run's layout plus the stage's overrides, resolved and checked.

Checks here need only the model config and the world size, so that a recipe for 4096 GPUs
can be validated on a laptop. `moe_lc.parallel.ParallelLayout.validate` then adds the
engine's own rules; for planning, features the engine does not implement yet (pipeline and
context parallelism) are reported as notes instead of errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.train.config import LayoutConfig, LayoutOverride

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout with every degree known; product of pp, dp_replicate, dp_shard, cp, tp = world_size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int
    gpus_per_node: int = 8
    dp_mode: str = "fsdp"
    sequence_parallel: bool = True
    param_dtype: str = "auto"

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different sequences of a global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def state_shards(self) -> int:
        """Ranks that split parameters/optimizer state (everything but replicas)."""
        return self.world_size // self.dp_replicate

    def describe(self) -> str:
        dims = " ".join(f"{d}={getattr(self, d)}" for d in DIMS)
        nodes = -(-self.world_size // self.gpus_per_node)
        return f"{dims} (world {self.world_size}" + (f", {nodes} nodes)" if self.world_size > 1 else ")")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def merge_layout(base: LayoutConfig, override: Optional[LayoutOverride]) -> LayoutConfig:
    """The run's layout with a stage's non-null overrides applied."""
    if override is None:
        return base
    changes = {d: getattr(override, d) for d in DIMS if getattr(override, d) is not None}
    return dataclasses.replace(base, **changes)


def resolve_layout(
    layout: LayoutConfig, world_size: int, model: ModelConfig, seq_len: Optional[int] = None, where: str = "layout"
) -> ResolvedLayout:
    """Fill dp_shard=-1 from `world_size` and check that the layout fits the world and the model."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{where}: {msg}")

    for d in DIMS:
        v = getattr(layout, d)
        need(isinstance(v, int) and (v >= 1 or (d == "dp_shard" and v == -1)), f"{d}={v} must be a positive int")
    others = layout.pp * layout.dp_replicate * layout.cp * layout.tp
    dp_shard = layout.dp_shard
    if dp_shard == -1:
        need(
            world_size % others == 0,
            f"pp*dp_replicate*cp*tp = {others} does not divide the world size {world_size}; "
            f"launch a multiple of {others} ranks or lower those degrees",
        )
        dp_shard = world_size // others
    product = others * dp_shard
    need(
        product == world_size,
        f"pp*dp_replicate*dp_shard*cp*tp = {product} but the world has {world_size} rank(s); "
        f"launch {product} ranks (torchrun --nproc-per-node ...) or pick a layout for {world_size} "
        "(e.g. layout=single, or dp_shard=-1 to fill the world)",
    )
    r = ResolvedLayout(
        layout.pp, layout.dp_replicate, dp_shard, layout.cp, layout.tp, layout.ep, world_size,
        layout.gpus_per_node, layout.dp_mode, layout.sequence_parallel, layout.param_dtype,
    )
    need(r.pp <= model.num_layers, f"pp={r.pp} exceeds the model's {model.num_layers} layers")
    if seq_len is not None and r.cp > 1:
        need(
            seq_len % (2 * r.cp) == 0,
            f"cp={r.cp} needs seq_len={seq_len} divisible by 2*cp (load-balanced causal sharding)",
        )
    # dp_mode, expert-parallel and tensor-parallel divisibility: the engine's own rules
    check_with_engine(r, model, where, planning=True)
    return r


UNIMPLEMENTED = {"pp": "pipeline parallelism", "cp": "context parallelism"}


def to_parallel_layout(layout: ResolvedLayout):
    """The engine's `moe_lc.parallel.ParallelLayout` for a resolved layout."""
    from moe_lc.parallel import ParallelLayout

    return ParallelLayout(
        pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp, tp=layout.tp,
        ep=layout.ep, dp_mode=layout.dp_mode, sequence_parallel=layout.sequence_parallel, param_dtype=layout.param_dtype,
    )


def engine_notes(layout: ResolvedLayout) -> list[str]:
    """What this layout needs that the parallel engine cannot do yet (empty: it can run)."""
    return [f"{what} ({dim}={getattr(layout, dim)}) is not implemented yet" for dim, what in UNIMPLEMENTED.items()
            if getattr(layout, dim) > 1]


def check_with_engine(layout: ResolvedLayout, model: ModelConfig, where: str, planning: bool) -> None:
    """moe_lc.parallel's own validation. planning=True tolerates pp/cp > 1 (see engine_notes)."""
    target = layout
    if planning:  # fold pp and cp away so that the engine checks everything else with the same ep arithmetic
        target = dataclasses.replace(layout, pp=1, cp=1, dp_shard=layout.dp_shard * layout.cp,
                                     world_size=layout.world_size // layout.pp)
    try:
        to_parallel_layout(target).validate(model, world_size=target.world_size)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from err
