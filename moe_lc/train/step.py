"""One optimizer step: accumulate micro-batches, clip, update, rebalance the experts.

The loss of the step is the mean over the label tokens of the whole global batch:

    L = sum_i n_i * loss_i / N,    N = sum of label tokens over every micro-batch of every rank,

so each micro-batch's backward is scaled by n_i / N and gradients are summed (never averaged)
over data-parallel ranks; the result is independent of how the batch is split.
After the optimizer step every MoE layer's balancer turns the step's routing statistics
into the bias for the next step (SPEC 2.5): one reduction over the ranks that held tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moe_lc.ops.documents import DocumentBounds, upload
from moe_lc.optim import OptimConfig, apply_lr
from moe_lc.train.model_setup import ModelState
from moe_lc.train.runtime import Runtime


@dataclass
class StepResult:
    loss: float  # language-model loss, mean over the global batch's label tokens
    grad_norm: float  # before clipping
    lr: float
    label_tokens: int  # global
    aux_loss: float = 0.0  # extra terms of the objective (MTP, auxiliary balance), token-weighted


def train_step(
    state: ModelState,
    micro_batches: Sequence,
    step: int,
    total_steps: int,
    optim_cfg: OptimConfig,
    runtime: Runtime,
) -> StepResult:
    """Run 0-based optimizer step `step` of `total_steps` on this rank's micro-batches."""
    model, optimizer, device = state.model, state.optimizer, runtime.device
    local_tokens = sum(b.num_label_tokens for b in micro_batches)
    global_tokens = state.global_label_tokens(local_tokens)
    denom = max(global_tokens, 1)
    lm_sum = torch.zeros((), dtype=torch.float64, device=device)
    extra_sum = torch.zeros((), dtype=torch.float64, device=device)
    autocast = runtime.autocast if state.autocast_forward else _no_autocast
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        state.set_gradient_sync(i == last)
        docs = DocumentBounds.from_host(batch.cu_seqlens, device)  # the layers never read the device back
        with autocast():
            out = model(
                upload(batch.input_ids, device),
                labels=upload(batch.labels, device),
                docs=docs,
                return_logits=False,
            )
        n = batch.num_label_tokens
        if n == 0:  # nothing to learn (all padding); backward anyway so that data-parallel hooks fire
            if bool(torch.isfinite(out.loss)):
                (out.loss * 0.0).backward()
            continue
        (out.loss * (n / denom)).backward()
        lm_sum += out.lm_loss.detach().double() * n
        extra_sum += (out.loss.detach() - out.lm_loss.detach()).double() * n
    state.finish_gradient_sync()
    grad_norm = state.clip_grad_norm(optim_cfg.grad_clip)
    lr = apply_lr(optimizer, step, total_steps, optim_cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for moe in state.moe_layers():
        moe.balancer.update(state.balance_group)
    sums = torch.stack([lm_sum, extra_sum])
    if runtime.distributed and state.mesh is not None:
        from moe_lc.parallel import data_parallel_group

        group = data_parallel_group(state.mesh)
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
    lm, extra = (sums / denom).tolist()
    return StepResult(loss=lm, grad_norm=grad_norm, lr=lr, label_tokens=global_tokens, aux_loss=extra)


class _no_autocast:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
