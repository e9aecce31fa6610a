"""RunLog: the one home of a run's records.

    messages   console (beside the live progress line) and run_dir/train.log, timestamped
    steps      metrics.jsonl, TensorBoard, wandb, and the progress line
    evals      eval.jsonl, TensorBoard, wandb
    launches   launches.jsonl: each launch that trains, with the step it starts from
    report     run_dir/report (plots and summary), rendered from the JSONL files

Records are only ever appended: every step and eval record carries the id of the launch that
wrote it, so a resumed launch's redone steps sit beside the earlier ones in the raw files and a
reader takes, for each step, the record of the latest launch (`moe_lc.report.load`). A run dir
that cannot be created or written raises StorageError: one line with the path and the fix.

Messages go through a `logging` logger with two handlers: one that prints each message as a
line of its own without breaking the live progress line, one that appends it to train.log.
Rank 0 opens the log (`RunLog.open`); every other rank gets `RunLog.silent()`, which takes
the same calls and writes nothing, so that callers never test the rank.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, TextIO

from moe_lc.metrics import JsonlWriter, MetricSinks, Progress
from moe_lc.metrics.sinks import LAUNCHES_FILE
from moe_lc.storage import RUN_DIR_FIX, check_path, reported
from moe_lc.train.config import TrainConfig
from moe_lc.train.recipes import config_to_dict

LOGGER_NAME = "moe_lc.train.run"
LOG_FILE = "train.log"
CONFIG_FILE = "config.json"
TIMESTAMP = "%Y-%m-%d %H:%M:%S"
TENSORBOARD_MISSING = (
    "note: logging.tensorboard=true but the tensorboard package is not installed "
    "(pip install 'moe-lc[tensorboard]'); no TensorBoard events are written"
)


class _ConsoleHandler(logging.Handler):
    """Each message as a line of its own; the live progress line is cleared first and redrawn by
    the next step."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.message(self.format(record))
        except Exception:  # noqa: BLE001 - logging's convention: report, never raise into the caller
            self.handleError(record)


class RunLog:
    """A run's messages, metrics, evals and report (see the module docstring).

    Lifecycle: `open` (or `silent`), any number of `message`/`step`/`eval`, then `end_steps`
    once training is over (the last progress line stays, the metric writers are closed and
    flushed), then the closing messages and `report`, then `close` (also as a context manager).
    """

    def __init__(
        self,
        logger: logging.Logger,
        handlers: list[logging.Handler],
        progress: Optional[Progress] = None,
        metrics: Optional[MetricSinks] = None,
        run_dir: Optional[Path] = None,
        launch: Optional[str] = None,
    ) -> None:
        self._logger = logger
        self._handlers = handlers
        self._progress = progress
        self._metrics = metrics
        self._run_dir = run_dir
        self.launch = launch  # the id stamped on this launch's records

    @classmethod
    def open(
        cls,
        cfg: TrainConfig,
        total_steps: int,
        stream: Optional[TextIO] = None,
        metrics_after: Optional[int] = None,
    ) -> "RunLog":
        """Rank 0's log of the run in `cfg.run_dir` (created if needed).

        metrics_after: None when this launch trains no step (no metric file is touched);
        else the step it starts from (0 when fresh): the launch is added to launches.jsonl with
        that step (a reader drops earlier launches' records after it, as those steps are redone),
        and config.json is written. Nothing is truncated or deleted.
        """
        run_dir = check_path(cfg.run_dir, "run_dir")
        with reported(run_dir, "create the run directory", RUN_DIR_FIX):
            run_dir.mkdir(parents=True, exist_ok=True)
            log_file = logging.FileHandler(run_dir / LOG_FILE, mode="a", encoding="utf-8")
        progress = Progress(total_steps, cfg.logging.progress, cfg.logging.every, stream or sys.stdout)
        console = _ConsoleHandler(progress)
        console.setFormatter(logging.Formatter("%(message)s"))
        log_file.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt=TIMESTAMP))
        launch = new_launch_id()
        metrics = _open_metrics(cfg, run_dir, launch, metrics_after) if metrics_after is not None else None
        log = cls(_logger_with([console, log_file]), [console, log_file], progress, metrics, run_dir, launch)
        if metrics is not None and cfg.logging.tensorboard and metrics.tb is None:
            log.message(TENSORBOARD_MISSING)
        return log

    @classmethod
    def silent(cls) -> "RunLog":
        """The log of a rank other than 0: every call is accepted, nothing is written."""
        null = logging.NullHandler()
        return cls(_logger_with([null]), [null])

    # ---------------------------------------------------------------------------- records

    def message(self, text: str) -> None:
        """A console line that also goes to train.log."""
        self._logger.info(text)

    def warning(self, text: str) -> None:
        """A message that starts with `warning: `."""
        self._logger.warning(f"warning: {text}")

    def step(self, record: dict[str, Any], eta_s: float) -> None:
        """One optimizer step's record (`step`, `stage`, `loss`, `tokens_per_s`, ...); the progress
        line shows it with `eta_s` seconds left."""
        if self._metrics is not None:
            self._metrics.log({**record, "launch": self.launch}, record["step"])
        if self._progress is not None:
            self._progress.update(record["step"], record["stage"], record["loss"], record["tokens_per_s"], eta_s)

    def eval(self, result: dict[str, Any]) -> None:
        """A stage-end evaluation result (with its `step`)."""
        if self._metrics is not None:
            self._metrics.log_eval({**result, "launch": self.launch}, result["step"])

    def report(self) -> None:
        """Render the report of the run (plots need matplotlib: without it, say how to get them)."""
        if self._run_dir is None:
            return
        try:
            from moe_lc.report import render_report  # imports matplotlib: a broken install costs only the report

            paths = render_report(self._run_dir)
        except ImportError as err:
            self.message(f"report skipped ({err}); install matplotlib and run `moe-lc report {self._run_dir}`")
            return
        if paths:
            self.message(f"report: {len(paths)} plots in {Path(paths[0]).parent}")

    # --------------------------------------------------------------------------- closing

    def end_steps(self) -> None:
        """Training is over: keep the last progress line, close (flush) the metric writers."""
        if self._progress is not None:
            self._progress.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def close(self) -> None:
        self.end_steps()
        for handler in self._handlers:
            self._logger.removeHandler(handler)
            handler.close()
        self._handlers = []

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _logger_with(handlers: list[logging.Handler]) -> logging.Logger:
    """The run logger with exactly `handlers` (one run at a time per process)."""
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):  # left by a run that did not close its log
        logger.removeHandler(old)
        old.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the console handler prints; the root logger's would print again
    for handler in handlers:
        logger.addHandler(handler)
    return logger


def new_launch_id() -> str:
    """A launch's id: its UTC start time (sortable, readable) and a random suffix (unique)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


def _open_metrics(cfg: TrainConfig, run_dir: Path, launch: str, start_step: int) -> MetricSinks:
    launches = JsonlWriter(run_dir / LAUNCHES_FILE)
    launches.write({"launch": launch, "start_step": start_step, "time": time.time(), "host": socket.gethostname()})
    launches.close()
    config = config_to_dict(cfg)
    with reported(run_dir / CONFIG_FILE, f"write {CONFIG_FILE}", RUN_DIR_FIX):
        (run_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return MetricSinks(
        run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project, wandb_mode=cfg.logging.wandb_mode,
        run_name=f"{cfg.recipe}-{run_dir.name}", config=config,
    )
