"""From a stage's data mixture to this rank's micro-batches.

Sources are Megatron `.bin`/`.idx` prefixes, `@default` (the embedded corpus) or `@<task>`
(a synthetic long-range task generated at the stage's sequence length, one document per
sequence). Step s of a stage that has consumed `c` sequences uses global sequences
[c, c + S) (S = sequences per step); data-parallel rank r of D runs micro-batch a on
sequences c + (a D + r) m + [0, m), m = micro_batch. Every layout therefore trains on the
same global batch, and the only data state to checkpoint is `c` per stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from moe_lc.config import ConfigError
from moe_lc.train.config import DEFAULT_CORPUS, SYNTHETIC_PREFIX, DataConfig, SourceConfig
from moe_lc.train.curriculum import StagePlan

SYNTHETIC_TASKS = ("passkey", "associative_recall")


def synthetic_prefix(task: str, seq_len: int, data: DataConfig, tokenizer_name: str) -> Path:
    from moe_lc.data.corpus import cache_root

    safe_tok = "".join(c if c.isalnum() else "_" for c in tokenizer_name)[-40:]
    name = f"{task}-len{seq_len}-n{data.synthetic_documents}-seed{data.synthetic_seed}-{safe_tok}"
    return cache_root(data.cache_dir) / "synthetic" / name


def _ensure_synthetic(task: str, seq_len: int, data: DataConfig) -> str:
    """Generate the task's `.bin`/`.idx` once (into a temp prefix, then renamed: concurrent-safe)."""
    from moe_lc.data import write_synthetic

    prefix = synthetic_prefix(task, seq_len, data, str(data.tokenizer))
    if Path(f"{prefix}.idx").is_file():
        return str(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f"{prefix.name}.tmp{os.getpid()}")
    write_synthetic(tmp, task, data.synthetic_documents, seq_len, seed=data.synthetic_seed, tokenizer=data.tokenizer)
    for ext in (".bin", ".meta.json", ".answers.json", ".idx"):  # .idx last: its presence means "complete"
        src = Path(f"{tmp}{ext}")
        if src.exists():
            os.replace(src, f"{prefix}{ext}")
    return str(prefix)


def resolve_prefix(source: SourceConfig, seq_len: int, data: DataConfig) -> str:
    """The `.bin`/`.idx` prefix a source names, building built-in data on first use."""
    prefix = source.prefix
    if prefix == DEFAULT_CORPUS:
        from moe_lc.data import default_corpus

        return default_corpus(data.cache_dir)
    if prefix.startswith(SYNTHETIC_PREFIX):
        task = prefix[len(SYNTHETIC_PREFIX):]
        if task not in SYNTHETIC_TASKS:
            raise ConfigError(
                f"unknown built-in data source {prefix!r}; use {DEFAULT_CORPUS}, "
                + ", ".join(f"@{t}" for t in SYNTHETIC_TASKS)
                + ", or a .bin/.idx path prefix"
            )
        return _ensure_synthetic(task, seq_len, data)
    path = os.path.expanduser(prefix)
    if not (Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()):
        raise ConfigError(
            f"data source {prefix!r}: {path}.bin / {path}.idx not found. Create them with "
            f"`moe-lc prepare-data FILES... --output-prefix {prefix}` or fix data.sources"
        )
    return path


@dataclass
class StageData:
    """A stage's packed dataset and how one step's global batch splits over ranks and micro-batches."""

    plan: StagePlan
    dataset: object  # moe_lc.data.PackedDataset
    prefixes: tuple[str, ...]

    def micro_batch_indices(self, consumed: int, dp_rank: int) -> list[list[int]]:
        """Global sequence indices of each of this rank's micro-batches for the step starting at `consumed`."""
        p, dp = self.plan, self.plan.layout.dp
        m = p.micro_batch
        return [[consumed + (a * dp + dp_rank) * m + j for j in range(m)] for a in range(p.grad_accum)]

    def micro_batches(self, consumed: int, dp_rank: int, pin_memory: bool = False) -> list:
        """This rank's micro-batches (packed `Batch`es) of the step starting at `consumed`.

        pin_memory: token ids and labels in page-locked memory, so that their upload to a GPU is
        a copy that does not wait (the trainer prepares batches ahead, on another thread).
        """
        from moe_lc.data import collate

        batches = [collate([self.dataset[i] for i in idx]) for idx in self.micro_batch_indices(consumed, dp_rank)]
        if pin_memory:
            batches = [replace(b, input_ids=b.input_ids.pin_memory(), labels=b.labels.pin_memory()) for b in batches]
        return batches


def build_stage_data(
    plan: StagePlan,
    data: DataConfig,
    model_vocab_size: int,
    seed: int,
    sync: Optional[Callable[[Callable[[], None]], None]] = None,
) -> StageData:
    """Resolve (and if needed build) the stage's sources, check them against the model's vocabulary."""
    from moe_lc.data import DataSource, PackedDataset, check_vocab, load_tokenizer

    try:
        tokenizer = load_tokenizer(data.tokenizer)
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.tokenizer={data.tokenizer!r}: {err}") from err

    def resolve_all() -> list[str]:
        return [resolve_prefix(s, plan.seq_len, data) for s in plan.sources]

    if sync is not None:  # rank 0 builds built-in data first, the others then find it in the cache
        sync(resolve_all)
    prefixes = resolve_all()
    for prefix in prefixes:
        try:
            check_vocab(prefix, model_vocab_size, tokenizer)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from err
    sources = [DataSource(p, s.weight) for p, s in zip(prefixes, plan.sources)]
    try:
        dataset = PackedDataset(sources, plan.seq_len, seed=seed, eod_id=tokenizer.eod_id)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"stage {plan.name}: {err}") from err
    return StageData(plan, dataset, tuple(prefixes))


def eval_dataset(stage: StageData, seed: int):
    """The stage's mixture under another shuffle seed: sequences the training order reaches much later."""
    from moe_lc.data import DataSource, PackedDataset

    sources: Sequence = [DataSource(p, s.weight) for p, s in zip(stage.prefixes, stage.plan.sources)]
    return PackedDataset(sources, stage.plan.seq_len, seed=seed, eod_id=stage.dataset.eod_id)
