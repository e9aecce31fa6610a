"""The training loop: curriculum stages inside one run, checkpoints, exact resume, metrics.

    for each stage this launch runs (in curriculum order):
        build the stage's data (sequence length, mixture); rebuild the model if the layout changes
        for each step of the stage:
            micro-batches of this rank -> forward/backward -> clip -> optimizer step -> QB update
            log metrics; checkpoint every `checkpoint.every` steps
        evaluate (loss by position, passkey); checkpoint at the stage end
    render the report

Run state (all saved in every checkpoint, all layout-independent): the global step, the
sequences consumed per stage, the tokens seen, the model (QB biases and histogram state are
model buffers), the optimizer, the RNG states. The LR is a function of the step. So a
resumed run repeats exactly what the uninterrupted run would have done.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import torch

from moe_lc.config import ConfigError
from moe_lc.train.config import TrainConfig
from moe_lc.train.curriculum import StagePlan, next_step_to_run, plan_curriculum, stage_at, total_steps
from moe_lc.train.data import StageData, build_stage_data, eval_dataset
from moe_lc.train.model_setup import ModelState, build_model_state
from moe_lc.train.recipes import config_to_dict
from moe_lc.train.runtime import Runtime, init_runtime
from moe_lc.train.step import StepResult, train_step

CHECKPOINT_FORMAT = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM preemption / time limit warnings


@dataclass
class RunPosition:
    """Where a run stands; exactly what a checkpoint's trainer dict records."""

    step: int = 0  # optimizer steps completed
    consumed: dict[str, int] = field(default_factory=dict)  # sequences consumed per stage name
    tokens_seen: int = 0
    train_time_s: float = 0.0  # accumulated step time over all launches

    def advance(self, plan: "StagePlan", consumed: int, step_time_s: float) -> None:
        """Account for one finished optimizer step of `plan` that started at `consumed` sequences."""
        self.step += 1
        self.consumed[plan.name] = consumed + plan.sequences_per_step
        self.tokens_seen += plan.global_batch_tokens
        self.train_time_s += step_time_s


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


class Trainer:
    def __init__(self, cfg: TrainConfig, stream: Optional[TextIO] = None):
        self.cfg = cfg
        self.stream = stream or sys.stdout
        self._stop_requested = False

    # ------------------------------------------------------------------------- entry

    def run(self) -> RunSummary:
        rt = init_runtime(self.cfg.device, self.cfg.precision, self.cfg.threads)
        if not rt.distributed:  # DCP notes on every save/load that it runs single-process; we know
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, self._request_stop)
        try:
            return self._run(rt)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            rt.shutdown()

    def _request_stop(self, signum: int, frame: Any) -> None:
        self._stop_requested = True

    # --------------------------------------------------------------------- main loop

    def _run(self, rt: Runtime) -> RunSummary:
        from moe_lc.checkpoint import CheckpointManager
        from moe_lc.metrics import Progress

        cfg = self.cfg
        wall_start = time.perf_counter()
        if cfg.layout.world_size is not None and cfg.layout.world_size != rt.world_size:
            raise ConfigError(
                f"the layout is for {cfg.layout.world_size} rank(s) but {rt.world_size} were launched; "
                f"launch {cfg.layout.world_size} (e.g. torchrun --nproc-per-node {cfg.layout.world_size}) "
                "or choose another layout (layout=single for one process, or layout.world_size=null)"
            )
        torch.manual_seed(cfg.seed)
        plans = plan_curriculum(cfg, rt.world_size)
        self.plans, self.total = plans, total_steps(plans)
        self.rt = rt
        self.run_dir = Path(cfg.run_dir)
        self.log_path = self.run_dir / "train.log"
        self.ckpt = CheckpointManager(
            self.run_dir / cfg.checkpoint.dir, keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save
        )
        if rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.progress = Progress(self.total, cfg.logging.progress, cfg.logging.every, self.stream)

        resume_path, init_path = self._checkpoint_to_start_from()
        position = RunPosition()
        if resume_path is not None:
            trainer_state = read_trainer_state(resume_path)
            self._check_compatible(trainer_state, resume_path)
            position = RunPosition(
                trainer_state["step"], dict(trainer_state.get("consumed", {})),
                int(trainer_state.get("tokens_seen", 0)), float(trainer_state.get("train_time_s", 0.0)),
            )
        elif init_path is not None:
            self._check_compatible(read_trainer_state(init_path), init_path)

        first = next_step_to_run(plans, position.step)
        if cfg.max_steps is not None and first is not None and first >= cfg.max_steps:
            first = None
        if first is None:
            self.say(f"nothing to train: the run in {self.run_dir} is at step {position.step} of {self.total} "
                     f"(stages run: {', '.join(p.name for p in plans if p.run)})")
            if cfg.report.at_end:
                self._render_report()
            return RunSummary(str(self.run_dir), position.step, 0, 0, time.perf_counter() - wall_start, 0.0, None)

        sinks = self._open_sinks(position.step if resume_path is not None else 0, fresh=resume_path is None)
        self.say(self._banner(rt, position, resume_path, init_path))
        state: Optional[ModelState] = None
        summary = RunSummary(str(self.run_dir), position.step, 0, 0, 0.0, 0.0, None)
        launch_train_time = 0.0
        self.last_saved_step = position.step if resume_path is not None else -1
        try:
            for plan in plans:
                if not plan.run or position.step >= plan.end_step:
                    continue
                if position.step < plan.start_step:
                    if position.step > 0 or resume_path is not None:
                        self.say(f"moving on to stage {plan.name} at step {plan.start_step} (step {position.step} "
                                 "is in a stage this launch does not run)")
                    position.step = plan.start_step
                if state is None:
                    state = self._build_state(plan, resume_path, init_path, position)
                elif state.layout != plan.layout:
                    if self.last_saved_step != position.step:  # the new layout reloads a checkpoint of this step
                        summary.checkpoints.append(str(self._save(state, stage_at(plans, position.step - 1), position)))
                    state = None  # free the old model before building the new one
                    state = self._build_state(plan, None, None, position, rebuild=True)
                data = build_stage_data(plan, cfg.data, cfg.model.vocab_size, cfg.seed, sync=self._rank0_first)
                self.say(f"stage {plan.name}: seq_len {plan.seq_len}, {plan.sequences_per_step} seq/step "
                         f"({plan.global_batch_tokens} tokens), micro-batch {plan.micro_batch} x {plan.grad_accum} "
                         f"accumulation, steps {plan.start_step}..{plan.end_step - 1}, data {data.dataset!r}")
                launch_train_time += self._train_stage(state, plan, data, position, sinks, summary)
                stage_done = position.step >= plan.end_step
                if stage_done and cfg.eval.at_stage_end and (cfg.eval.sequences or cfg.eval.passkey_documents):
                    self._evaluate(sinks, state, plan, data, position)
                if stage_done and cfg.checkpoint.at_stage_end and self.last_saved_step != position.step:
                    summary.checkpoints.append(str(self._save(state, plan, position)))
                if not stage_done:  # max_steps or a stop signal
                    break
            if state is not None and self.last_saved_step != position.step:
                current = stage_at(plans, max(position.step - 1, 0))
                summary.checkpoints.append(str(self._save(state, current, position)))
        finally:
            self.ckpt.close()  # an async save in flight is finished (or its error raised) before we leave
            self.progress.close()
            if sinks is not None:
                sinks.close()
        summary.final_step = position.step
        summary.wall_time_s = time.perf_counter() - wall_start
        summary.train_time_s = launch_train_time
        how = "stopped by signal" if summary.stopped_early else "done"
        self.say(
            f"{how}: step {position.step}/{self.total}, {summary.steps_this_launch} steps this launch, "
            f"{summary.tokens_this_launch} tokens at {summary.tokens_per_s:,.0f} tokens/s (train time "
            f"{launch_train_time:.1f}s, wall {summary.wall_time_s:.1f}s); checkpoints in {self.ckpt.root}"
        )
        if position.step < self.total and not summary.stopped_early and cfg.max_steps is None:
            remaining = [p.name for p in plans if p.end_step > position.step]
            self.say(f"stages left in the curriculum: {', '.join(remaining)} (continue with resume=auto and "
                     "curriculum.run=null or their stage recipes)")
        if summary.stopped_early:
            self.say("resume with resume=auto")
        elif cfg.report.at_end:
            self._render_report()
        return summary

    def _train_stage(
        self, state: ModelState, plan: StagePlan, data: StageData, position: RunPosition, sinks, summary: RunSummary
    ) -> float:
        """Steps of `plan` from `position` until its end, max_steps or a stop signal; returns the step time spent."""
        cfg, rt = self.cfg, self.rt
        spent, steps = 0.0, 0
        while position.step < plan.end_step:
            if cfg.max_steps is not None and position.step >= cfg.max_steps:
                break
            if rt.any_rank(self._stop_requested):
                summary.stopped_early = True
                break
            consumed = position.consumed.get(plan.name, 0)
            t0 = time.perf_counter()
            micro = data.micro_batches(consumed, state.dp_rank)
            result = train_step(state, micro, position.step, self.total, cfg.optim, rt)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            dt = time.perf_counter() - t0
            position.advance(plan, consumed, dt)
            spent += dt
            steps += 1
            summary.steps_this_launch += 1
            summary.tokens_this_launch += plan.global_batch_tokens
            summary.last_loss = result.loss
            self._log_step(sinks, state, plan, position, result, dt, spent / steps)
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"loss is {result.loss} at step {position.step}; lower optim.lr or check the data")
            stage_end_save = position.step == plan.end_step and cfg.checkpoint.at_stage_end  # after the eval
            if cfg.checkpoint.every and position.step % cfg.checkpoint.every == 0 and not stage_end_save:
                summary.checkpoints.append(str(self._save(state, plan, position)))
        return spent

    # ----------------------------------------------------------------- checkpoints

    def _checkpoint_to_start_from(self) -> tuple[Optional[Path], Optional[Path]]:
        """(checkpoint to resume, checkpoint whose weights start a fresh run)."""
        from moe_lc.checkpoint import CheckpointManager

        cfg, existing = self.cfg, self.ckpt.checkpoints()
        resume = str(cfg.resume)
        if resume == "none":
            if existing:
                raise ConfigError(
                    f"{self.ckpt.root} already holds checkpoints (newest {existing[-1].name}); continue that run with "
                    "resume=auto, or start a new one in another run_dir=..."
                )
            path = None
        elif resume == "auto":
            path = self.ckpt.latest()
            if path is None and existing:
                self.say(f"warning: no valid checkpoint among {len(existing)} in {self.ckpt.root}; starting fresh")
        else:
            path = self.ckpt.resolve(resume)
        if path is not None or cfg.init_from is None:
            return path, None
        init_root = Path(cfg.init_from)
        return None, CheckpointManager(init_root.parent if init_root.name.startswith("step_") else init_root).resolve(
            cfg.init_from
        )

    def _check_compatible(self, saved: dict, path: Path) -> None:
        """Clear errors for a checkpoint of another model or tokenizer (before any tensor is read)."""
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"{path} was not written by the moe-lc trainer (no trainer state of format {CHECKPOINT_FORMAT}); "
                "pass a checkpoint directory written by `moe-lc train`"
            )
        mine = self.cfg.model.to_dict()
        theirs = saved.get("model", {})
        # mla.fp32_output: a removed option that changed no weights (older checkpoints still carry it)
        ignore = {"name", "kda.backend", "mla.fp32_output"}
        diffs = [
            f"{k}: checkpoint {theirs_v!r} vs now {mine_v!r}"
            for k, theirs_v, mine_v in _flat_diff(theirs, mine)
            if k not in ignore
        ]
        if diffs:
            raise ConfigError(
                f"checkpoint {path} is for a different model ({'; '.join(diffs[:6])}); use the same model "
                "settings as the run that wrote it, or another run_dir"
            )
        saved_tok = saved.get("tokenizer")
        if saved_tok is not None and saved_tok != str(self.cfg.data.tokenizer):
            raise ConfigError(
                f"tokenizer/vocab mismatch: checkpoint {path} was trained with data.tokenizer={saved_tok!r} but this "
                f"run uses {self.cfg.data.tokenizer!r}; token ids would mean different things. Use the same tokenizer"
            )

    def _trainer_state(self, plan: StagePlan, position: RunPosition, state: ModelState) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "format": CHECKPOINT_FORMAT,
            "step": position.step,
            "stage": plan.name,
            "stage_step": position.step - plan.start_step,
            "consumed": dict(position.consumed),
            "tokens_seen": position.tokens_seen,
            "train_time_s": position.train_time_s,
            "total_steps": self.total,
            "recipe": cfg.recipe,
            "curriculum": {p.name: {"seq_len": p.seq_len, "global_batch_tokens": p.global_batch_tokens,
                                    "start_step": p.start_step, "steps": p.steps} for p in self.plans},
            "layout": state.layout.as_dict(),
            "model": cfg.model.to_dict(),
            "tokenizer": str(cfg.data.tokenizer),
            "config": config_to_dict(cfg),
        }

    def _save(self, state: ModelState, plan: StagePlan, position: RunPosition) -> Path:
        t0 = time.perf_counter()
        path = self.ckpt.save(
            position.step,
            {"model": state.model, "optim": state.optimizer, "trainer": self._trainer_state(plan, position, state)},
        )
        self.last_saved_step = position.step
        self.say(f"checkpoint step {position.step} -> {path} ({time.perf_counter() - t0:.2f}s)")
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
        from moe_lc.checkpoint import restore_rng

        cfg = self.cfg
        if rebuild:
            resume_path = self.ckpt.latest()
            self.say(f"layout changes for stage {plan.name}: {plan.layout.describe()}; reloading {resume_path}")
            if self.rt.device.type == "cuda":
                torch.cuda.empty_cache()
        state = build_model_state(cfg.model, cfg.optim, plan.layout, self.rt, cfg.seed)
        if resume_path is not None:
            trainer, rng = self.ckpt.load(resume_path, state.model, state.optimizer)
            if rng is not None:
                restore_rng(rng)
            self.say(f"resumed from {resume_path} (step {trainer.get('step')}, stage {trainer.get('stage')})")
        elif init_path is not None:
            self.ckpt.load(init_path, state.model, None)
            self.say(f"initialised the model from {init_path} (fresh optimizer, step {position.step})")
        return state

    def _rank0_first(self, fn) -> None:
        self.rt.rank0_first(fn)

    # --------------------------------------------------------------------- logging

    def say(self, text: str) -> None:
        """A console line (rank 0) that also goes to run_dir/train.log."""
        if getattr(self, "rt", None) is not None and not self.rt.is_main:
            return
        if hasattr(self, "progress"):
            self.progress.message(text)
        else:
            print(text, file=self.stream)
        if hasattr(self, "log_path") and self.log_path.parent.exists():
            with open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def _banner(self, rt: Runtime, position: RunPosition, resume: Optional[Path], init: Optional[Path]) -> str:
        from moe_lc.model.accounting import count_parameters

        rep = count_parameters(self.cfg.model)
        start = f"resuming at step {position.step}" if resume else f"fresh start (seed {self.cfg.seed})"
        dtype = {torch.bfloat16: "bf16 autocast, fp32 weights", torch.float64: "fp64"}.get(rt.compute_dtype, "fp32")
        return (
            f"moe-lc train: recipe {self.cfg.recipe}, model {self.cfg.model.name} ({rep.total:,} params, "
            f"{rep.active:,} active), {len(self.plans)} stages / {self.total} steps, device {rt.device} x "
            f"{rt.world_size} ({dtype}), {start}, run_dir {self.run_dir}"
        )

    def _open_sinks(self, resume_step: int, fresh: bool):
        from moe_lc.metrics import MetricSinks
        from moe_lc.metrics.sinks import truncate_after_step

        if not self.rt.is_main:
            return None
        for name in ("metrics.jsonl", "eval.jsonl"):
            path = self.run_dir / name
            if fresh and path.exists():
                path.unlink()
            else:
                truncate_after_step(path, resume_step)  # steps after the checkpoint are redone and re-logged
        cfg = self.cfg
        (self.run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1) + "\n")
        sinks = MetricSinks(
            self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, wandb_mode=cfg.logging.wandb_mode,
            run_name=f"{cfg.recipe}-{self.run_dir.name}", config=config_to_dict(cfg),
        )
        from moe_lc.metrics import JsonlWriter

        sinks.eval_jsonl = JsonlWriter(self.run_dir / "eval.jsonl")
        return sinks

    def _log_step(
        self, sinks, state: ModelState, plan: StagePlan, position: RunPosition, result: StepResult, dt: float,
        mean_step_time: float,
    ) -> None:
        from moe_lc.metrics import device_peak_flops, mfu, peak_memory_bytes
        from moe_lc.model.accounting import training_flops_per_token

        if not self.rt.is_main:
            return
        cfg = self.cfg
        tokens_per_s = plan.global_batch_tokens / dt if dt > 0 else 0.0
        flops_per_token = training_flops_per_token(cfg.model, plan.seq_len)
        peak = device_peak_flops(self.rt.device, cfg.logging.cpu_peak_flops)
        util = mfu(tokens_per_s, flops_per_token, peak, self.rt.world_size)
        maxvio = [float(m.balancer.last_maxvio) for m in state.moe_layers()]
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
            "tokens_per_s_per_device": tokens_per_s / self.rt.world_size,
            "mfu": util,
            "flops_per_token": flops_per_token,
            "peak_memory_gib": peak_memory_bytes(self.rt.device) / 2**30,
            "maxvio": max(maxvio) if maxvio else 0.0,
            "maxvio_per_layer": maxvio,
            "time": time.time(),
        }
        if result.aux_loss:
            record["aux_loss"] = result.aux_loss
        if position.step % cfg.logging.loads_every == 0 or position.step == plan.end_step:
            record["expert_loads"] = [m.balancer.last_loads.tolist() for m in state.moe_layers()]
        sinks.log(record, position.step)
        eta = self._eta(plan, position, mean_step_time)
        self.progress.update(position.step, plan.name, result.loss, tokens_per_s, eta)

    def _eta(self, plan: StagePlan, position: RunPosition, mean_step_time: float) -> float:
        """Seconds left: this stage at its measured pace, later stages scaled by their FLOPs per step."""
        from moe_lc.model.accounting import training_flops_per_token

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

    def _evaluate(self, sinks, state: ModelState, plan: StagePlan, data: StageData, position: RunPosition) -> None:
        from moe_lc.train.evaluation import describe_eval, evaluate_stage

        cfg = self.cfg
        if state.layout.cp > 1 or state.layout.pp > 1:
            self.say(f"eval skipped for stage {plan.name}: not supported with cp/pp > 1 yet")
            return
        t0 = time.perf_counter()
        autocast = self.rt.autocast if state.autocast_forward else contextlib.nullcontext
        result = evaluate_stage(
            state.model, eval_dataset(data, cfg.seed + cfg.eval.seed_offset), plan.seq_len, cfg.eval.sequences,
            cfg.eval.passkey_documents, self.rt.device, autocast, tokenizer=str(cfg.data.tokenizer),
            seed=cfg.seed + cfg.eval.seed_offset,
        )
        result.update({"step": position.step, "stage": plan.name, "eval_time_s": time.perf_counter() - t0})
        if sinks is not None:
            sinks.eval_jsonl.write(result)
            scalars = {f"eval/{k}": v for k, v in result.items() if isinstance(v, float)}
            if sinks.tb is not None:
                for k, v in scalars.items():
                    sinks.tb.add_scalar(k, v, position.step)
            if sinks.wandb is not None:
                sinks.wandb.log(scalars, step=position.step)
        line = describe_eval(result)
        if line:
            self.say(f"stage {plan.name} end (step {position.step}): {line} ({result['eval_time_s']:.1f}s)")

    def _render_report(self) -> None:
        if not self.rt.is_main:
            return
        try:
            from moe_lc.report import render_report
        except ImportError as err:
            self.say(f"report skipped ({err}); install matplotlib and run `moe-lc report {self.run_dir}`")
            return
        try:
            paths = render_report(self.run_dir)
        except ImportError as err:
            self.say(f"report skipped ({err}); install matplotlib and run `moe-lc report {self.run_dir}`")
            return
        if paths:
            self.say(f"report: {len(paths)} plots in {Path(paths[0]).parent}")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The JSON trainer state of a checkpoint directory (no tensors read)."""
    from moe_lc.checkpoint.ondisk import TRAINER_FILE

    f = Path(path) / TRAINER_FILE
    if not f.is_file():
        return {}
    return json.loads(f.read_text())


def _flat_diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        name = f"{prefix}{key}"
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _flat_diff(va, vb, prefix=f"{name}.")
        elif _normalise(va) != _normalise(vb):
            out.append((name, va, vb))
    return out


def _normalise(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def train(cfg: TrainConfig, stream: Optional[TextIO] = None) -> RunSummary:
    return Trainer(cfg, stream).run()
