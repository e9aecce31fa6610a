"""The trainer's configuration schema: what a recipe in `recipes/` may set.

Plain dataclasses registered with Hydra's ConfigStore as structured configs, so that every
field is typed, has a default, and can be overridden from the command line
(`moe-lc train curriculum.stages.s1k.steps=5 optim.lr=1e-3`); a misspelt key or a value of
the wrong type is rejected while the recipe is composed, before anything is built.

The model section is a full `moe_lc.config.ModelConfig`: `recipes/model/<name>.yaml`
starts from the preset of that name (registered below as `moe_lc_preset/<name>`) and may
override any of its fields. The layout section is `moe_lc.parallel.ParallelLayout` itself, so
its choices (dp_mode, param_dtype) are enums that OmegaConf checks while composing; the same
holds for `activation_checkpointing` (`moe_lc.parallel.ActivationCheckpointing`, mode an enum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from moe_lc.config import ConfigError, ModelConfig
from moe_lc.optim import OptimConfig
from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
from moe_lc.parallel.compile import RegionalCompile
from moe_lc.parallel.float8 import Float8Training
from moe_lc.parallel.layout import ParallelLayout

# Data-source prefixes that name built-in data instead of a `.bin`/`.idx` path.
DEFAULT_CORPUS = "@default"  # the embedded default corpus (Python standard library sources)
SYNTHETIC_PREFIX = "@"  # "@passkey", "@associative_recall": generated at the stage's seq_len


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class SourceConfig:
    """One weighted data source: a Megatron `.bin`/`.idx` prefix, `@default` or a synthetic `@task`."""

    prefix: str = MISSING
    weight: float = 1.0


@dataclass
class DataConfig:
    tokenizer: str = "byte"  # "byte" or a Hugging Face tokenizer.json path (must match the sources' .meta.json)
    sources: List[SourceConfig] = MISSING  # set by recipes/data/*.yaml
    cache_dir: Optional[str] = None  # default corpus and synthetic data; null: $MOE_LC_CACHE or ~/.cache/moe_lc
    synthetic_documents: int = 64  # documents generated per synthetic source and stage
    synthetic_seed: int = 0


@dataclass
class StageConfig:
    """One curriculum stage. Exactly one of `steps` and `tokens` (a token budget) is set."""

    seq_len: int = MISSING
    global_batch_tokens: int = MISSING  # tokens per optimizer step, all data-parallel ranks together
    micro_batch: int = 1  # sequences per forward/backward on one data-parallel rank
    steps: Optional[int] = None
    tokens: Optional[int] = None
    # fields of the run's layout that this stage changes, merged over it: {cp: 4} (checked when composed;
    # untyped so that a stage may name any subset: add one from the command line with
    # +curriculum.stages.NAME.layout.cp=4)
    layout: Any = None
    # fields of the run's activation_checkpointing that this stage changes, merged over it the same way:
    # {mode: full}, {mode: selective, every: 2}
    activation_checkpointing: Any = None
    data: Optional[List[SourceConfig]] = None  # null: the run's data mixture


@dataclass
class CurriculumConfig:
    """Ordered stages (YAML order); one LR schedule spans all of them, whichever are run."""

    name: str = "custom"
    stages: Dict[str, StageConfig] = field(default_factory=dict)
    run: Optional[List[str]] = None  # names of the stages this launch trains (null: all, in order)


@dataclass
class CheckpointConfig:
    every: int = 0  # optimizer steps between checkpoints (0: only at stage ends and at the end)
    at_stage_end: bool = True
    at_end: bool = True  # when a launch ends (max_steps, the curriculum's end); a stop signal always saves
    keep_last: int = 3
    async_save: bool = False
    dir: str = "checkpoints"  # relative to run_dir


@dataclass
class LoggingConfig:
    progress: str = "auto"  # auto (a live line on a terminal, plain lines otherwise) | bar | lines | none
    every: int = 1  # console lines every N steps (metrics.jsonl gets every step)
    loads_every: int = 1  # per-expert loads in metrics.jsonl every N steps (MaxVio is logged every step)
    tensorboard: bool = True  # when the tensorboard package is installed
    wandb: bool = False
    wandb_project: str = "moe-lc"
    wandb_mode: Optional[str] = None  # null: online when credentials are present, else offline
    cpu_peak_flops: Optional[float] = None  # override the nominal CPU peak used for MFU


@dataclass
class EvalConfig:
    """Held-out evaluation at the end of each stage: loss by position and passkey retrieval."""

    at_stage_end: bool = True
    sequences: int = 2  # sequences of the stage's length, drawn with a seed the training data never uses
    passkey_documents: int = 2  # synthetic passkey documents of the stage's length (0: skip)
    seed_offset: int = 1_000_003


@dataclass
class ReportConfig:
    at_end: bool = True  # render `moe-lc report RUN_DIR` when the run finishes


@dataclass
class RunLockConfig:
    """One trainer per run_dir (moe_lc/train/runlock.py): who may take over a lock that is held."""

    stale_after_s: float = 600.0  # a lock from another host untouched this long is stale (holders touch it every 60 s)
    force: bool = False  # take the lock whatever holds it (its holder is known to be gone)

    def check(self) -> None:
        _need(self.stale_after_s > 0, f"run_lock.stale_after_s={self.stale_after_s} must be > 0")


@dataclass
class DistributedConfig:
    """A multi-rank launch fails instead of hanging, and reports on itself."""

    collective_timeout_s: float = 600.0  # a collective that waits longer for a rank is an error (every group)
    flight_recorder_entries: int = 2000  # NCCL flight recorder ring size, dumped on a timeout (0: off)
    heartbeat_every_s: float = 300.0  # a heartbeat line this often at a step end (0: none)
    straggler_every: int = 50  # steps between straggler checks (0: none)
    straggler_ratio: float = 1.5  # report a rank whose own time per step is this many times the median

    def check(self) -> None:
        _need(self.collective_timeout_s > 0, f"distributed.collective_timeout_s={self.collective_timeout_s} must be > 0")
        _need(self.flight_recorder_entries >= 0,
              f"distributed.flight_recorder_entries={self.flight_recorder_entries} must be >= 0 (0: off)")
        _need(self.heartbeat_every_s >= 0, f"distributed.heartbeat_every_s={self.heartbeat_every_s} must be >= 0")
        _need(self.straggler_every >= 0, f"distributed.straggler_every={self.straggler_every} must be >= 0")
        _need(self.straggler_ratio > 1, f"distributed.straggler_ratio={self.straggler_ratio} must be > 1")


@dataclass
class BadStepConfig:
    """Steps with a non-finite loss or gradient norm are skipped on every rank; loss spikes are reported."""

    max_consecutive_skips: int = 3  # the run stops after this many skipped steps in a row
    max_skips: int = 20  # ... or this many in one launch
    spike_sigmas: float = 6.0  # a loss above mean + k std of the last spike_window steps is a spike (0: off)
    spike_window: int = 50
    spike_rollback: bool = False  # on a spike: reload the stage's newest checkpoint and skip the spiking batch

    def check(self) -> None:
        _need(self.max_consecutive_skips >= 1 and self.max_skips >= 1,
              "bad_steps.max_consecutive_skips and bad_steps.max_skips must be >= 1")
        _need(self.spike_sigmas >= 0, f"bad_steps.spike_sigmas={self.spike_sigmas} must be >= 0 (0: off)")
        _need(self.spike_window >= 2, f"bad_steps.spike_window={self.spike_window} must be >= 2")


@dataclass
class GarbageCollectionConfig:
    """Python's garbage collector on a step schedule (`moe_lc.train.gc_schedule`): every rank collects
    after the same steps, the automatic collector off in between."""

    every: int = 0  # steps between full collections (0: Python's automatic collector, as before)

    def check(self) -> None:
        _need(self.every >= 0, f"gc.every={self.every} must be >= 0 (0: Python's automatic collector)")


@dataclass
class TrainConfig:
    recipe: str = "custom"  # set from `recipe=NAME` by the loader
    run_dir: str = "runs/${recipe}"
    seed: int = 0
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    # auto (bf16 autocast + fp32 weights on GPU, fp32 on CPU) | fp32 | bf16 | fp8 (GPU: the dense linears'
    # GEMMs in float8, the rest as bf16; `float8:` below) | fp64 (tests)
    precision: str = "auto"
    float8: Float8Training = field(default_factory=Float8Training)  # how precision=fp8 runs
    # torch.compile of the norms, AttnRes mixers and float8 linears (enabled, targets; moe_lc.parallel.compile)
    compile: RegionalCompile = field(default_factory=RegionalCompile)
    resume: str = "auto"  # auto (newest valid checkpoint; fresh only in a new run dir) | none | fresh | PATH
    init_from: Optional[str] = None  # checkpoint whose model weights start a fresh run
    max_steps: Optional[int] = None  # stop after this global step (the schedule still spans the curriculum)
    threads: Optional[int] = None  # CPU intra-op threads (null: torch's default)
    model: ModelConfig = MISSING
    layout: ParallelLayout = field(default_factory=ParallelLayout)  # how the ranks are split
    # what the decoder layers keep for backward: mode none | selective | full, every, offload
    activation_checkpointing: ActivationCheckpointing = field(default_factory=ActivationCheckpointing)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    run_lock: RunLockConfig = field(default_factory=RunLockConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    bad_steps: BadStepConfig = field(default_factory=BadStepConfig)
    gc: GarbageCollectionConfig = field(default_factory=GarbageCollectionConfig)


SCHEMA_NAME = "moe_lc_train_schema"
PRESET_GROUP = "moe_lc_preset"


def register_configs() -> None:
    """Put the schema and the model presets into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from moe_lc.presets import PRESETS, get_preset

    cs = ConfigStore.instance()
    cs.store(name=SCHEMA_NAME, node=TrainConfig)
    for name in PRESETS:
        cs.store(group=PRESET_GROUP, name=name, node=get_preset(name))
