"""Build the model and optimizer for one parallel layout and activation checkpointing policy.

One rank: the plain model with the checkpointing policy applied. Several ranks: `moe_lc.parallel`
builds the device mesh and applies the layout and the policy around the model (PP, TP/SP, EP,
checkpointing, FSDP2 or ZeRO-1); gradients are then summed over data-parallel ranks (the engine's
convention), so each rank weights its token losses by 1 / (label tokens of the whole global batch).
With pp > 1 the rank's model holds its pipeline stages only and `ModelState.pipeline` runs them.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.ops.backend_choice import triton_device_reason
from moe_lc.ops.kda_projections import kernels_unavailable_reason
from moe_lc.optim import OptimConfig, build_optimizer, clip_grad_norm
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing
from moe_lc.parallel.compile import RegionalCompile, apply_compile
from moe_lc.parallel.float8 import Float8Training, apply_float8
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.train.config import TrainConfig
from moe_lc.train.runtime import Runtime


@dataclass
class ModelState:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    layout: ParallelLayout
    mesh: Optional[Any]  # DeviceMesh when parallelized
    dp_rank: int
    dp_size: int
    balance_group: Optional[Any]  # process group for ExpertBalancer.update
    autocast_forward: bool  # False when FSDP already computes in bf16
    pipeline: Optional[Any] = None  # moe_lc.parallel.pipeline_runtime.Pipeline when pp > 1

    @property
    def parallel(self) -> bool:
        return self.mesh is not None

    def moe_layers(self) -> list:
        return self.model.moe_layers()

    def set_gradient_sync(self, enabled: bool) -> None:
        if self.mesh is not None:
            from moe_lc.parallel import set_gradient_sync

            set_gradient_sync(self.model, enabled)

    def finish_gradient_sync(self) -> None:
        if self.mesh is not None:
            from moe_lc.parallel import finish_gradient_sync

            finish_gradient_sync(self.model)
        if self.pipeline is not None:
            self.pipeline.finish_gradient_sync()

    def clip_grad_norm(self, max_norm: float, scale_grads: bool = True) -> torch.Tensor:
        """Global gradient norm before clipping (max_norm 0 or ``scale_grads=False``: measure only), a
        device scalar: reading it waits for the GPU, so the step reads it with its other results at its end."""
        # mesh-aware: sums shard norms per device mesh, counts replicas once (any layout, or none)
        if self.pipeline is None:
            return clip_grad_norm(self.model.parameters(), max_norm, scale_grads=scale_grads)
        copy = self.pipeline.embedding_copy()  # counted on the first stage's rank
        return clip_grad_norm(self.model.parameters(), max_norm, stage_group=self.pipeline.group,
                              uncounted=[copy] if copy is not None else [], scale_grads=scale_grads)


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


def float8_policy(cfg: TrainConfig) -> Optional[Float8Training]:
    """The run's FP8 policy when it trains with precision=fp8, else None."""
    return cfg.float8 if cfg.precision == "fp8" else None


# environment variables with kernel launch choices, and the module that reads each when it loads
KERNEL_TUNING_VARIABLES = {"MOE_LC_KDA_TUNING": "moe_lc_kernels.kda", "MOE_LC_SHORT_CONV_TUNING": "moe_lc_kernels.short_conv",
                           "MOE_LC_DEPTH_MIXTURE_TUNING": "moe_lc_kernels.depth_mixture"}


def check_backends_run_here(cfg: ModelConfig, device: torch.device) -> None:
    """A fast backend asked for by name (not "auto") that cannot run on ``device``, or a kernel launch
    choice in the environment that its kernels do not know, is a config error before anything is
    built: the op would refuse it too, but only inside the first forward, as a traceback."""
    for variable, module in KERNEL_TUNING_VARIABLES.items():
        if os.environ.get(variable):
            try:
                importlib.import_module(module)  # parses the variable
            except ValueError as err:
                raise ConfigError(f"{variable}={os.environ[variable]!r}: {err}") from None
    triton_ops = {"attn_res.backend": cfg.attn_res.backend, "moe.dispatch_backend": cfg.moe.dispatch_backend,
                  "moe.router_backend": cfg.moe.router_backend, "mla.keys_backend": cfg.mla.keys_backend,
                  "mla.gate_backend": cfg.mla.gate_backend, "kda.gate_backend": cfg.kda.gate_backend,
                  "loss_backend": cfg.loss_backend, "moe.wgrad_backend": cfg.moe.wgrad_backend}
    problems = [(f"kda.backend={cfg.kda.backend}", kernels_unavailable_reason(cfg.kda.backend, device))]
    problems += [(f"{field}=triton", triton_device_reason(device)) for field, value in triton_ops.items()
                 if value == "triton"]
    for setting, reason in problems:
        if reason is not None:
            raise ConfigError(f"{setting}: {reason}; set it to auto (the fastest backend that runs here) or torch")


def build_model_state(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    layout: ParallelLayout,
    runtime: Runtime,
    seed: int,
    checkpointing: Optional[ActivationCheckpointing] = None,
    seq_len: Optional[int] = None,
    float8: Optional[Float8Training] = None,
    compiled: Optional[RegionalCompile] = None,
) -> ModelState:
    """Model and optimizer for ``layout`` with the activation ``checkpointing`` policy (None: none);
    ``seq_len``: what a pipeline's stages are balanced for (the first stage this model trains);
    ``float8``: the FP8 linears of ``precision=fp8`` (None: none); ``compiled``: the modules to
    ``torch.compile`` (``moe_lc.parallel.compile``; None: none)."""
    from moe_lc.model.init import build_model

    layout.validate(model_cfg, runnable=True)  # before building anything
    check_backends_run_here(model_cfg, runtime.device)
    checkpointing = (checkpointing or ActivationCheckpointing()).check()
    weights = torch.float64 if runtime.compute_dtype == torch.float64 else torch.float32
    model = build_model(model_cfg, device=runtime.device, seed=seed, dtype=weights)
    if runtime.world_size == 1:
        if layout.world_size != 1:
            raise ConfigError(f"the layout needs {layout.world_size} ranks but this is a single process")
        if float8 is not None:
            apply_float8(model, float8)
        if compiled is not None:
            apply_compile(model, compiled)
        apply_activation_checkpointing(model, checkpointing)
        model.train()
        return ModelState(model, build_optimizer(model, optim_cfg), layout, None, 0, 1, None, True)

    from moe_lc import parallel

    mesh = parallel.build_mesh(layout, runtime.world_size, runtime.device.type)
    model = parallel.parallelize(model, layout, mesh, checkpointing, seq_len, float8, compiled)
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
        model, optimizer, layout, mesh, dp_rank, dp_size, parallel.balance_group(mesh), autocast_forward=not fsdp_bf16,
        pipeline=parallel.parallel_context(model).pipeline,
    )
