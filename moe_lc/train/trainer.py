"""The training loop: curriculum stages inside one run, checkpoints, exact resume, metrics.

    for each stage this launch runs (in curriculum order):
        build the stage's data (sequence length, mixture); rebuild the model if the layout changes,
        re-apply the activation checkpointing policy in place if only that changes
        for each step of the stage:
            micro-batches of this rank -> forward/backward -> clip -> optimizer step -> QB update
            log metrics; checkpoint every `checkpoint.every` steps
        evaluate (loss by position, passkey); checkpoint at the stage end
    render the report

Run state (all saved in every checkpoint, all layout-independent): the global step, the
sequences consumed per stage, the tokens seen, the model (QB biases and histogram state are
model buffers and extra state), the optimizer, the RNG states. The LR is a function of the
step. So a resumed run repeats exactly what the uninterrupted run would have done.

`train(cfg)` sets up a launch (runtime, stop signals, the run lock, where to start, the run's
log) and hands it to a `Trainer`, which runs the stage loop. Failing closed: a step whose loss
or gradient norm is not finite changes nothing (`bad_steps`), a state that is not finite is
never checkpointed, a rank that stops responding is an error on the others (`hangs`), and a
second trainer on the same run_dir is refused (`runlock`).
"""

from __future__ import annotations

import contextlib
import signal
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

import torch

from moe_lc.checkpoint import CheckpointManager, restore_rng
from moe_lc.checkpoint.coordination import Coordinator
from moe_lc.metrics import device_peak_flops, mfu, peak_memory_bytes
from moe_lc.model.accounting import count_parameters, training_flops_per_token
from moe_lc.parallel.activation_checkpointing import activation_checkpointing_of, apply_activation_checkpointing
from moe_lc.parallel.context import ContextShard
from moe_lc.train.attention_plans import describe as describe_prebuild, prebuild_stage_attention_plans
from moe_lc.train.bad_steps import BadStepBudget, Spike, SpikeDetector, nonfinite_state
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, next_step_to_run, plan_curriculum, stage_at, total_steps
from moe_lc.train.data import StageData, build_stage_data, eval_dataset
from moe_lc.train.evaluation import describe_eval, evaluate_stage
from moe_lc.train.hangs import Activity, CollectiveFailure, is_collective_failure
from moe_lc.train.health import Heartbeat, StragglerWatch
from moe_lc.train.fits import check_state_fits
from moe_lc.train.model_setup import ModelState, build_model_state, check_backends_run_here, float8_policy
from moe_lc.train.resume import RunPosition, Start, TrainerState, find_start, read_trainer_state
from moe_lc.train.runlock import RunLock
from moe_lc.train.runlog import RunLog
from moe_lc.train.runtime import Runtime, init_runtime
from moe_lc.train.step import StepResult, run_steps

# SLURM preemption / time-limit warnings, and Ctrl-C: save at the next step boundary and stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
FLIGHT_RECORDER_DIR = "flight_recorder"  # in run_dir: NCCL's record of each rank's last collectives


@dataclass
class RunSummary:
    run_dir: str
    final_step: int
    steps_this_launch: int
    tokens_this_launch: int
    wall_time_s: float
    train_time_s: float
    last_loss: Optional[float]
    stopped_early: bool = False
    checkpoints: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_this_launch / self.train_time_s if self.train_time_s > 0 else 0.0


class StopSignals:
    """While entered, SIGTERM/SIGUSR1/SIGINT set `requested` instead of ending the process: the
    trainer then checkpoints and stops at the next step boundary. A second SIGINT (Ctrl-C twice)
    interrupts at once, without that checkpoint."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _request(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, self._request)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Trainer:
    """The stage loop of one launch, from `start` to the end of the stages it runs (or
    max_steps, or a stop signal). Runs once."""

    def __init__(
        self,
        cfg: TrainConfig,
        runtime: Runtime,
        plans: list[StagePlan],
        checkpoints: CheckpointManager,
        start: Start,
        log: RunLog,
        stop: StopSignals,
        activity: Optional[Activity] = None,
        lock: Optional[RunLock] = None,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.plans = plans
        self.total = total_steps(plans)
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = checkpoints
        self.start = start
        self.log = log
        self.stop = stop
        self.activity = activity or Activity()
        self.lock = lock  # rank 0's; None on the other ranks
        self.last_saved_step = start.position.step if start.resume is not None else -1
        self.budget = BadStepBudget(cfg.bad_steps)
        self.spikes = SpikeDetector(cfg.bad_steps.spike_window, cfg.bad_steps.spike_sigmas)
        self.heartbeat = Heartbeat(cfg.distributed.heartbeat_every_s)
        self.stragglers = StragglerWatch(cfg.distributed.straggler_every, cfg.distributed.straggler_ratio,
                                         runtime.world_size)

    # --------------------------------------------------------------------- main loop

    def run(self, wall_start: float) -> RunSummary:
        """Train; `wall_start` (time.perf_counter) is when the launch began."""
        cfg, plans, resume_path = self.cfg, self.plans, self.start.resume
        position = self.start.position.copy()
        self.log.message(self._banner(position))
        state: Optional[ModelState] = None
        summary = RunSummary(str(self.run_dir), position.step, 0, 0, 0.0, 0.0, None)
        launch_train_time = 0.0
        try:
            for plan in plans:
                if not plan.run or position.step >= plan.end_step:
                    continue
                if position.step < plan.start_step:
                    if position.step > 0 or resume_path is not None:
                        self.log.message(f"moving on to stage {plan.name} at step {plan.start_step} (step "
                                         f"{position.step} is in a stage this launch does not run)")
                    position.step = plan.start_step
                if state is None:
                    with self.activity.doing(f"building stage {plan.name}'s model"):
                        state = self._build_state(plan, resume_path, self.start.init, position)
                elif state.layout != plan.layout:
                    if self.last_saved_step != position.step:  # the new layout reloads a checkpoint of this step
                        summary.checkpoints.append(str(self._save(state, stage_at(plans, position.step - 1), position)))
                    state = None  # free the old model before building the new one
                    with self.activity.doing(f"rebuilding the model for stage {plan.name}'s layout"):
                        state = self._build_state(plan, None, None, position, rebuild=True)
                elif activation_checkpointing_of(state.model) != plan.checkpointing:  # no parameter changes
                    apply_activation_checkpointing(state.model, plan.checkpointing)
                    self.log.message(f"activation checkpointing for stage {plan.name}: {plan.checkpointing.describe()}")
                with self.activity.doing(f"building stage {plan.name}'s data"):
                    data = build_stage_data(plan, cfg.data, cfg.model.vocab_size, cfg.seed,
                                            sync=self.runtime.rank0_first)
                self.log.message(
                    f"stage {plan.name}: seq_len {plan.seq_len}, {plan.sequences_per_step} seq/step "
                    f"({plan.global_batch_tokens} tokens), micro-batch {plan.micro_batch} x {plan.grad_accum} "
                    f"accumulation, steps {plan.start_step}..{plan.end_step - 1}, data {data.dataset!r}"
                )
                with self.activity.doing(f"building stage {plan.name}'s attention plans"):
                    rows, seconds = prebuild_stage_attention_plans(state.model, plan, self.runtime)
                if rows:
                    self.log.message(describe_prebuild(rows, seconds))
                launch_train_time += self._train_stage(state, plan, data, position, summary)
                stage_done = position.step >= plan.end_step
                if stage_done and cfg.eval.at_stage_end and (cfg.eval.sequences or cfg.eval.passkey_documents):
                    self._evaluate(state, plan, data, position)
                if stage_done and cfg.checkpoint.at_stage_end and self.last_saved_step != position.step:
                    summary.checkpoints.append(str(self._save(state, plan, position)))
                if not stage_done or summary.stopped_early:  # max_steps or a stop signal (also at a stage end)
                    break
            final_save = cfg.checkpoint.at_end or summary.stopped_early  # a preempted run must be resumable
            if state is not None and self.last_saved_step != position.step and final_save:
                current = stage_at(plans, max(position.step - 1, 0))
                summary.checkpoints.append(str(self._save(state, current, position)))
        finally:
            self.checkpoints.close()  # an async save in flight is finished (or its error raised) before we leave
            self.log.end_steps()
        summary.final_step = position.step
        summary.wall_time_s = time.perf_counter() - wall_start
        summary.train_time_s = launch_train_time
        how = "stopped by signal" if summary.stopped_early else "done"
        self.log.message(
            f"{how}: step {position.step}/{self.total}, {summary.steps_this_launch} steps this launch, "
            f"{summary.tokens_this_launch} tokens at {summary.tokens_per_s:,.0f} tokens/s (train time "
            f"{launch_train_time:.1f}s, wall {summary.wall_time_s:.1f}s); checkpoints in {self.checkpoints.root}"
        )
        if position.step < self.total and not summary.stopped_early and cfg.max_steps is None:
            remaining = [p.name for p in plans if p.end_step > position.step]
            self.log.message(f"stages left in the curriculum: {', '.join(remaining)} (continue with resume=auto "
                             "and curriculum.run=null or their stage recipes)")
        if summary.stopped_early:
            self.log.message("resume with resume=auto")
        elif cfg.report.at_end:
            self.log.report()
        return summary

    def _train_stage(
        self, state: ModelState, plan: StagePlan, data: StageData, position: RunPosition, summary: RunSummary
    ) -> float:
        """Steps of `plan` from `position` until its end, max_steps or a stop signal; returns the step time spent.

        A loss spike with bad_steps.spike_rollback reloads the stage's newest checkpoint and trains
        on from there without the spiking batch.
        """
        cfg = self.cfg
        end = plan.end_step if cfg.max_steps is None else max(position.step, min(plan.end_step, cfg.max_steps))
        spent, skipped_batches = 0.0, set()
        while True:
            took, spiking_batch = self._steps(state, plan, data, position, summary, end, skipped_batches)
            spent += took
            if spiking_batch is None:
                return spent
            skipped_batches.add(spiking_batch)

    def _steps(
        self, state: ModelState, plan: StagePlan, data: StageData, position: RunPosition, summary: RunSummary,
        end: int, skipped_batches: set[int],
    ) -> tuple[float, Optional[int]]:
        """Steps until `end` (or a stop); returns the time spent and, after a rollback, the batch to skip."""
        cfg = self.cfg
        steps = range(position.step, end)
        consumed = position.consumed.get(plan.name, 0)
        spent, count = 0.0, 0
        taken_steps = run_steps(state, data, steps, consumed, self.total, cfg.optim, self.runtime,
                                stop_requested=lambda: self.stop.requested, skipped_batches=skipped_batches,
                                gc_every=cfg.gc.every)
        with contextlib.closing(taken_steps), self.activity.doing(f"step {position.step + 1} of stage {plan.name}"):
            for taken in taken_steps:
                result, dt = taken.result, taken.time_s
                position.advance(plan, taken.consumed, dt)
                spent += dt
                count += 1
                summary.steps_this_launch += 1
                summary.tokens_this_launch += plan.global_batch_tokens
                summary.last_loss = result.loss
                spike = None if result.skipped else self.spikes.observe(position.step, result.loss)
                rollback = self._rollback_target(plan) if spike is not None and cfg.bad_steps.spike_rollback else None
                record = self._step_record(plan, position, result, dt)
                if spike is not None:
                    record["spike"] = {"mean": spike.mean, "std": spike.std, "rolled_back_to": rollback}
                self.log.step(record, self._eta(plan, position, spent / count))
                self._report_health(plan, position, result)
                self._judge(state, position, result, spike, rollback)
                if rollback is not None:
                    self._roll_back(state, rollback, position)
                    return spent, taken.consumed
                stage_end_save = position.step == plan.end_step and cfg.checkpoint.at_stage_end  # after the eval
                if cfg.checkpoint.every and position.step % cfg.checkpoint.every == 0 and not stage_end_save:
                    summary.checkpoints.append(str(self._save(state, plan, position)))
                if result.stop_requested:
                    summary.stopped_early = True
                    break
                self.activity.now = f"step {position.step + 1} of stage {plan.name}"
        return spent, None

    # ----------------------------------------------------------------- bad steps

    def _judge(
        self, state: ModelState, position: RunPosition, result: StepResult, spike: Optional[Spike],
        rollback: Optional[int],
    ) -> None:
        """Count a skipped (or rolled back) step against the budget; a skip caused by weights that are
        no longer finite stops the run at once. Every rank decides alike (global loss and norm)."""
        step = position.step
        if result.skipped:
            self.log.warning(f"step {step} skipped: loss {result.loss}, gradient norm {result.grad_norm}; "
                             "nothing was updated")
            broken = nonfinite_state(state.model, state.optimizer, self.runtime.device, self.runtime.distributed)
            if broken is not None:
                raise FloatingPointError(
                    f"the weights or optimizer state are not finite at step {step} ({broken}): an earlier update (lr "
                    f"{result.lr:.3g}) diverged; the newest checkpoint holds the last finite state: lower "
                    "optim.lr, then resume with resume=auto")
        if spike is not None:
            then = (f"rolling back to step {rollback} and skipping this batch" if rollback is not None
                    else "kept (bad_steps.spike_rollback=false or no checkpoint of this stage)")
            self.log.warning(f"loss spike at step {step}: {spike.describe()}; {then}")
        self.budget.count(step, result.skipped or rollback is not None, result.loss, result.grad_norm, result.lr)

    def _rollback_target(self, plan: StagePlan) -> Optional[int]:
        """The step of the newest complete checkpoint inside `plan` (the stage's layout), else None."""
        self.checkpoints.wait()
        path = self.checkpoints.latest()
        if path is None:
            return None
        step = read_trainer_state(path).position.step
        return step if step >= plan.start_step else None

    def _roll_back(self, state: ModelState, step: int, position: RunPosition) -> None:
        """Reload the newest checkpoint (of step `step`) into `state` and `position`."""
        path = self.checkpoints.latest()
        with self.activity.doing(f"rolling back to the checkpoint of step {step}"):
            trainer, rng = self.checkpoints.load(path, state.model, state.optimizer)
        if rng is not None:
            restore_rng(rng)
        saved = TrainerState.from_dict(trainer).position
        position.step, position.consumed = saved.step, dict(saved.consumed)
        position.tokens_seen, position.train_time_s = saved.tokens_seen, saved.train_time_s
        self.last_saved_step = saved.step
        self.spikes.rewind(saved.step)
        self.log.message(f"rolled back to {path} (step {saved.step})")

    def _report_health(self, plan: StagePlan, position: RunPosition, result: StepResult) -> None:
        """The heartbeat and straggler lines, and the run lock's check (rank 0 holds it)."""
        if self.lock is not None:
            self.lock.check()
        line = self.heartbeat.beat(position.step, self.total, plan.name, result.loss, plan.global_batch_tokens)
        if line is not None:
            self.log.message(line)
        line = self.stragglers.add(position.step, result.own_s_per_rank)
        if line is not None:
            self.log.warning(line)

    # ----------------------------------------------------------------- checkpoints

    def _save(self, state: ModelState, plan: StagePlan, position: RunPosition) -> Path:
        """Checkpoint `state` at `position`; a state that is not finite is refused (FloatingPointError)."""
        t0 = time.perf_counter()
        with self.activity.doing(f"the checkpoint of step {position.step}"):
            broken = nonfinite_state(state.model, state.optimizer, self.runtime.device, self.runtime.distributed)
            if broken is not None:
                raise FloatingPointError(
                    f"the state at step {position.step} is not finite ({broken}) and is not checkpointed; the "
                    "newest checkpoint holds the last finite state: lower optim.lr or check the data, then resume "
                    "with resume=auto")
            trainer = TrainerState.of_run(self.cfg, self.plans, plan, position, state.layout.as_dict())
            path = self.checkpoints.save(
                position.step, {"model": state.model, "optim": state.optimizer, "trainer": trainer.to_dict()}
            )
        self.last_saved_step = position.step
        self.log.message(f"checkpoint step {position.step} -> {path} ({time.perf_counter() - t0:.2f}s)")
        return path

    def _build_state(
        self,
        plan: StagePlan,
        resume_path: Optional[Path],
        init_path: Optional[Path],
        position: RunPosition,
        rebuild: bool = False,
    ) -> ModelState:
        """Model + optimizer for the stage's layout; restored from a checkpoint when there is one.

        A layout change between stages rebuilds the model and reloads it from the checkpoint just
        written at the stage boundary (checkpoints are layout-independent).
        """
        cfg = self.cfg
        if rebuild:
            resume_path = self.checkpoints.latest()
            self.log.message(f"layout changes for stage {plan.name}: {plan.layout.describe()}; reloading {resume_path}")
            if self.runtime.device.type == "cuda":
                torch.cuda.empty_cache()
        state = build_model_state(cfg.model, cfg.optim, plan.layout, self.runtime, cfg.seed, plan.checkpointing,
                                  plan.seq_len, float8_policy(cfg), cfg.compile)
        if state.pipeline is not None:
            self.log.message(state.pipeline.describe())
        if resume_path is not None:
            trainer, rng = self.checkpoints.load(resume_path, state.model, state.optimizer)
            if rng is not None:
                restore_rng(rng)
            saved = TrainerState.from_dict(trainer)
            self.log.message(f"resumed from {resume_path} (step {saved.position.step}, stage {saved.stage})")
        elif init_path is not None:
            self.checkpoints.load(init_path, state.model, None)
            self.log.message(f"initialised the model from {init_path} (fresh optimizer, step {position.step})")
        return state

    # --------------------------------------------------------------------- records

    def _banner(self, position: RunPosition) -> str:
        cfg, rt = self.cfg, self.runtime
        rep = count_parameters(cfg.model)
        start = f"resuming at step {position.step}" if self.start.resume else f"fresh start (seed {cfg.seed})"
        dtype = rt.describe_precision(cfg.float8.experts)
        if cfg.compile.resolve(rt.device.type, rt.world_size, cfg.layout.tp).enabled:
            dtype += ", regional torch.compile"
        return (
            f"moe-lc train: recipe {cfg.recipe}, model {cfg.model.name} ({rep.total:,} params, "
            f"{rep.active:,} active), {len(self.plans)} stages / {self.total} steps, device {rt.device} x "
            f"{rt.world_size} ({dtype}), {start}, run_dir {self.run_dir}"
        )

    def _step_record(self, plan: StagePlan, position: RunPosition, result: StepResult, dt: float) -> dict[str, Any]:
        """The metrics.jsonl record of the step just taken (host numbers only: the step read them back)."""
        cfg, rt = self.cfg, self.runtime
        tokens_per_s = plan.global_batch_tokens / dt if dt > 0 else 0.0
        flops_per_token = training_flops_per_token(cfg.model, plan.seq_len, result.keys_per_token)
        peak = device_peak_flops(rt.device, cfg.logging.cpu_peak_flops)
        util = mfu(tokens_per_s, flops_per_token, peak, rt.world_size)
        maxvio = result.maxvio_per_layer
        record: dict[str, Any] = {
            "step": position.step,
            "stage": plan.name,
            "stage_index": plan.index,
            "seq_len": plan.seq_len,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens": plan.global_batch_tokens,
            "tokens_seen": position.tokens_seen,
            "label_tokens": result.label_tokens,
            "step_time_s": dt,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / rt.world_size,
            "mfu": util,
            "flops_per_token": flops_per_token,
            "keys_per_token": result.keys_per_token,
            "peak_memory_gib": peak_memory_bytes(rt.device) / 2**30,
            "maxvio": max(maxvio) if maxvio else 0.0,
            "maxvio_per_layer": maxvio,
            "time": time.time(),
        }
        if result.aux_loss:
            record["aux_loss"] = result.aux_loss
        if result.skipped:
            record["skipped"] = True
        if position.step % cfg.logging.loads_every == 0 or position.step == plan.end_step:
            record["expert_loads"] = result.expert_loads
        return record

    def _eta(self, plan: StagePlan, position: RunPosition, mean_step_time: float) -> float:
        """Seconds left: this stage at its measured pace, later stages scaled by their FLOPs per step."""
        end = self.cfg.max_steps if self.cfg.max_steps is not None else None
        left = 0.0
        here = training_flops_per_token(self.cfg.model, plan.seq_len) * plan.global_batch_tokens
        for p in self.plans:
            if not p.run or p.end_step <= position.step:
                continue
            first, last = max(p.start_step, position.step), p.end_step
            if end is not None:
                last = min(last, end)
            if last <= first:
                continue
            per_step = training_flops_per_token(self.cfg.model, p.seq_len) * p.global_batch_tokens
            left += (last - first) * mean_step_time * per_step / here
        return left

    def _evaluate(self, state: ModelState, plan: StagePlan, data: StageData, position: RunPosition) -> None:
        cfg = self.cfg
        context = (lambda row: ContextShard.from_mesh(state.mesh, row)) if state.layout.cp > 1 else None
        t0 = time.perf_counter()
        autocast = self.runtime.autocast if state.autocast_forward else contextlib.nullcontext
        with self.activity.doing(f"stage {plan.name}'s evaluation"):
            result = evaluate_stage(
                state.model, eval_dataset(data, cfg.seed + cfg.eval.seed_offset), plan.seq_len, cfg.eval.sequences,
                cfg.eval.passkey_documents, self.runtime.device, autocast, tokenizer=str(cfg.data.tokenizer),
                seed=cfg.seed + cfg.eval.seed_offset, context=context, pipeline=state.pipeline,
            )
        result.update({"step": position.step, "stage": plan.name, "eval_time_s": time.perf_counter() - t0})
        self.log.eval(result)
        line = describe_eval(result)
        if line:
            self.log.message(f"stage {plan.name} end (step {position.step}): {line} ({result['eval_time_s']:.1f}s)")


# ------------------------------------------------------------------------- a launch


def train(cfg: TrainConfig, stream: Optional[TextIO] = None) -> RunSummary:
    """Run a composed config: the runtime, the run lock, where to start, the run's log, then the stage loop.

    A collective that times out or loses a rank ends the launch with `CollectiveFailure` (one line).
    """
    for section in (cfg.run_lock, cfg.distributed, cfg.bad_steps, cfg.gc):
        section.check()
    runtime = init_runtime(cfg.device, cfg.precision, cfg.threads, cfg.distributed,
                           flight_recorder_dir=Path(cfg.run_dir) / FLIGHT_RECORDER_DIR)
    wall_start = time.perf_counter()
    if not runtime.distributed:  # DCP notes on every save/load that it runs single-process; we know
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    activity, failed = Activity(), False
    try:
        with StopSignals() as stop:
            torch.manual_seed(cfg.seed)
            plans = plan_curriculum(cfg, runtime.world_size)
            check_backends_run_here(cfg.model, runtime.device)  # before the run directory is touched
            check_state_fits(cfg, [p for p in plans if p.run], runtime.device)
            lock_notes: list[str] = []
            with _run_lock(cfg, runtime, lock_notes.append) as lock:
                checkpoints = CheckpointManager(
                    Path(cfg.run_dir) / cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last,
                    async_save=cfg.checkpoint.async_save,
                )
                start = find_start(cfg, checkpoints)
                trains = _has_steps_to_run(plans, start.position.step, cfg.max_steps)
                log = (
                    RunLog.open(cfg, total_steps(plans), stream, metrics_after=start.resume_step if trains else None)
                    if runtime.is_main else RunLog.silent()
                )
                with log:
                    for note in lock_notes + ([start.warning] if start.warning is not None else []):
                        log.warning(note)
                    if not trains:
                        return _nothing_to_train(cfg, plans, start.position, log, wall_start)
                    return Trainer(cfg, runtime, plans, checkpoints, start, log, stop, activity, lock).run(wall_start)
    except Exception as err:
        if not (runtime.distributed and is_collective_failure(err)):
            raise
        failed = True
        raise CollectiveFailure.of(err, runtime.rank, runtime.world_size, activity,
                                   runtime.collective_timeout_s) from None
    finally:
        runtime.shutdown(after_collective_failure=failed)


@contextlib.contextmanager
def _run_lock(cfg: TrainConfig, runtime: Runtime, note: Any) -> Iterator[Optional[RunLock]]:
    """Rank 0 holds run_dir's lock while the launch runs (the others get None); a refusal is raised
    on every rank. `note` hears about a stale lock taken over."""
    held: list[Optional[RunLock]] = [None]

    def take() -> None:
        held[0] = RunLock.acquire(Path(cfg.run_dir), cfg.run_lock.stale_after_s, cfg.run_lock.force, note)

    if runtime.distributed:
        Coordinator().rank0_decides(take)
    else:
        take()
    try:
        yield held[0]
    finally:
        if held[0] is not None:
            held[0].release()


def _has_steps_to_run(plans: list[StagePlan], step: int, max_steps: Optional[int]) -> bool:
    first = next_step_to_run(plans, step)
    return first is not None and (max_steps is None or first < max_steps)


def _nothing_to_train(
    cfg: TrainConfig, plans: list[StagePlan], position: RunPosition, log: RunLog, wall_start: float
) -> RunSummary:
    run_dir = Path(cfg.run_dir)
    log.message(f"nothing to train: the run in {run_dir} is at step {position.step} of {total_steps(plans)} "
                f"(stages run: {', '.join(p.name for p in plans if p.run)})")
    if cfg.report.at_end:
        log.report()
    return RunSummary(str(run_dir), position.step, 0, 0, time.perf_counter() - wall_start, 0.0, None)
