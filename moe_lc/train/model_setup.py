"""Build the model and optimizer for one parallel layout.

One rank: the plain model. Several ranks: `moe_lc.parallel` builds the device mesh and
applies the layout around the model (TP/SP, EP, FSDP2 or ZeRO-1); gradients are then
summed over data-parallel ranks (the engine's convention), so each rank weights its
token losses by 1 / (label tokens of the whole global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.optim import OptimConfig, build_optimizer, clip_grad_norm
from moe_lc.train.balancer_state import pack_balancer_state
from moe_lc.train.layout import ResolvedLayout, check_with_engine, engine_notes, to_parallel_layout
from moe_lc.train.runtime import Runtime


@dataclass
class ModelState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: ResolvedLayout
    mesh: Optional[Any]  # DeviceMesh when parallelized
    dp_rank: int
    dp_size: int
    balance_group: Optional[Any]  # process group for ExpertBalancer.update
    autocast_forward: bool  # False when FSDP already computes in bf16

    @property
    def parallel(self) -> bool:
        return self.mesh is not None

    def moe_layers(self) -> list:
        return self.model.moe_layers()

    def global_label_tokens(self, local: int) -> int:
        if self.mesh is None:
            return local
        from moe_lc.parallel import global_label_tokens

        return global_label_tokens(local, self.mesh)

    def set_gradient_sync(self, enabled: bool) -> None:
        if self.mesh is not None:
            from moe_lc.parallel import set_gradient_sync

            set_gradient_sync(self.model, enabled)

    def finish_gradient_sync(self) -> None:
        if self.mesh is not None:
            from moe_lc.parallel import finish_gradient_sync

            finish_gradient_sync(self.model)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm before clipping (max_norm 0: measure only)."""
        # mesh-aware: sums shard norms per device mesh, counts replicas once (any layout, or none)
        return float(clip_grad_norm(self.model.parameters(), max_norm))


def _optimizer_over(model: nn.Module, cfg: OptimConfig):
    """An optimizer class for `moe_lc.parallel.build_optimizer` (ZeRO-1 passes this rank's share of params)."""

    def make(params: Iterable[torch.Tensor], **_: Any) -> torch.optim.Optimizer:
        keep = {id(p) for p in params}
        optimizer = build_optimizer(model, cfg)  # no state yet: its groups can still be narrowed
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    return make


def build_model_state(
    model_cfg: ModelConfig, optim_cfg: OptimConfig, layout: ResolvedLayout, runtime: Runtime, seed: int
) -> ModelState:
    from moe_lc.model.init import build_model

    weights = torch.float64 if runtime.compute_dtype == torch.float64 else torch.float32
    model = pack_balancer_state(build_model(model_cfg, device=runtime.device, seed=seed, dtype=weights))
    if runtime.world_size == 1:
        if layout.world_size != 1:
            raise ConfigError(f"the layout needs {layout.world_size} ranks but this is a single process")
        model.train()
        return ModelState(model, build_optimizer(model, optim_cfg), layout, None, 0, 1, None, True)

    notes = engine_notes(layout)
    if notes:
        raise ConfigError("cannot run this layout: " + "; ".join(notes) + " in moe_lc.parallel")
    from moe_lc import parallel

    check_with_engine(layout, model_cfg, "layout", planning=False)
    engine_layout = to_parallel_layout(layout)
    mesh = parallel.build_mesh(engine_layout, runtime.world_size, runtime.device.type)
    model = parallel.parallelize(model, engine_layout, mesh)
    model.train()
    if layout.dp_mode == "zero1":
        optimizer = parallel.build_optimizer(model, _optimizer_over(model, optim_cfg))
    else:
        optimizer = build_optimizer(model, optim_cfg)
    dp_rank, dp_size = parallel.data_parallel_info(mesh)
    fsdp_bf16 = layout.dp_mode == "fsdp" and (
        layout.param_dtype == "bfloat16" or (layout.param_dtype == "auto" and runtime.device.type == "cuda")
    )
    return ModelState(
        model, optimizer, layout, mesh, dp_rank, dp_size, parallel.balance_group(mesh), autocast_forward=not fsdp_bf16
    )
