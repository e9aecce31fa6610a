"""One optimizer step: accumulate micro-batches, clip, update, rebalance the experts; and a
stage's steps in order, with the next step's batches prepared ahead.

The loss of the step is the mean over the label tokens of the whole global batch:

    L = sum_i n_i * loss_i / N,    N = sum of label tokens over every micro-batch of every rank,

so each micro-batch's backward is scaled by n_i / N and gradients are summed (never averaged)
over data-parallel ranks; the result is independent of how the batch is split. With pp > 1 the
micro-batches go through the pipeline's schedule instead of one after the other, with the same
weights, and the reported terms are summed over the pipeline's stages. With cp > 1 every cp rank
reads the same rows and runs its zigzag shard of each (`moe_lc.parallel.context.shard_model_inputs`);
n_i and N count the shard's label tokens, summed over dp x cp, and MTP's mean over the row's
targets is split by each shard's share of them, so the step equals one process on the whole rows.
After the optimizer step every MoE layer's balancer turns the step's routing statistics
into the bias for the next step: one reduction over the ranks that held tokens.

A step queues all of its work without waiting for the device and reads back once, at its end
(`read_to_host`): loss, gradient norm, label tokens, attended keys, the balancers' loads and
MaxVio, and the launch's stop request, in one copy. Before that nothing waits: uploads go
through pinned memory, N stays on the device (the backward scale n_i / N is a device scalar),
the gradient norm and the routing statistics are device tensors, and the ranks' stop requests
travel in a queued all-reduce.

A step whose global loss or gradient norm is not finite is skipped on every rank: no optimizer
update, the expert biases kept (`moe_lc.train.bad_steps`); its result says so. A fused AdamW
skips on the device; any other optimizer reads that decision back first (a second read). The
stop-request all-reduce also carries each rank's own time of the step before (its batch wait
and optimizer update), for the straggler report (`moe_lc.train.health`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from moe_lc.config import ConfigError
from moe_lc.metrics import DeviceTimer, device_memory_bytes, peak_memory_bytes
from moe_lc.metrics.breakdown import region
from moe_lc.model.accounting import causal_keys_per_token
from moe_lc.model.moe import reuse_weight_casts
from moe_lc.ops.documents import DocumentBounds, upload
from moe_lc.optim import OptimConfig, apply_lr
from moe_lc.optim.clip import clip_divisor, clips
from moe_lc.model.transformer import IGNORE_INDEX, mtp_labels
from moe_lc.parallel import data_parallel_group
from moe_lc.parallel.activation_checkpointing import CheckpointMode
from moe_lc.parallel.context import ContextShard, shard_model_inputs, shard_row
from moe_lc.parallel.loss_weights import TermWeights, weighted_terms
from moe_lc.parallel.pipeline_stage import StageBatch
from moe_lc.train.bad_steps import skips_on_device, step_if_finite, update_biases_if_finite
from moe_lc.train.gc_schedule import StepScheduledCollection
from moe_lc.train.curriculum import StagePlan
from moe_lc.train.data import StageData
from moe_lc.train.model_setup import ModelState
from moe_lc.train.prefetch import Prefetcher
from moe_lc.train.runtime import Runtime

PREFETCH_DEPTH = 1  # steps of micro-batches waiting while one step runs


@dataclass
class StepResult:
    loss: float  # language-model loss, mean over the global batch's label tokens
    grad_norm: float  # before clipping
    lr: float
    label_tokens: int  # global
    keys_per_token: float  # mean keys a query attends to within its document, over the global batch
    maxvio_per_layer: list[float]  # per MoE layer, of this step's routing
    expert_loads: list[list[int]]  # per MoE layer and expert: tokens routed to it this step (global)
    stop_requested: bool = False  # some rank was asked to stop (a signal): checkpoint and stop after this step
    aux_loss: float = 0.0  # extra terms of the objective (MTP, auxiliary balance), token-weighted
    skipped: bool = False  # the loss or gradient norm was not finite: nothing was updated
    optimizer_s: float = 0.0  # this rank's optimizer update (device time on a GPU)
    own_s_per_rank: list[float] = field(default_factory=list)  # each rank's own time in the step before (health.py)


class Interval:
    """The device time of work queued between `start` and `stop`, read after the step's one read
    (CUDA events, so nothing waits when they are recorded; the host clock on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: Optional[tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self._t = [0.0, 0.0]

    def start(self) -> None:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._t[0] = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._events[1].record()
        else:
            self._t[1] = time.perf_counter()

    def seconds(self) -> float:
        """After the work has finished (the end-of-step read waited for it)."""
        if self.cuda:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._t[1] - self._t[0]


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """Around the step's one read: lets it wait for the GPU even under
    `torch.cuda.set_sync_debug_mode("error")` (which a test sets to show that nothing else waits)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def read_to_host(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The values of `tensors` (one device) as host floats, in one device-to-host copy: the point
    where a step waits for its work. Integers up to 2**53 come back exact."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    with host_sync_allowed():
        values = flat.tolist()
    out, start = [], 0
    for t in tensors:
        out.append(values[start : start + t.numel()])
        start += t.numel()
    return out


def _sum_over_data_parallel(values: torch.Tensor, state: ModelState) -> torch.Tensor:
    """In-place sum over the data-parallel ranks (a queued all-reduce; nothing to do on one rank)."""
    group = data_parallel_group(state.mesh) if state.mesh is not None else None
    if group is not None:
        dist.all_reduce(values, group=group)
    return values


def _on_every_rank(flag: torch.Tensor, runtime: Runtime) -> torch.Tensor:
    """`flag` (a device bool) where it holds on every rank, else false everywhere (a queued all-reduce):
    the loss and norm are global already, but a rank whose copy of replicated gradients differs (a
    fault on one device) must not step alone."""
    if not runtime.distributed:
        return flag
    t = flag.to(torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.reshape(()).bool()


def _shared_over_ranks(stop: bool, own_s: float, runtime: Runtime) -> torch.Tensor:
    """[any rank's stop request, rank 0's own time, rank 1's, ...] on every rank, as one device
    vector (a queued all-reduce: each rank fills its own slot, MAX keeps every slot)."""
    values = [0.0] * (1 + runtime.world_size)
    values[0] = 1.0 if stop else 0.0
    values[1 + runtime.rank] = own_s
    t = upload(torch.tensor(values, dtype=torch.float64), runtime.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


FLOAT32_MAX = 3.4028234663852886e38


def adam_step_overflows(lr: float, beta1: float, step: int) -> bool:
    """Whether AdamW's step size lr / (1 - beta1^t) of 0-based step ``step`` exceeds float32. Checked
    on the host before the update: CPU AdamW raises on it, but CUDA's fused AdamW computes it on the
    device and writes inf weights without a word, so the run would fail a step later and vaguer."""
    return lr / (1.0 - beta1 ** (step + 1)) > FLOAT32_MAX


def lr_overflow_message(optim_cfg: OptimConfig, lr: float, step: int) -> str:
    return (f"optim.lr={optim_cfg.lr:g}: the optimizer update of step {step + 1} overflows float32 (its step "
            f"size lr / (1 - beta1^t) at lr {lr:.3g} exceeds 3.4e38); use a learning rate of order 1e-3")


def train_step(
    state: ModelState,
    micro_batches: Sequence,
    step: int,
    total_steps: int,
    optim_cfg: OptimConfig,
    runtime: Runtime,
    stop_requested: bool = False,
    own_s_before: float = 0.0,
) -> StepResult:
    """Run 0-based optimizer step `step` of `total_steps` on this rank's micro-batches.

    stop_requested: this rank was asked to stop; the result says whether any rank was.
    own_s_before: this rank's own time in the step before (its batch wait and optimizer update),
    shared with every rank in the end-of-step read.
    """
    optimizer, device = state.optimizer, runtime.device
    with region("data"):
        docs = [DocumentBounds.from_host(b.cu_seqlens, device) for b in micro_batches]
        context = _context_shard(state, micro_batches)
        labels_here = [_label_tokens_here(b, context) for b in micro_batches]
        lengths = [n for d in docs for n in d.lengths]
        tokens = sum(lengths)
        share = context.size if context is not None else 1  # cp ranks read the same rows
        # [label tokens, keys attended, tokens] of the global batch
        counts = upload(torch.tensor([sum(labels_here), causal_keys_per_token(lengths) * tokens / share,
                                      tokens / share], dtype=torch.float64), device)
        counts = _sum_over_data_parallel(counts, state)
        denom = counts[0].clamp(min=1)
    autocast = runtime.autocast if state.autocast_forward else contextlib.nullcontext
    # the weights' bf16 copies once a step, not once a micro-batch: the experts' and autocast's
    with reuse_weight_casts(state.model), runtime.step_weight_casts():
        if state.pipeline is not None:
            lm_sum, extra_sum = _pipeline_micro_batches(state, micro_batches, docs, labels_here, denom, runtime,
                                                        autocast, context)
        else:
            lm_sum, extra_sum = _micro_batches(state, micro_batches, docs, labels_here, denom, runtime, autocast,
                                               context)
    state.finish_gradient_sync()
    sums = _sum_over_pipeline(_sum_over_data_parallel(torch.stack([lm_sum, extra_sum]), state), state)
    update = Interval(device)
    with region("optimizer"):
        # torch's fused AdamW clips as it reads the gradients (one pass over them fewer)
        fold_clip = skips_on_device(optimizer) and clips(optim_cfg.grad_clip)
        grad_norm = state.clip_grad_norm(optim_cfg.grad_clip, scale_grads=not fold_clip)
        finite = _on_every_rank(torch.isfinite(grad_norm.to(device)) & torch.isfinite(sums).all(), runtime)
        lr = apply_lr(optimizer, step, total_steps, optim_cfg)
        if adam_step_overflows(lr, optim_cfg.betas[0], step):
            raise ConfigError(lr_overflow_message(optim_cfg, lr, step))
        update.start()
        try:
            step_if_finite(optimizer, finite, clip_divisor(grad_norm, optim_cfg.grad_clip) if fold_clip else None)
        except RuntimeError as err:
            if "overflow" not in str(err):
                raise
            raise ConfigError(lr_overflow_message(optim_cfg, lr, step)) from None
        update.stop()
        state.model.zero_grad(set_to_none=True)  # all of them: a skipped ZeRO-1 step leaves other ranks' shares too
    balancers = [moe.balancer for moe in state.moe_layers()]
    with region("router_dispatch"):
        update_biases_if_finite(balancers, state.balance_group, finite)
    maxvio_all, loads_all = _routing_statistics(state, balancers, device)
    queued = [sums / denom, grad_norm.reshape(1), counts, finite.reshape(1), maxvio_all, loads_all]
    if runtime.distributed:
        queued.append(_shared_over_ranks(stop_requested, own_s_before, runtime))
    host = read_to_host(queued)
    (lm, extra), (norm,), (label_tokens, keys, tokens), (was_finite,), maxvio = host[:5]
    experts = loads_all.shape[1]
    loads = [[int(x) for x in host[5][i * experts : (i + 1) * experts]] for i in range(len(maxvio))]
    if runtime.distributed:
        stop, *own = host[6]
    else:
        stop, own = stop_requested, [own_s_before]
    return StepResult(
        loss=lm, grad_norm=norm, lr=lr, label_tokens=int(label_tokens), keys_per_token=keys / max(tokens, 1.0),
        maxvio_per_layer=maxvio, expert_loads=loads, stop_requested=bool(stop), aux_loss=extra,
        skipped=not was_finite, optimizer_s=update.seconds(), own_s_per_rank=own,
    )


def _micro_batches(state: ModelState, micro_batches: Sequence, docs: list[DocumentBounds], labels_here: list[int],
                   denom: torch.Tensor, runtime: Runtime, autocast,
                   context: Optional[ContextShard]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of each micro-batch in turn (this rank's shard of it under cp);
    (sum n_i lm_i, sum n_i extra_i) on this rank."""
    model, device = state.model, runtime.device
    lm_sum = torch.zeros((), dtype=torch.float64, device=device)
    extra_sum = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, (batch, bounds, n) in enumerate(zip(micro_batches, docs, labels_here)):
        state.set_gradient_sync(i == last)
        with region("data"):
            input_ids, targets = upload(batch.input_ids, device), upload(batch.labels, device)
        if context is not None:
            inputs, weights = _row_shard(input_ids, targets, bounds, context, n, batch.num_label_tokens, denom)
            with autocast():
                out = model(**inputs, return_logits=False)
            lm, extra = weighted_terms(out.lm_loss, out.mtp_loss, out.aux_loss, model.mtp_weight, weights)
            (lm + extra).backward()
            lm_sum += lm.detach().double() * denom
            extra_sum += extra.detach().double() * denom
            continue
        with autocast():
            out = model(input_ids, labels=targets, docs=bounds, return_logits=False)
        if n == 0:  # nothing to learn (all padding); backward anyway so that data-parallel hooks fire.
            # The loss over no labels is NaN, its gradient zero: cross-entropy writes only at labels.
            (out.loss * 0.0).backward()
            continue
        (out.loss * (torch.full_like(denom, n) / denom).to(out.loss.dtype)).backward()  # n / N, correctly rounded
        lm_sum += out.lm_loss.detach().double() * n
        extra_sum += (out.loss.detach() - out.lm_loss.detach()).double() * n
    return lm_sum, extra_sum


def _context_shard(state: ModelState, micro_batches: Sequence) -> Optional[ContextShard]:
    """This rank's place in the cp group for the step's rows (None without context parallelism)."""
    if state.layout.cp == 1 or not micro_batches:
        return None
    return ContextShard.from_mesh(state.mesh, micro_batches[0].input_ids.shape[-1])


def _label_tokens_here(batch, context: Optional[ContextShard]) -> int:
    """Label tokens of the micro-batch this rank computes: all of them, or its shard's under cp (host)."""
    if context is None:
        return batch.num_label_tokens
    return int((shard_row(batch.labels, context) != IGNORE_INDEX).sum())


def _row_shard(input_ids: Optional[torch.Tensor], labels: Optional[torch.Tensor], docs: DocumentBounds,
               context: ContextShard, labels_here: int, labels_row: int,
               denom: torch.Tensor) -> tuple[dict, TermWeights]:
    """This rank's shard of one row as the model's keyword arguments (``shard_model_inputs``; what a
    pipeline's rank lacks stays absent) and its terms' weights in the step's loss, from the row's
    MTP targets made once."""
    mtp_row = mtp_labels(labels, docs) if labels is not None else None
    inputs = shard_model_inputs(input_ids, labels, docs, context, mtp_row)
    weights = TermWeights.shard(labels_here, labels_row, inputs.get("mtp_targets"), mtp_row, denom, IGNORE_INDEX)
    return inputs, weights


def _pipeline_micro_batches(state: ModelState, micro_batches: Sequence, docs: list[DocumentBounds],
                            labels_here: list[int], denom: torch.Tensor, runtime: Runtime, autocast,
                            context: Optional[ContextShard]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's micro-batches through the pipeline's schedule (the same per-micro-batch weights as
    without a pipeline); every rank rebuilt the document bounds from the host, so only the stream
    crosses ranks. Under cp each rank's stages run its shard of every row."""
    pipeline, device = state.pipeline, runtime.device
    batches = []
    for batch, bounds, n in zip(micro_batches, docs, labels_here):
        with region("data"):
            input_ids = upload(batch.input_ids, device) if pipeline.has_first else None
            labels = upload(batch.labels, device) if pipeline.has_last else None
        if context is None:
            inputs, weights = dict(input_ids=input_ids, labels=labels, docs=bounds), TermWeights.whole(n, denom)
        else:
            inputs, weights = _row_shard(input_ids, labels, bounds, context, n, batch.num_label_tokens, denom)
        batches.append(StageBatch(batch.input_ids.shape[-1], inputs["input_ids"], inputs.get("labels"), inputs["docs"],
                                  weights, inputs.get("mtp_targets")))
    lm_terms, extra_terms = pipeline.run(batches, autocast)
    return lm_terms * denom, extra_terms * denom  # as sum n_i lm_i, like the other paths


def _sum_over_pipeline(values: torch.Tensor, state: ModelState) -> torch.Tensor:
    """In-place sum over the pipeline's ranks (each stage contributes its terms: the LM loss comes
    from the last stage), so that every rank reports the step's loss."""
    if state.pipeline is not None:
        dist.all_reduce(values, group=state.pipeline.group)
    return values


def _routing_statistics(state: ModelState, balancers: list,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxVio [layers] and expert loads [layers, experts] of every MoE layer of the model, in order (a
    pipeline's ranks gather their stages' layers over the pipeline)."""
    if state.pipeline is not None:
        return state.pipeline.routing_statistics()
    if not balancers:
        return torch.zeros(0, dtype=torch.float64, device=device), torch.zeros(0, 0, device=device)
    return (torch.stack([b.last_maxvio.reshape(()).double() for b in balancers]),
            torch.stack([b.last_loads.double() for b in balancers]))


# ------------------------------------------------------------------------- a stage's steps


@dataclass
class TakenStep:
    step: int  # the 0-based global step just taken
    consumed: int  # sequences of the stage consumed before it
    result: StepResult
    time_s: float  # from asking for its batches to its end-of-step read


def run_steps(
    state: ModelState,
    data: StageData,
    steps: range,
    consumed: int,
    total_steps: int,
    optim_cfg: OptimConfig,
    runtime: Runtime,
    stop_requested: Callable[[], bool] = lambda: False,
    skipped_batches: Collection[int] = (),
    gc_every: int = 0,
) -> Iterator[TakenStep]:
    """Global steps `steps` of `data`'s stage, the first starting at `consumed` sequences.

    skipped_batches: positions (sequences consumed) of batches never to train on (a loss spike's,
    after a rollback): the steps take the batches after them.
    gc_every: Python's garbage collector runs after every `gc_every`-th of these steps, inside its
    time, and not automatically in between (`moe_lc.train.gc_schedule`); 0 leaves it automatic.

    A background thread prepares each step's micro-batches (pinned on a GPU) while the step
    before runs. Its only state is the position it started from, so after a resume it simply
    recomputes what it had prepared. An out-of-memory error becomes a `ConfigError` that says
    what to change (`out_of_memory_message`). Close the iterator (`contextlib.closing`) if you
    stop early, which stops the worker.
    """
    plan, device = data.plan, runtime.device
    per_step = plan.sequences_per_step
    batches = (p for p in itertools.count(consumed, per_step) if p not in skipped_batches)
    positions = list(itertools.islice(batches, len(steps)))
    pin = device.type == "cuda"

    def prepare(position: int) -> list:
        if pin:  # the worker thread's own current device, or its pinned buffers would live in a context on GPU 0
            torch.cuda.set_device(device)
        with region("data"):
            return data.micro_batches(position, state.dp_rank, pin_memory=pin)

    timer = DeviceTimer(device)
    own_s = 0.0  # this rank's batch wait and optimizer update in the step before
    with Prefetcher(prepare, positions, depth=PREFETCH_DEPTH) as ahead, \
            StepScheduledCollection(gc_every) as gc_schedule:
        for done, (step, position) in enumerate(zip(steps, positions), start=1):
            timer.start()
            waited = time.perf_counter()
            with region("data"):
                micro = ahead.get(position)
            waited = time.perf_counter() - waited
            try:
                result = train_step(state, micro, step, total_steps, optim_cfg, runtime, stop_requested(), own_s)
            except torch.OutOfMemoryError:
                raise ConfigError(out_of_memory_message(plan, step, device)) from None
            gc_schedule.after_step(done)
            own_s = waited + result.optimizer_s
            yield TakenStep(step, position, result, timer.stop())


def out_of_memory_message(plan: StagePlan, step: int, device: torch.device) -> str:
    """What ran out of memory, how far it got, and what to change in the stage to fit it."""
    gib = 2**30
    peak = peak_memory_bytes(device) / gib
    total = device_memory_bytes(device)
    reached = f"peak {peak:.1f} GiB of {total / gib:.1f} GiB" if total else f"peak {peak:.1f} GiB"
    where = f"curriculum.stages.{plan.name}"
    ckpt = plan.checkpointing
    fixes = []
    if ckpt.mode != CheckpointMode.full or ckpt.every != 1:
        fixes.append(f"recompute activations in backward with ++{where}.activation_checkpointing.mode=full "
                     f"(now {ckpt.mode.value}, every {ckpt.every})")
    if plan.micro_batch > 1:
        fixes.append(f"halve the micro-batch with {where}.micro_batch={plan.micro_batch // 2} (the same global "
                     "batch in more accumulation steps)")
    fixes.append(f"split each sequence over more GPUs with ++{where}.layout.cp={2 * plan.layout.cp} (context "
                 "parallelism)")
    fixes.append(f"shard the weights, gradients and optimizer state over more GPUs with ++{where}.layout.dp_shard="
                 f"{2 * plan.layout.dp_shard} (FSDP)")
    return (
        f"stage {plan.name} ran out of memory on {device} at step {step + 1} (seq_len {plan.seq_len}, "
        f"micro_batch {plan.micro_batch} x {plan.grad_accum} accumulation, layout {plan.layout.describe()}; "
        f"{reached}); to fit it, " + "; or ".join(fixes)
    )
