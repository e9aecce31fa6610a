"""Pipeline schedules: which stage each rank holds and the order of its work over the micro-batches.

The orders come from ``torch.distributed.pipelining``'s schedule classes (the same orders its own
runtime executes, communication placed where it places it); ``moe_lc.parallel.pipeline_runtime``
runs them with stages that carry Attention Residuals' sources (see docs/parallelism.md, "Pipeline
parallelism", for why torch's ``PipelineStage`` cannot). A schedule is only asked for its order:
it is built over stand-in stages that hold no module.

An order is a tuple of ``Action(kind, stage, micro)`` per rank, ``kind`` one of

    F       forward of ``stage`` on micro-batch ``micro``
    B       its whole backward
    I, W    its backward split in two (zero-bubble schedules): I the input gradients, W the weight
            gradients (run later, to fill the bubble)
    SEND_F, RECV_F, SEND_B, RECV_B   the boundary's activations (F) or gradients (B) for ``stage``

Placement: "loop" puts stage k on rank k % pp (1F1B, interleaved), "v" puts stages k and 2 pp - 1 - k
on rank k (ZBV, DualPipe-V), so the first and the last stage share rank 0 and the middle two stages
share rank pp - 1 (their boundary stays on the rank).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

from moe_lc.config import ConfigError
from moe_lc.parallel.layout import PipelineSchedule

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


@dataclass(frozen=True)
class ScheduleKind:
    torch_class: str  # in torch.distributed.pipelining.schedules
    placement: str  # "loop" or "v"
    stages_per_rank: tuple[int, Optional[int]]  # (least, most); None: no upper bound
    splits_backward: bool  # runs I and W separately


KINDS: dict[PipelineSchedule, ScheduleKind] = {
    # torch's interleaved order with one stage per rank is the classic 1F1B order (PipeDream-Flush)
    PipelineSchedule.one_f_one_b: ScheduleKind("ScheduleInterleaved1F1B", "loop", (1, 1), False),
    PipelineSchedule.interleaved_1f1b: ScheduleKind("ScheduleInterleaved1F1B", "loop", (2, None), False),
    PipelineSchedule.interleaved_zero_bubble: ScheduleKind("ScheduleInterleavedZeroBubble", "loop", (2, None), True),
    PipelineSchedule.zbv: ScheduleKind("ScheduleZBVZeroBubble", "v", (2, 2), True),
    PipelineSchedule.dualpipev: ScheduleKind("ScheduleDualPipeV", "v", (2, 2), True),
}


class Action(NamedTuple):
    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"


def _torch_schedules():
    import torch.distributed.pipelining.schedules as schedules

    return schedules


def schedule_available(schedule: PipelineSchedule) -> bool:
    """Whether this torch has the schedule's class."""
    return getattr(_torch_schedules(), KINDS[PipelineSchedule(schedule)].torch_class, None) is not None


def check_schedule(schedule: PipelineSchedule, stages_per_rank: int, needs_torch: bool = True) -> None:
    """ConfigError unless ``schedule`` can run ``stages_per_rank`` stages per rank (and, with
    ``needs_torch``, this torch has it)."""
    kind = KINDS[PipelineSchedule(schedule)]
    least, most = kind.stages_per_rank
    if stages_per_rank < least or (most is not None and stages_per_rank > most):
        wanted = str(least) if least == most else f"at least {least}"
        raise ConfigError(
            f"layout.pp_schedule={schedule} runs {wanted} stage(s) per rank, not pp_stages_per_rank="
            f"{stages_per_rank}; set pp_stages_per_rank={least} (or null) or choose another schedule"
        )
    if needs_torch and not schedule_available(schedule):
        import torch

        raise ConfigError(
            f"layout.pp_schedule={schedule} needs torch.distributed.pipelining.{kind.torch_class}, which torch "
            f"{torch.__version__} does not have; choose another pp_schedule or use a newer torch"
        )


def stage_ranks(schedule: PipelineSchedule, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """The pp rank of every stage, in stage order."""
    stages = pp * stages_per_rank
    if KINDS[PipelineSchedule(schedule)].placement == "v":
        return tuple(k if k < pp else 2 * pp - 1 - k for k in range(stages))
    return tuple(k % pp for k in range(stages))


class _StandIn:
    """What a torch schedule reads of a stage to compute its order (no module, no communication)."""

    def __init__(self, index: int, stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = None


def _torch_order(schedule: PipelineSchedule, pp: int, stages_per_rank: int, microbatches: int, rank: int):
    kind = KINDS[schedule]
    cls = getattr(_torch_schedules(), kind.torch_class)
    ranks = stage_ranks(schedule, pp, stages_per_rank)
    mine = [k for k, r in enumerate(ranks) if r == rank]
    stages = [_StandIn(k, len(ranks), pp, rank) for k in mine]
    try:
        built = cls(stages, microbatches, loss_fn=lambda out, target: out, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ConfigError(
            f"layout.pp_schedule={schedule} cannot run {microbatches} micro-batch(es) on pp={pp} x "
            f"{stages_per_rank} stage(s): {str(err).rstrip('.')}; change the stage's micro_batch or "
            "global_batch_tokens (the pipeline's micro-batches are its gradient accumulation steps) or the schedule"
        ) from None
    with_comms = getattr(built, "pipeline_order_with_comms", None)
    if with_comms is not None:
        return with_comms[rank], True
    return [a for a in built.pipeline_order[rank] if a is not None], False


def _flatten(torch_actions) -> list[Action]:
    """torch's actions as ours: overlapped F/B pairs (DualPipe-V) become their two parts in order;
    FSDP bookkeeping (UNSHARD, RESHARD, REDUCE_GRAD) is dropped (FSDP runs from its own hooks here)."""
    out: list[Action] = []
    for action in torch_actions:
        subs = getattr(action, "sub_actions", None)
        if subs:
            out.extend(_flatten(subs))
            continue
        kind = action.computation_type.value
        if kind in COMPUTE or kind in (SEND_F, RECV_F, SEND_B, RECV_B):
            out.append(Action(kind, action.stage_index, action.microbatch_index))
    return out


def _with_communication(compute: list[Action], ranks: tuple[int, ...], rank: int) -> list[Action]:
    """Receives just before the work that needs them, sends just after the work that produced them
    (for a torch whose schedules carry no communication actions)."""
    last = len(ranks) - 1
    out: list[Action] = []
    for a in compute:
        remote_input = a.stage > 0 and ranks[a.stage - 1] != rank
        remote_output = a.stage < last and ranks[a.stage + 1] != rank
        if a.kind == FORWARD:
            out += [Action(RECV_F, a.stage, a.micro)] if remote_input else []
            out += [a] + ([Action(SEND_F, a.stage, a.micro)] if remote_output else [])
        elif a.kind in (BACKWARD, BACKWARD_INPUT):
            out += [Action(RECV_B, a.stage, a.micro)] if remote_output else []
            out += [a] + ([Action(SEND_B, a.stage, a.micro)] if remote_input else [])
        else:
            out.append(a)
    return out


@functools.lru_cache(maxsize=64)
def rank_actions(
    schedule: PipelineSchedule, pp: int, stages_per_rank: int, microbatches: int, rank: int
) -> tuple[Action, ...]:
    """The order of ``rank``'s work in one step of ``microbatches`` micro-batches, communication included."""
    schedule = PipelineSchedule(schedule)
    check_schedule(schedule, stages_per_rank)
    order, has_comms = _torch_order(schedule, pp, stages_per_rank, microbatches, rank)
    actions = _flatten(order)
    if not has_comms:
        actions = _with_communication(actions, stage_ranks(schedule, pp, stages_per_rank), rank)
    return tuple(actions)


def check_microbatches(schedule: PipelineSchedule, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """ConfigError naming the fix when ``schedule`` cannot order ``microbatches`` micro-batches."""
    for rank in range(pp):
        rank_actions(schedule, pp, stages_per_rank, microbatches, rank)


# ------------------------------------------------------------------------- the bubble


@dataclass(frozen=True)
class SimulatedStep:
    """One step of a schedule with given work times and free communication."""

    makespan: float  # from the first forward to the last backward on any rank
    busy: float  # summed work time over the ranks
    ranks: int

    @property
    def bubble_fraction(self) -> float:
        """The share of the ranks' time spent idle: 1 - busy / (ranks x makespan)."""
        return 1.0 - self.busy / (self.ranks * self.makespan)


def simulate(
    schedule: PipelineSchedule,
    pp: int,
    stages_per_rank: int,
    microbatches: int,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
) -> SimulatedStep:
    """Run the ranks' orders against each other with per-stage work times (a whole backward takes
    backward_input + backward_weight) and free, instant communication: the bubble the order itself
    leaves. Every action starts when its rank is free and what it needs is done."""
    schedule = PipelineSchedule(schedule)
    ranks = stage_ranks(schedule, pp, stages_per_rank)
    last = len(ranks) - 1
    cost = {FORWARD: forward, BACKWARD: backward_input + backward_weight, BACKWARD_INPUT: backward_input,
            BACKWARD_WEIGHT: backward_weight}
    queues = {r: [a for a in rank_actions(schedule, pp, stages_per_rank, microbatches, r) if a.kind in COMPUTE]
              for r in range(pp)}
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in range(pp)}
    position = {r: 0 for r in range(pp)}

    def needs(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == FORWARD:
            return [("F", a.stage - 1, a.micro)] if a.stage > 0 else []
        if a.kind == BACKWARD_WEIGHT:
            return [("I", a.stage, a.micro)]
        own = [("F", a.stage, a.micro)]
        return own + ([("I", a.stage + 1, a.micro)] if a.stage < last else [])

    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progressed = False
        for r in range(pp):
            while position[r] < len(queues[r]):
                a = queues[r][position[r]]
                deps = needs(a)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = start + cost[a.kind]
                key = "I" if a.kind == BACKWARD else a.kind  # a whole backward also provides the input gradient
                done[(key, a.stage, a.micro)] = free[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocks for pp={pp}, {microbatches} micro-batches")
    busy = sum(cost[a.kind] for q in queues.values() for a in q)
    return SimulatedStep(max(free.values()), busy, pp)


def predicted_bubble(schedule: PipelineSchedule, pp: int, stages_per_rank: int, microbatches: int) -> Optional[float]:
    """The closed-form idle share of a schedule with forward : backward = 1 : 2, where there is one:
    1F1B (p - 1) / (m + p - 1); interleaved 1F1B over v stages per rank (p - 1) / (v m + p - 1)
    (every stage's work is 1/v of a rank's). None for the zero-bubble schedules (see `simulate`)."""
    p, m, v = pp, microbatches, stages_per_rank
    if schedule == PipelineSchedule.one_f_one_b:
        return (p - 1) / (m + p - 1)
    if schedule == PipelineSchedule.interleaved_1f1b:
        return (p - 1) / (v * m + p - 1)
    return None
