"""Running a rank's pipeline stages through one step of their schedule.

`Pipeline.run` executes the rank's order (`pipeline_schedule.rank_actions`) over the step's
micro-batches. Per micro-batch the rank keeps the sources of the residual stream it has seen, each
under its source index, with the tensor it first had: a received leaf, or a tensor its stage
computed. A stage's input is built from them:

- the sources the rank already had (its earlier stage on this micro-batch) are reused as detached
  copies; their gradients are summed into the micro-batch's pending gradient of that source;
- the boundary carries the rest, and the partial sum, as new leaves (point to point from the
  previous stage's rank, or handed over on the rank when the previous stage is there too).

Backward of a stage (B, or I then W): the roots are its partial sum, the sources it computed (with
their pending gradients, from later stages on the rank and from wherever it sent them) and its
share of the objective; the gradients of its input leaves go back to the previous stage, plus the
pending gradients of the sources it received (which later stages used). The gradient of a
source therefore reaches the rank that computed it once, summed over all its uses.

Data parallelism inside a stage: FSDP reduces a unit's gradients in the last backward that reaches
the unit on this rank (its sync is off before). FSDP reduces a unit when the gradient reaches its
inputs, which under a split backward comes before the weight gradients exist, so with FSDP the
zero-bubble schedules run each backward whole at its I slot (W does nothing); ZeRO-1 keeps the
split. So does full activation checkpointing; selective checkpointing allows one backward per
region and runs whole backwards too. The weight split is torch's
(`torch.distributed.pipelining._backward`; a torch without it runs whole backwards); the first
stage has no input gradient to compute, so its whole backward runs at W.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from moe_lc.parallel.activation_checkpointing import CheckpointMode, activation_checkpointing_of
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.pipeline_schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    KINDS,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    rank_actions,
)
from moe_lc.parallel.pipeline_stage import BoundaryPlan, PipelineStage, StageBatch, stream_shape

PARTIAL = -1  # the label of the partial sum among a boundary's tensors (sources are labelled by index)
MAX_MICRO_BATCHES = 1 << 12  # per step, for unique message tags


@dataclass
class _Forward:
    """What a stage's forward on one micro-batch left for its backward."""

    received: list[tuple[int, Tensor]]  # (label, leaf) of what crossed the boundary into it
    reused: list[tuple[int, Tensor]]  # (source, leaf copy) of the sources its rank had
    produced: list[tuple[int, Tensor]]  # (source, tensor) it computed
    partial: Optional[Tensor]  # its output partial sum (non-last stages)
    objective: Optional[Tensor]
    sent: list[int] = field(default_factory=list)  # labels of the boundary out of it, in order


@dataclass
class _Step:
    """The state of one step on this rank."""

    batches: Sequence[StageBatch]
    activation_dtype: torch.dtype  # what sublayer outputs compute in (bf16 under autocast)
    # micro-batch -> source -> the tensor the rank first had of it
    origins: dict[int, dict[int, Tensor]] = field(default_factory=lambda: defaultdict(dict))
    pending: dict[int, dict[int, Tensor]] = field(default_factory=lambda: defaultdict(dict))  # micro -> source -> grad
    forwards: dict[tuple[int, int], _Forward] = field(default_factory=dict)
    inbox: dict[tuple[str, int, int], tuple[list[Tensor], list[Any]]] = field(default_factory=dict)  # receives
    handed: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)  # boundaries inside the rank
    outbox: dict[tuple[str, int, int], list[Tensor]] = field(default_factory=dict)  # computed, to send
    weight_work: dict[tuple[int, int], Any] = field(default_factory=dict)  # I's leftovers for W
    sends: list[Any] = field(default_factory=list)
    lm_sum: Optional[Tensor] = None
    extra_sum: Optional[Tensor] = None
    measured: tuple[Tensor, ...] = ()  # evaluation: the last stage's measures


class Pipeline:
    """This rank's pipeline stages and their schedule; `run` takes one step's micro-batches.

    ``plans``: every stage's boundary (all ranks), ``stages``: this rank's stage modules by index,
    ``group``: the pp process group (ranks of one pipeline), ``compute_dtype``: what the parameters
    compute in (the embedding's output dtype).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        plans: Sequence[BoundaryPlan],
        stages: dict[int, PipelineStage],
        group: dist.ProcessGroup,
        compute_dtype: torch.dtype,
    ) -> None:
        self.model, self.layout, self.plans, self.stages, self.group = model, layout, list(plans), stages, group
        self.rank = dist.get_rank(group)
        self.compute_dtype = compute_dtype
        self.mode = model.cfg.attn_res.mode
        self.d_model = model.cfg.d_model
        self.last = len(self.plans) - 1
        self.fsdp_units = {k: [m for m in stage.modules() if isinstance(m, FSDPModule)] for k, stage in stages.items()}
        uses_fsdp = any(self.fsdp_units.values())
        self._can_split = KINDS[layout.pp_schedule].splits_backward and not uses_fsdp
        self._max_tensors = 1 + max(p.tensors() for p in self.plans)

    # ------------------------------------------------------------------ one step

    def run(self, batches: Sequence[StageBatch],
            autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[Tensor, Tensor]:
        """Forward and backward of every micro-batch through this rank's stages, in schedule order.

        Returns this rank's sums of the weighted LM terms (its last stage; else 0) and of the other
        weighted terms of the objective (MTP, balance losses), i.e. of n_i / N x each term, float64
        device scalars. Gradients accumulate in the parameters (with the batches' ``weights``).
        """
        if len(batches) > MAX_MICRO_BATCHES:
            raise ValueError(f"a pipeline step takes at most {MAX_MICRO_BATCHES} micro-batches, got {len(batches)}")
        device = batches[0].weights.lm.device
        step = _Step(batches, self._activation_dtype(autocast, device), lm_sum=torch.zeros((), dtype=torch.float64, device=device),
                     extra_sum=torch.zeros((), dtype=torch.float64, device=device))
        actions = rank_actions(self.layout.pp_schedule, self.layout.pp, self.layout.stages_per_rank, len(batches),
                               self.rank)
        last_backward = self._last_backward_of_units(actions)
        split = self.splits_backward
        for index, action in enumerate(actions):
            if action.kind == FORWARD:
                with autocast():
                    self._forward(step, action)
            elif action.kind in (BACKWARD, BACKWARD_INPUT):
                self._set_gradient_sync(last_backward, index)
                self._backward(step, action, split=split and action.kind == BACKWARD_INPUT)
            elif action.kind == BACKWARD_WEIGHT:
                self._weights(step, action)
            elif action.kind in (SEND_F, SEND_B):
                self._send(step, action)
            else:
                self._receive(step, action)
        for work in step.sends:
            work.wait()
        leftover = {m: sorted(p) for m, p in step.pending.items() if p}
        if leftover or step.inbox or step.handed or step.weight_work:
            raise RuntimeError(f"pipeline step ended with gradients or messages nobody used (micro-batch: sources "
                               f"{leftover}, unread {sorted(step.inbox)}); the schedule's order is inconsistent")
        return step.lm_sum, step.extra_sum

    @torch.no_grad()
    def evaluate(self, batch: StageBatch, autocast: Callable[[], contextlib.AbstractContextManager]) -> list[Tensor]:
        """A forward of one batch through every stage in order, for evaluation: the last stage's
        ``batch.measures``, one value per position of ``batch.labels`` (which every rank has), shared
        with every rank of the pipeline."""
        zero = torch.zeros((), dtype=torch.float64, device=batch.weights.lm.device)
        step = _Step([batch], self._activation_dtype(autocast, zero.device), lm_sum=zero.clone(),
                     extra_sum=zero.clone())
        for k in range(len(self.plans)):
            if k not in self.stages:
                continue
            if k > 0 and not self._local(k - 1):
                self._receive(step, Action(RECV_F, k, 0))
            with autocast():
                self._forward(step, Action(FORWARD, k, 0))
            step.forwards.pop((k, 0))
            if k < self.last and not self._local(k):
                self._send(step, Action(SEND_F, k, 0))
        for work in step.sends:
            work.wait()
        out = list(step.measured) if self.has_last else [
            torch.empty(batch.labels.numel(), dtype=torch.float32, device=zero.device) for _ in batch.measures]
        source = dist.get_global_rank(self.group, self.plans[self.last].rank)
        for t in out:
            dist.broadcast(t, src=source, group=self.group)
        return out

    def _activation_dtype(self, autocast: Callable[[], contextlib.AbstractContextManager],
                          device: torch.device) -> torch.dtype:
        """What sublayer outputs compute in: autocast's dtype where ``autocast`` enables it, else the
        parameters' (the stream's wire dtypes follow from it)."""
        with autocast():
            if torch.is_autocast_enabled(device.type):
                return torch.get_autocast_dtype(device.type)
        return self.compute_dtype

    def describe(self) -> str:
        """One line for the run's log: the schedule and every stage's layers and rank."""
        stages = ", ".join(f"{p.layers.start}-{p.layers.stop - 1}@r{p.rank}" for p in self.plans)
        split = " (backward split in input and weight halves)" if self.splits_backward else ""
        return f"pipeline {self.layout.pp_schedule}{split}: {len(self.plans)} stages, layers {stages}"

    @property
    def splits_backward(self) -> bool:
        """Whether I and W run apart: a zero-bubble schedule, no FSDP, and no selective activation
        checkpointing (its recompute serves one backward pass per region)."""
        return (self._can_split and activation_checkpointing_of(self.model).mode != CheckpointMode.selective
                and _backward_split() is not None)

    # ------------------------------------------------------------------ forward

    def _forward(self, step: _Step, action: Action) -> None:
        k, m = action.stage, action.micro
        plan, batch = self.plans[k], step.batches[m]
        origins = step.origins[m]
        reused = [(s, origins[s].detach().requires_grad_()) for s in range(plan.held)]
        received: list[tuple[int, Tensor]] = []
        if k > 0:
            if self._local(k - 1):
                if plan.partial:
                    received.append((PARTIAL, step.handed.pop(("F", k, m)).detach().requires_grad_()))
            else:
                tensors, works = step.inbox.pop(("F", k, m))
                for work in works:
                    work.wait()
                received = [(label, t.requires_grad_()) for label, t in zip(_labels(plan), tensors)]
        for label, leaf in received:
            if label != PARTIAL:
                origins[label] = leaf
        sources = [*(leaf for _, leaf in reused), *(leaf for label, leaf in received if label != PARTIAL)]
        partial = [leaf for label, leaf in received if label == PARTIAL]
        result = self.stages[k](*sources, *partial, batch=batch)
        first_new = plan.sources if k > 0 else 0
        produced = [(first_new + i, t) for i, t in enumerate(result.produced)]
        for s, t in produced:
            origins[s] = t
        record = _Forward(received, reused, produced, result.partial, result.objective)
        step.forwards[(k, m)] = record
        if result.measured:
            step.measured = result.measured
        if result.lm_term is not None:
            step.lm_sum += result.lm_term.double()
        if result.extra is not None:
            step.extra_sum += result.extra.double()
        if k == self.last:
            return
        nxt = self.plans[k + 1]
        if self._local(k):
            if nxt.partial:
                step.handed[("F", k + 1, m)] = result.partial
            record.sent = [PARTIAL] if nxt.partial else []
            return
        record.sent = _labels(nxt)
        outgoing = [(label, result.partial if label == PARTIAL else origins[label]) for label in record.sent]
        step.outbox[("F", k, m)] = [t.detach().to(self._wire_dtype(step, label)).contiguous() for label, t in outgoing]

    # ------------------------------------------------------------------ backward

    def _backward(self, step: _Step, action: Action, split: bool) -> None:
        k, m = action.stage, action.micro
        record = step.forwards.pop((k, m))
        pending = step.pending[m]
        partial_grad = None
        if k < self.last:
            if self._local(k):
                partial_grad = step.handed.pop(("B", k, m)) if record.sent else None
            else:
                grads, works = step.inbox.pop(("B", k, m))
                for work in works:
                    work.wait()
                for label, grad in zip(record.sent, grads):
                    if label == PARTIAL:
                        partial_grad = grad
                    else:
                        _accumulate(pending, label, grad)
        roots, root_grads = [], []
        if record.partial is not None and partial_grad is not None:
            roots.append(record.partial)
            root_grads.append(partial_grad.to(record.partial.dtype))
        for s, tensor in record.produced:
            grad = pending.pop(s, None)
            if grad is not None:
                roots.append(tensor)
                root_grads.append(grad.to(tensor.dtype))
        if record.objective is not None:
            roots.append(record.objective)
            root_grads.append(torch.ones_like(record.objective))
        if not roots:
            raise RuntimeError(f"stage {k} got no gradient for micro-batch {m}")
        leaves = [leaf for _, leaf in record.received] + [leaf for _, leaf in record.reused]
        if split and not leaves:  # the first stage: no input gradient to hurry, its whole backward is W's
            step.weight_work[(k, m)] = (roots, root_grads)
            grads = []
        elif split:
            weights = self.stages[k].weights()
            grads, param_groups = _backward_split()[0](roots, root_grads, leaves, iter(weights))
            step.weight_work[(k, m)] = param_groups
            grads = list(grads)
        else:
            torch.autograd.backward(roots, root_grads)
            grads = [leaf.grad for leaf in leaves]
        received_grads = grads[: len(record.received)]
        for (s, leaf), grad in zip(record.reused, grads[len(record.received):]):
            if grad is not None:
                _accumulate(pending, s, grad)
        back = []
        for (label, leaf), grad in zip(record.received, received_grads):
            grad = torch.zeros_like(leaf) if grad is None else grad
            if label != PARTIAL:
                extra = pending.pop(label, None)
                grad = grad if extra is None else grad + extra.to(grad.dtype)
                step.origins[m].pop(label, None)
            back.append(grad)
        for s, _ in record.produced:
            step.origins[m].pop(s, None)
        if k == 0:
            return
        if self._local(k - 1):
            if back:
                step.handed[("B", k - 1, m)] = back[-1]  # only the partial sum crosses inside a rank
        else:
            step.outbox[("B", k, m)] = [g.to(self._wire_dtype(step, label)).contiguous()
                                        for (label, _), g in zip(record.received, back)]

    def _weights(self, step: _Step, action: Action) -> None:
        work = step.weight_work.pop((action.stage, action.micro), None)
        if isinstance(work, tuple):  # a backward left whole for W
            torch.autograd.backward(*work)
        elif work is not None:
            _backward_split()[1](iter(self.stages[action.stage].weights()), work)

    # ------------------------------------------------------------------ communication

    def _local(self, k: int) -> bool:
        """Whether the boundary from stage k to k + 1 stays on this rank."""
        return self.plans[k].rank == self.plans[k + 1].rank

    def _wire_dtype(self, step: _Step, label: int) -> torch.dtype:
        """The dtype a boundary tensor has in the one-process model: sublayer outputs and the
        embedding in the activation dtype (autocast), the embedding in the parameters' dtype under
        ``fp32_embedding``, and the plain residual (mode none) holds both."""
        embedding = self.compute_dtype if self.model.cfg.fp32_embedding else step.activation_dtype
        if self.mode == "none":
            return torch.promote_types(embedding, step.activation_dtype)
        return embedding if label == 0 else step.activation_dtype

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.plans[stage].rank)

    def _tag(self, direction: int, stage: int, micro: int, index: int) -> int:
        """The message's tag (gloo matches on it; NCCL ignores it and matches in order): direction
        (0 activations, 1 gradients, 2 the embedding copy's gradient), the sending stage, the
        micro-batch, the tensor's index."""
        return ((direction * len(self.plans) + stage) * MAX_MICRO_BATCHES + micro) * self._max_tensors + index

    def _send(self, step: _Step, action: Action) -> None:
        k, m = action.stage, action.micro
        if action.kind == SEND_F:
            tensors, peer, direction = step.outbox.pop(("F", k, m)), self._peer(k + 1), 0
        else:
            tensors, peer, direction = step.outbox.pop(("B", k, m)), self._peer(k - 1), 1
        ops = [dist.P2POp(dist.isend, t, peer, self.group, self._tag(direction, k, m, i))
               for i, t in enumerate(tensors)]
        if ops:
            step.sends.extend(dist.batch_isend_irecv(ops))
            step.sends.append(_KeepAlive(tensors))

    def _receive(self, step: _Step, action: Action) -> None:
        k, m = action.stage, action.micro
        batch = step.batches[m]
        shape = stream_shape(batch.tokens, self.layout.tp, self.layout.cp, self.d_model)
        device = batch.weights.lm.device
        if action.kind == RECV_F:
            into, peer, direction, key, sender = self.plans[k], self._peer(k - 1), 0, ("F", k, m), k - 1
        else:
            into, peer, direction, key, sender = self.plans[k + 1], self._peer(k + 1), 1, ("B", k, m), k + 1
        labels = _labels(into)
        buffers = [torch.empty(shape, dtype=self._wire_dtype(step, label), device=device) for label in labels]
        ops = [dist.P2POp(dist.irecv, b, peer, self.group, self._tag(direction, sender, m, i))
               for i, b in enumerate(buffers)]
        step.inbox[key] = (buffers, dist.batch_isend_irecv(ops) if ops else [])

    # ------------------------------------------------------------------ FSDP

    def _last_backward_of_units(self, actions: Sequence[Action]) -> dict[int, int]:
        """For each FSDP unit of this rank (by id), the index of the last backward that reaches it."""
        last: dict[int, int] = {}
        for index, a in enumerate(actions):
            if a.kind in (BACKWARD, BACKWARD_INPUT):
                borrowed = [m for m in self.stages[a.stage].borrowed if isinstance(m, FSDPModule)]
                for unit in [*self.fsdp_units.get(a.stage, []), *borrowed]:
                    last[id(unit)] = index
        return last

    def _set_gradient_sync(self, last_backward: dict[int, int], index: int) -> None:
        if not last_backward:
            return
        every = self.layout.fsdp_reduce_every_micro_batch
        for units in self.fsdp_units.values():
            for unit in units:
                unit.set_requires_gradient_sync(every or last_backward.get(id(unit)) == index, recurse=False)

    # ------------------------------------------------------------------ after the step

    @property
    def has_first(self) -> bool:
        """This rank holds the first stage (it embeds the input ids)."""
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        """This rank holds the last stage (it reads the labels)."""
        return self.last in self.stages

    def routing_statistics(self) -> tuple[Tensor, Tensor]:
        """MaxVio [layers] and expert loads [layers, experts] of every MoE layer of the whole model (the
        MTP layer last), each rank filling its stages' layers: one sum over the pipeline."""
        cfg = self.model.cfg
        order = [i for i in range(cfg.num_layers + int(cfg.mtp)) if not cfg.is_dense_layer(i)]
        mine = [(layer.layer_idx, layer.ffn.balancer) for layer in self.model.layers if layer.is_moe]
        if self.model.mtp is not None and self.model.mtp.layer.is_moe:
            mine.append((cfg.num_layers, self.model.mtp.layer.ffn.balancer))
        device = next(self.model.parameters()).device
        table = torch.zeros(len(order), 1 + cfg.moe.num_routed, dtype=torch.float64, device=device)
        for index, balancer in mine:
            row = order.index(index)
            table[row, 0] = balancer.last_maxvio.double()
            table[row, 1:] = balancer.last_loads.double()
        dist.all_reduce(table, group=self.group)
        return table[:, 0], table[:, 1:]

    def embedding_copy(self) -> Optional[nn.Parameter]:
        """The last stage's copy of the embedding on this rank, when the first stage is on another rank
        (MTP reads it); its gradient is summed with the first stage's by `finish_gradient_sync`."""
        if self.last in self.stages and 0 not in self.stages and self.model.embed is not None:
            return self.model.embed.weight
        return None

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Sum the two embedding copies' gradients (first and last stage), so both take the same step."""
        if not self.model.cfg.mtp or self.plans[0].rank == self.plans[self.last].rank:
            return
        if 0 in self.stages:
            weight, peer = self.model.embed.weight, self._peer(self.last)
        elif self.last in self.stages:
            weight, peer = self.model.embed.weight, self._peer(0)
        else:
            return
        grad = weight.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        theirs = torch.empty_like(local)
        tag = self._tag(2, 0, 0, 0)
        if 0 in self.stages:  # first stage: add the copy's gradient, send the sum back
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer, self.group, tag)])[0].wait()
            local.add_(theirs)
            dist.batch_isend_irecv([dist.P2POp(dist.isend, local, peer, self.group, tag + 1)])[0].wait()
        else:
            dist.batch_isend_irecv([dist.P2POp(dist.isend, local, peer, self.group, tag)])[0].wait()
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer, self.group, tag + 1)])[0].wait()
            local.copy_(theirs)


class _KeepAlive:
    """Holds sent tensors until the step's end (a send reads its buffer until it completes)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = []


@functools.lru_cache(maxsize=1)
def _backward_split() -> Optional[tuple[Callable, Callable]]:
    """torch's (input half, weight half) of a stage's backward, or None (a torch without them: whole
    backwards). Imported when first needed: torch.distributed.pipelining imports Triton, which the
    kernel tests must be the first to import."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:  # pragma: no cover - older torch
        return None
    return stage_backward_input, stage_backward_weight


def _labels(plan: BoundaryPlan) -> list[int]:
    """What crosses into ``plan``'s stage, in order: the sources it lacks, then the partial sum."""
    return [*plan.sent, *([PARTIAL] if plan.partial else [])]


def _accumulate(pending: dict[int, Tensor], source: int, grad: Tensor) -> None:
    pending[source] = grad if source not in pending else pending[source] + grad
