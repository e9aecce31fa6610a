"""Parallelism around the model: device meshes, PP, TP + SP, EP, CP, activation checkpointing, FSDP2 / ZeRO-1.

Typical use (every rank, after ``torch.distributed.init_process_group``)::

    layout = ParallelLayout(tp=2, ep=2)                  # dp_shard=-1: the rest of the world
    mesh = build_mesh(layout)
    model = parallelize(build_model(cfg, device, seed=0), layout, mesh,
                        ActivationCheckpointing(mode="selective"))  # optional; None keeps everything
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=3e-4)
    dp_rank, dp_size = data_parallel_info(mesh)          # which samples this rank reads
    ...  # per micro-batch: loss = out.lm_loss * local_label_tokens / global_label_tokens(...)
    finish_gradient_sync(model); clip_grad_norm_(model.parameters(), 1.0); optimizer.step()
    for moe in model.moe_layers(): moe.balancer.update(balance_group(mesh))

With pp > 1 the model keeps its pipeline stages only and ``parallel_context(model).pipeline.run``
takes a step's micro-batches through the schedule (``moe_lc.train.step.train_step`` does it).
See docs/parallelism.md.
"""

from moe_lc.optim.clip import clip_grad_norm as clip_grad_norm_  # one mesh-aware clip for every layout
from moe_lc.parallel.activation_checkpointing import (
    ActivationCheckpointing,
    CheckpointMode,
    apply_activation_checkpointing,
)
from moe_lc.parallel.data_parallel import build_optimizer, finish_gradient_sync, set_gradient_sync
from moe_lc.parallel.layout import DPMode, ParallelLayout, ParamDType, PipelineSchedule
from moe_lc.parallel.mesh import (
    balance_group,
    build_expert_mesh,
    build_mesh,
    data_parallel_group,
    data_parallel_info,
    global_label_tokens,
)
from moe_lc.parallel.parallelize import ParallelContext, parallel_context, parallelize

__all__ = [
    "ActivationCheckpointing",
    "CheckpointMode",
    "apply_activation_checkpointing",
    "ParallelLayout",
    "DPMode",
    "PipelineSchedule",
    "ParamDType",
    "ParallelContext",
    "build_mesh",
    "build_expert_mesh",
    "parallelize",
    "parallel_context",
    "data_parallel_info",
    "data_parallel_group",
    "balance_group",
    "global_label_tokens",
    "build_optimizer",
    "set_gradient_sync",
    "finish_gradient_sync",
    "clip_grad_norm_",
]
