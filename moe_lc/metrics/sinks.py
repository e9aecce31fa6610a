"""Where metrics go: JSONL files (always), TensorBoard (when installed), wandb (when enabled).

One record per optimizer step is a flat-ish dict: scalars are logged everywhere; lists
(per-layer MaxVio, per-expert loads) only go to JSONL, with per-layer MaxVio also sent to
TensorBoard/wandb as `maxvio/layer_<i>` scalars.

The JSONL files are only ever appended to: a resumed launch adds its records (redone steps
included) after the earlier ones; a reader picks the run as trained (`moe_lc.report.load`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from moe_lc.storage import reported

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
LAUNCHES_FILE = "launches.jsonl"  # one line per launch that trains: its id and the step it starts from
_MOVE_HINT = "or set run_dir=... to another directory"


class JsonlWriter:
    """Append-only JSON lines, flushed per record so that a killed run keeps what it logged.

    A torn last line left by a killed writer is ended first, so that it cannot swallow the
    first record appended after it. A failing write raises StorageError (path, cause, fix).
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        with reported(self.path, f"open {self.path.name} for appending", _MOVE_HINT):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a+b")
            if self._fh.tell() > 0:
                self._fh.seek(-1, os.SEEK_END)
                if self._fh.read(1) != b"\n":
                    self._fh.write(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=_jsonable, allow_nan=True) + "\n"
        with reported(self.path, f"append to {self.path.name}", _MOVE_HINT):
            self._fh.write(line.encode("utf-8"))
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def read_jsonl(path: Union[str, Path]) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (the writer was killed mid-write) is skipped."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                yield name, float(value)
        elif isinstance(value, dict):
            yield from _scalars(value, prefix=f"{name}/")
        elif key == "maxvio_per_layer" and isinstance(value, list):
            for i, v in enumerate(value):
                yield f"maxvio/layer_{i}", float(v)


class MetricSinks:
    """A run's metrics.jsonl (one record per step) and eval.jsonl (one per stage end), plus the
    optional TensorBoard and wandb writers; None where not requested or not installed."""

    def __init__(
        self,
        run_dir: Union[str, Path],
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "moe-lc",
        wandb_mode: Optional[str] = None,
        run_name: Optional[str] = None,
        config: Optional[dict] = None,
    ):
        self.run_dir = Path(run_dir)
        self.jsonl = JsonlWriter(self.run_dir / METRICS_FILE)
        self.eval_jsonl = JsonlWriter(self.run_dir / EVAL_FILE)
        self.tb = _tensorboard_writer(self.run_dir / "tensorboard") if tensorboard else None
        self.wandb = _wandb_run(self.run_dir, wandb_project, wandb_mode, run_name, config) if wandb else None

    def log(self, record: dict[str, Any], step: int) -> None:
        """One step's record: all of it to metrics.jsonl, its scalars to TensorBoard and wandb."""
        self.jsonl.write(record)
        scalars = dict(_scalars({k: v for k, v in record.items() if k != "step"}))
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def log_eval(self, result: dict[str, Any], step: int) -> None:
        """A stage-end evaluation: all of it to eval.jsonl, its float values as `eval/<key>` scalars."""
        self.eval_jsonl.write(result)
        scalars = {f"eval/{k}": v for k, v in result.items() if isinstance(v, float)}
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.jsonl.close()
        self.eval_jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _tensorboard_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(logdir))


def wandb_mode(requested: Optional[str]) -> str:
    """The mode to run wandb in: as requested, else online only when credentials exist."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if not has_key and netrc.is_file():
        try:
            has_key = "api.wandb.ai" in netrc.read_text()
        except OSError:
            has_key = False
    return "online" if has_key else "offline"


def _wandb_run(run_dir: Path, project: str, mode: Optional[str], name: Optional[str], config: Optional[dict]):
    try:
        import wandb
    except ImportError:
        warnings.warn("logging.wandb=true but wandb is not installed (pip install 'moe-lc[wandb]'); skipping it")
        return None
    return wandb.init(project=project, name=name, dir=str(run_dir), mode=wandb_mode(mode), config=config, resume="allow")
