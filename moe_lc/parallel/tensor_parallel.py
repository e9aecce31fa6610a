"""Tensor parallelism with sequence parallelism (docs/design.md §8.3), applied from outside the model.

Regions. Between decoder sublayers the residual stream is split along the sequence over the
tp ranks (SP): norms, AttnRes mixers, the router, the latent projections and the routed
experts all work on this rank's tokens. Each token mixer (KDA, MLA) and each dense GLU
(first-layer FFN, shared experts) is a TP region: its input is all-gathered along the
sequence, it computes a 1/tp slice of its heads or hidden units over the full sequence, and
its output projection's partial sums are reduce-scattered back to sequence shards.

Splits (Shard(0) of a Linear weight = output features = column parallel; Shard(1) = row):
    KDA   q/k/v, beta, decay_up, output gate (last linear): Shard(0) by heads;
          q/k/v convs, dt_bias, A_log: Shard(0) with their heads; o_proj: Shard(1);
          decay_down (low rank), first linear of a low-rank gate, per-head o_norm: replicated.
    MLA   q_up (or q_proj), kv_up, gate_proj: Shard(0) by heads; o_proj: Shard(1);
          q_down, kv_down, their norms, k_shared: replicated (they run on the gathered sequence).
    GLU   w_gate, w_in: Shard(0); w_out: Shard(1).
    Embedding and LM head: Shard(0) over the (padded) vocabulary, with a vocab-parallel
    cross-entropy. Everything else is replicated. Routed experts are left to expert parallelism.

Replicated weights only ever see this rank's share of the work, so their gradients are
summed over tp (``local_params``): every parameter gradient is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from moe_lc.model.ffn import GatedFFN
from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import RoutedExperts
from moe_lc.model.precision import upcast
from moe_lc.model.transformer import IGNORE_INDEX, ModelOutput, MoELCModel
from moe_lc.parallel.comm import all_reduce_sum, gather_last_dim, gather_sequence, reduce_scatter_sequence

SEQUENCE_DIM = -2  # tokens: dim 1 of [B, T, d], dim 0 of flattened [N, d]

COLUMN, ROW = Shard(0), Shard(1)


def tensor_parallel_plan(model: MoELCModel) -> dict[str, Shard]:
    """Fully-qualified parameter name -> Shard placement on the tp mesh; absent = replicated."""
    plan: dict[str, Shard] = {}

    def put(prefix: str, placement: Shard, *names: str) -> None:
        for name in names:
            plan[f"{prefix}{name}"] = placement

    for prefix, module in model.named_modules():
        p = f"{prefix}." if prefix else ""
        if isinstance(module, KDAttention):
            put(p, COLUMN, "q_proj.weight", "k_proj.weight", "v_proj.weight", "beta_proj.weight")
            put(p, COLUMN, "q_conv.weight", "k_conv.weight", "v_conv.weight", "decay_up.weight")
            put(p, COLUMN, "dt_bias", "A_log", f"gate_proj.{len(module.gate_proj) - 1}.weight")
            put(p, ROW, "o_proj.weight")
        elif isinstance(module, GatedMLA):
            put(p, COLUMN, "kv_up.weight", "q_up.weight" if module.cfg.q_lora_rank is not None else "q_proj.weight")
            if module.gate_proj is not None:
                put(p, COLUMN, "gate_proj.weight")
            put(p, ROW, "o_proj.weight")
        elif isinstance(module, GatedFFN):
            put(p, COLUMN, "w_gate.weight", "w_in.weight")
            put(p, ROW, "w_out.weight")
    put("", COLUMN, "embed.weight", "lm_head.weight")
    return plan


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/tp, (r+1) V/tp) of the table on tp rank r; output reduce-scattered to sequence shards."""

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = weight
        self.group = group

    def forward(self, input_ids: Tensor) -> Tensor:
        rows = self.weight.shape[0]  # local rows inside forward (local_params)
        start = dist.get_rank(self.group) * rows
        local_ids = input_ids - start
        inside = (local_ids >= 0) & (local_ids < rows)
        out = F.embedding(local_ids.clamp(0, rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return reduce_scatter_sequence(out, SEQUENCE_DIM, self.group)


class VocabParallelLMHead(nn.Module):
    """Gathers the sequence and returns this rank's slice of the (padded) vocabulary's logits."""

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = weight
        self.group = group

    def forward(self, h: Tensor) -> Tensor:
        return F.linear(gather_sequence(h, SEQUENCE_DIM, self.group), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE from vocab-sharded logits: one max, one sum-exp and one target all-reduce."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, vocab_size: int, group) -> Tensor:
        x = upcast(logits).clone()
        rows = x.shape[-1]
        start = dist.get_rank(group) * rows
        x[..., max(0, min(rows, vocab_size - start)) :] = float("-inf")  # padded vocabulary rows
        peak = x.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        x.sub_(peak.unsqueeze(-1))
        exp = x.exp()
        total = all_reduce_sum(exp.sum(dim=-1), group)
        local = labels - start
        inside = (local >= 0) & (local < rows)
        safe = local.clamp(0, rows - 1).unsqueeze(-1)
        target = all_reduce_sum(x.gather(-1, safe).squeeze(-1) * inside, group)
        valid = labels != IGNORE_INDEX
        loss = torch.where(valid, total.log() - target, torch.zeros_like(target))
        probs = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(probs, safe, inside & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        probs, safe, hit, valid = ctx.saved_tensors
        g = (grad_loss * valid).unsqueeze(-1)
        grad = probs * g
        grad.scatter_add_(-1, safe, -(g * hit.unsqueeze(-1)))
        return grad.to(ctx.logits_dtype), None, None, None


class VocabParallelLoss:
    """Mean token cross-entropy over label tokens, equal to the full-vocabulary loss."""

    def __init__(self, vocab_size: int, group: dist.ProcessGroup) -> None:
        self.vocab_size, self.group = vocab_size, group

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        per_token = _VocabParallelCrossEntropy.apply(logits, labels, self.vocab_size, self.group)
        return per_token.sum() / (labels != IGNORE_INDEX).sum()


def _enter_region(group: dist.ProcessGroup):
    def hook(module: nn.Module, args):
        return (gather_sequence(args[0], SEQUENCE_DIM, group), *args[1:])

    return hook


def _leave_region(group: dist.ProcessGroup):
    def hook(module: nn.Module, args, output: Tensor) -> Tensor:
        return reduce_scatter_sequence(output, SEQUENCE_DIM, group)

    return hook


def _full_logits(vocab_size: int, group: dist.ProcessGroup):
    """Model forward hook: returned logits are full-vocabulary, as in one process."""

    def hook(module: nn.Module, args, output: ModelOutput) -> ModelOutput:
        if isinstance(output, ModelOutput) and output.logits is not None:
            output.logits = gather_last_dim(output.logits, group)[..., :vocab_size]
        return output

    return hook


def distribute_parameters(module: nn.Module, mesh: DeviceMesh, placement_of) -> None:
    """Replace every direct parameter by a DTensor built from this rank's full copy (no communication).

    Every rank must hold identical full weights (same seed), as ``build_model`` gives.
    """
    for name, param in list(module._parameters.items()):
        if param is None:
            continue
        dt = distribute_tensor(param.detach(), mesh, [placement_of(name)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def apply_tensor_parallel(model: MoELCModel, tp_mesh: DeviceMesh) -> MoELCModel:
    """Split the model over ``tp_mesh`` (1-D) in place; routed experts are not touched."""
    group = tp_mesh.get_group()
    plan = tensor_parallel_plan(model)
    if model.embed is not None:  # a pipeline stage's model holds what its stages run
        model.embed = VocabParallelEmbedding(model.embed.weight, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelLMHead(model.lm_head.weight, group)
    for prefix, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            continue
        p = f"{prefix}." if prefix else ""
        distribute_parameters(module, tp_mesh, lambda name: plan.get(p + name, Replicate()))
        if isinstance(module, (KDAttention, GatedMLA, GatedFFN)):
            module.register_forward_pre_hook(_enter_region(group))
            module.register_forward_hook(_leave_region(group))
    model.lm_loss = VocabParallelLoss(model.cfg.vocab_size, group)
    model.register_forward_hook(_full_logits(model.cfg.vocab_size, group))
    return model

