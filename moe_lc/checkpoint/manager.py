"""CheckpointManager: atomic, verified, layout-independent training checkpoints on torch.distributed.checkpoint.

A save writes model + optimizer tensors with DCP (each rank writes its own shards;
`get_state_dict` turns FSDP2/TP DTensor parameters into sharded state that DCP can
re-shard on load; a module's extra state that is a dict of tensors is stored one entry
per tensor), the trainer's JSON dict (rank 0) and every rank's RNG state into a
temp directory; each rank hashes the files it wrote as soon as they are written (for an
async save, in the background thread that writes them). After all ranks are done, rank 0
writes the COMPLETE manifest (sizes and checksums of every file), renames the directory
to `step_XXXXXXXX`, points `latest` at it and prunes old checkpoints. A save first checks
that the disk has room for one more checkpoint of the last one's size.

A load (and `select`, which picks the checkpoint a launch resumes from) checks every
file's checksum first, each rank hashing its share, and falls back past damaged
checkpoints when asked for the newest one. See `ondisk.py` for the layout and why a crash
at any moment is harmless.

Every public method that touches tensors or checks checksums (`save`, `load`, `select`,
`verify`, `set_aside`, `wait`, `close`) is collective when torch.distributed is initialised:
all ranks call it, in the same order. The checkpoint root must be on a filesystem that all
ranks share.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moe_lc import storage
from moe_lc.storage import StorageError

from . import coordination as co
from . import ondisk
from .errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from .rng import RngState, capture_rng

PathLike = Union[str, os.PathLike]
Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]
T = TypeVar("T")

# Sharded (not gathered) state, and optimizer state keyed by parameter name
# ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), so that neither the parallel
# layout nor the grouping of parameters into optimizer groups is baked into the files.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

_STATE_KEYS = {"model", "optim", "trainer", "rng"}

# DCP warns on every single-process save/load, even when asked for one explicitly (no_dist).
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
_PARAM_GROUPS = "optim.param_groups."
_NOT_FOUND_HINT = "use resume=none or point to a dir containing step_* checkpoints"
_MOVE_HINT = "or set checkpoint.dir (relative to run_dir, or absolute) to another filesystem"
_MAX_NAMED = 5
# A save needs room for a checkpoint as large as the last one, plus this share for growth.
SPACE_MARGIN = 0.10
# A write that failed with no errno (torch's zip writer reports "unexpected pos") while less
# than this is free failed for want of space.
_NEARLY_FULL = 64 << 20
# What a failed check is rejected for: damage, and storage that cannot be read.
_CHECK_FAILURES = (CheckpointCorruptError, StorageError)


@dataclass(frozen=True)
class Rejected:
    """A checkpoint that failed its check, and why (the message names the file)."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Selection:
    """The checkpoint `select` found (None: no valid one) and those rejected on the way, newest first."""

    path: Optional[Path]
    rejected: tuple[Rejected, ...] = ()


@dataclass
class _PendingSave:
    """An async save whose tensors are still being written by DCP's background thread."""

    final_dir: Path
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None


class _HashingWriter(dcp.FileSystemWriter):
    """DCP's file writer, which also hashes each file right after writing it, on the rank that
    wrote it (for an async save, in the background thread that writes), and leaves the digests
    (with those of the rank's other files, `written`) in the checkpoint for rank 0's manifest.

    DCP gathers every rank's write results before its coordinator writes `.metadata`, so the
    digests of all ranks are on disk by the time the save returns (or its future resolves).
    """

    def __init__(self, path: Path, rank: int, written: dict[str, dict[str, Any]]) -> None:
        super().__init__(path, sync_files=True)
        self._dir, self._rank, self._written = Path(path), rank, dict(written)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        entries = dict(self._written)
        for result in future.wait():
            rel = result.storage_data.relative_path
            if rel not in entries:
                path = self._dir / rel
                entries[rel] = ondisk.digest_entry(path.stat().st_size, ondisk.file_digest(path), self._rank)
        ondisk.write_rank_digests(self._dir, self._rank, entries)
        return future


class CheckpointManager:
    """Saves and restores training state under `root`; see the module docstring.

    keep_last: how many complete checkpoints to keep (the newest is never pruned);
        None keeps all.
    async_save: write tensors in the background with `dcp.async_save`: `save` returns
        once the state is staged in CPU memory, and the checkpoint is published
        (marker, rename, `latest`) once its files are durable and hashed. A pending save
        is finished before the next save, before a load and in `close()`.
    """

    def __init__(self, root: PathLike, keep_last: Optional[int] = 3, async_save: bool = False) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        self.root = storage.check_path(root, "the checkpoint root (run_dir, checkpoint.dir)")
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self._coordinator = co.Coordinator()
        self._async_group: Optional[Any] = None
        self._pending: Optional[_PendingSave] = None
        # Rank 0: checkpoints fully checked (or written) by this manager -> their manifest's bytes,
        # so that a checkpoint is hashed once per launch, not again when it is loaded.
        self._checked: dict[Path, bytes] = {}

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Checkpoint `state` as step `step`; returns the final `root/step_XXXXXXXX` path.

        state["model"]: the nn.Module (plain, FSDP2- or TP-parallelised); required.
        state["optim"]: an optimizer, a list of optimizers, or None.
        state["trainer"]: a JSON-serialisable dict (step, stage, data position, ...).
        state["rng"]: this rank's RNG state; omitted = `capture_rng()` now; None = not saved.
        With async_save the returned path appears once the background write is durable.
        A full disk, missing permissions or too little free space raise StorageError (one
        line: path, cause, fix); the previous checkpoint is left as it was.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        unknown = set(state) - _STATE_KEYS
        if unknown or "model" not in state:
            raise ValueError(
                f"checkpoint state must hold 'model' and optionally 'optim', 'trainer', 'rng'; "
                f"got keys {sorted(state)} (unknown: {sorted(unknown)}). Put other scalars in state['trainer'] "
                "and other tensors in the model as buffers."
            )
        trainer_json = _encode_trainer(state.get("trainer") or {})
        rng = state["rng"] if "rng" in state else capture_rng()
        tensors = _state_dicts(_as_module(state["model"]), _as_optimizers(state.get("optim")))

        self.wait()
        final_dir = self.root / ondisk.step_dir_name(step)
        temp_dir = self._coordinator.rank0_decides(lambda: self._make_temp_dir(final_dir, step))
        small = {ondisk.rng_file(co.rank()): _torch_bytes(rng)} if rng is not None else {}
        if co.rank() == 0:
            small[ondisk.TRAINER_FILE] = trainer_json
        written = self._coordinator.every_rank_runs(lambda: self._write_small_files(temp_dir, small, step))
        writer = _HashingWriter(temp_dir, co.rank(), written)

        if self.async_save:
            response = dcp.async_save(tensors, storage_writer=writer, **self._async_kwargs())
            future = getattr(response, "upload_completion", response)  # AsyncSaveResponse or Future
            pending = _PendingSave(final_dir)
            pending.thread = threading.Thread(
                target=self._finish_async, args=(pending, future, temp_dir, step), name="moe-lc-ckpt-publish"
            )
            pending.thread.start()
            self._pending = pending
            return final_dir

        try:
            dcp.save(tensors, storage_writer=writer, **_dist_kwargs())
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise self._write_failed(err, temp_dir, step) from err
        self._coordinator.barrier()  # every rank's shards, digests and RNG file are on disk
        return self._coordinator.rank0_decides(lambda: self._publish(temp_dir, final_dir, step))

    def wait(self) -> Optional[Path]:
        """Finish a pending async save (publishing it); returns its path, or None if none was pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        assert pending.thread is not None
        pending.thread.join()

        def outcome() -> Path:
            if pending.error is not None:
                raise pending.error
            return pending.final_dir

        path = self._coordinator.rank0_decides(outcome)
        if pending.error is not None:
            raise pending.error
        return path

    def close(self) -> None:
        """Finish any pending save. Call before destroying the process group."""
        self.wait()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ discovery

    def checkpoints(self) -> list[Path]:
        """Final-named checkpoint directories with a COMPLETE marker, oldest step first (not verified)."""
        return [path for _, path in ondisk.step_dirs(self.root) if (path / ondisk.MARKER).is_file()]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint by the cheap check (manifest, sizes, small files' checksums):
        where `latest` points, else found by scanning. Not collective; `select` checks every file."""
        try:
            pointed = ondisk.read_pointer(self.root)
        except CheckpointCorruptError as err:
            warnings.warn(f"{err}; using the newest complete checkpoint instead", stacklevel=2)
            pointed = None
        if pointed is not None:
            if ondisk.is_valid(pointed):
                return pointed
            warnings.warn(
                f"{self.root / ondisk.POINTER} names {pointed.name}, which is missing or invalid; "
                "using the newest complete checkpoint instead",
                stacklevel=2,
            )
        return _newest_valid(self.root, already_reported=pointed)

    def select(self, path: Optional[PathLike] = None) -> Selection:
        """The checkpoint meant by `path`, with every file checked against its checksum (collective).

        None, "latest" or "auto": the one `latest` names, else the newest, under this manager's
        root; a directory holding step_* checkpoints: the same under it. In both cases a
        checkpoint that fails its check is rejected (listed in the result) and the next older
        one is tried; Selection.path is None when none passes. A checkpoint directory: that
        one, or CheckpointCorruptError naming the damaged file and the previous valid checkpoint
        (StorageError for a file that cannot be read).
        """
        kind, target = self._coordinator.rank0_decides(lambda: self._locate(path))
        if kind == "checkpoint":
            try:
                self.verify(target)
            except CheckpointCorruptError as err:
                raise CheckpointCorruptError(_corrupt_message(target, str(err))) from err
            return Selection(target)
        rejected: list[Rejected] = []
        for candidate in self._coordinator.rank0_decides(lambda: _candidates(target)):
            try:
                self.verify(candidate)
                return Selection(candidate, tuple(rejected))
            except _CHECK_FAILURES as err:
                rejected.append(Rejected(candidate, str(err)))
        return Selection(None, tuple(rejected))

    def verify(self, path: PathLike) -> dict[str, Any]:
        """Check checkpoint directory `path` file by file against its manifest (collective): rank 0
        reads the manifest and checks every size, each rank hashes its share of the files (those
        its rank wrote, see `ondisk.owned_by`), rank 0 reads the DCP metadata. Returns the
        manifest; CheckpointCorruptError naming the damaged file, or StorageError for a file
        that cannot be read. A checkpoint this manager wrote or already checked is not hashed again.
        """
        ckpt = Path(path)
        manifest, done = self._coordinator.rank0_decides(lambda: self._check_manifest(ckpt))
        if not done:
            share = ondisk.owned_by(manifest, co.rank(), co.world_size())
            self._coordinator.every_rank_runs(lambda: _check_digests(ckpt, manifest, share))
            self._coordinator.rank0_decides(lambda: self._check_dcp_metadata(ckpt, manifest))
        return manifest

    def set_aside(self, keep: Optional[Path], why: str, also: Iterable[Path] = ()) -> Optional[Path]:
        """Move the checkpoints of this root that a launch continuing from `keep` must not build
        on into `root/set-aside/<time>-<why>/` (collective; nothing is deleted): those newer than
        `keep`, or all of them when `keep` is None or under another root, plus `also` (rejected
        ones). `latest` is pointed at `keep` (or moved too). Returns the folder, None if nothing moved.
        """

        def move() -> Optional[Path]:
            keep_step = ondisk.parse_step(keep.name) if keep is not None and keep.parent == self.root else None
            doomed = {path for step, path in ondisk.step_dirs(self.root) if keep_step is None or step > keep_step}
            doomed |= {Path(p) for p in also if Path(p).parent == self.root and Path(p).exists()}
            doomed -= {keep}
            if not doomed:
                return None
            pointer = self.root / ondisk.POINTER
            moved = sorted(doomed) + ([pointer] if keep_step is None and pointer.exists() else [])
            with storage.reported(self.root, "move superseded checkpoints aside", _MOVE_HINT):
                dest = ondisk.set_aside(self.root, moved, why)
                if keep_step is not None:
                    ondisk.write_pointer(self.root, keep)
            return dest

        return self._coordinator.rank0_decides(move)

    def rank0_decides(self, decide: Callable[[], T]) -> T:
        """Run `decide` on rank 0 only and return its value (or raise its error) on every rank
        (collective): for decisions about shared files that all ranks must agree on."""
        return self._coordinator.rank0_decides(decide)

    # ------------------------------------------------------------------------------ load

    def load(
        self,
        path: Optional[PathLike],
        model: nn.Module,
        optimizer: Optimizers = None,
    ) -> tuple[dict[str, Any], Optional[RngState]]:
        """Restore `model` (and `optimizer`) in place from a checkpoint; return (trainer dict, rng).

        `path`: see `select` (None / "latest" = the newest checkpoint under root that passes its
        check; the ones skipped are warned about). Every file is checked against its checksum
        before any tensor is read. Tensors are re-sharded to the current parallel layout. The
        RNG state is this rank's; if the checkpoint was written by fewer ranks, rank 0's state
        is returned instead (exact resume is only promised for the same layout). Restore it with
        `restore_rng`. With optimizer=None only the model is restored.
        """
        module = _as_module(model)
        optimizers = _as_optimizers(optimizer)
        self.wait()
        ckpt = self._selected(path)
        metadata = _read_dcp_metadata(ckpt)
        state = _state_dicts(module, optimizers)
        # A sharded optimizer (ZeRO-1) holds only this rank's share of the state: a key is
        # unexpected only if no rank wants it.
        wanted_anywhere = self._coordinator.union(_flat_keys(state))
        to_read = self._coordinator.every_rank_runs(
            lambda: _select_against_checkpoint(state, metadata, ckpt, wanted_anywhere)
        )
        try:
            dcp.load(to_read, storage_reader=dcp.FileSystemReader(ckpt), **_dist_kwargs())
        except (Exception, CheckpointException) as err:
            cause = _os_error_in(err)
            if cause is None:
                raise
            raise storage.storage_error(cause, ckpt, f"read checkpoint {ckpt}") from err
        if optimizers:
            state["optim"].update(to_read["optim"])  # hyperparameters read as new objects
            set_state_dict(
                module,
                optimizers,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=STATE_DICT_OPTIONS,
            )
        else:
            set_model_state_dict(module, state["model"], options=STATE_DICT_OPTIONS)
        return _read_trainer(ckpt), _read_rng(ckpt)

    def _selected(self, path: Optional[PathLike]) -> Path:
        found = self.select(path)
        for rejected in found.rejected:
            if co.rank() == 0:
                warnings.warn(f"skipping invalid checkpoint {rejected.path}: {rejected.reason}", stacklevel=3)
        if found.path is not None:
            return found.path
        where = self.root if path is None or str(path) in ("latest", "auto") else Path(path)
        if found.rejected:
            raise CheckpointCorruptError(no_valid_checkpoint_message(where, found.rejected))
        raise CheckpointNotFoundError(f"no checkpoint at {where}; {_NOT_FOUND_HINT}")

    # ------------------------------------------------------------------- rank-0 internals

    def _locate(self, path: Optional[PathLike]) -> tuple[str, Path]:
        """("root", dir) for a directory of checkpoints, ("checkpoint", dir) for one checkpoint."""
        if path is None or str(path) in ("latest", "auto"):
            return "root", self.root
        candidate = storage.check_path(path, "resume")
        if not candidate.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint at {candidate}; {_NOT_FOUND_HINT}")
        if ondisk.is_temp(candidate.name):
            raise CheckpointCorruptError(
                _corrupt_message(candidate, "it is the temp directory of an unfinished save")
            )
        looks_like_root = ondisk.parse_step(candidate.name) is None and not (candidate / ondisk.MARKER).exists()
        if looks_like_root and not (candidate / ondisk.DCP_METADATA).exists():
            if not ondisk.step_dirs(candidate):
                raise CheckpointNotFoundError(f"no checkpoint at {candidate}; {_NOT_FOUND_HINT}")
            return "root", candidate
        return "checkpoint", candidate

    def _check_manifest(self, ckpt: Path) -> tuple[dict[str, Any], bool]:
        """The manifest and whether the full check can be skipped; sizes checked."""
        with storage.reported(ckpt, f"read checkpoint {ckpt}"):
            manifest = ondisk.read_manifest(ckpt)
            ondisk.check_files(ckpt, manifest)
        if manifest.get("version") == 1:
            warnings.warn(
                f"checkpoint {ckpt} predates per-file checksums (manifest version 1): its tensor files are "
                "checked by size only; checkpoints saved from now on carry checksums of every file",
                stacklevel=4,
            )
        return manifest, self._checked.get(ckpt) == ondisk.encode_manifest(manifest)

    def _check_dcp_metadata(self, ckpt: Path, manifest: dict[str, Any]) -> None:
        _read_dcp_metadata(ckpt)
        self._checked[ckpt] = ondisk.encode_manifest(manifest)

    def _make_temp_dir(self, final_dir: Path, step: int) -> Path:
        with storage.reported(self.root, f"create a directory for checkpoint step {step}", _MOVE_HINT):
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_temp_entries()
            self._check_free_space(step)
            temp_dir = self.root / ondisk.temp_name(final_dir.name)
            (temp_dir / ondisk.RNG_DIR).mkdir(parents=True)
        return temp_dir

    def _check_free_space(self, step: int) -> None:
        """Refuse a save that cannot fit: it needs about as much as the last checkpoint took."""
        existing = self.checkpoints()
        if not existing:
            return
        last = existing[-1]
        try:
            size = sum(entry["size"] for entry in ondisk.read_manifest(last)["files"].values())
        except CheckpointCorruptError:
            return
        needed, free = int(size * (1 + SPACE_MARGIN)), storage.free_bytes(self.root)
        if free < needed:
            raise StorageError(
                errno.ENOSPC,
                f"not enough free space to save checkpoint step {step} in {self.root}: "
                f"{storage.human_bytes(free)} free, the last checkpoint ({last.name}) took "
                f"{storage.human_bytes(size)} and a save needs that much again (+{SPACE_MARGIN:.0%}); "
                f"free space there (see {self.root / ondisk.SET_ASIDE_DIR}) {_MOVE_HINT}. Nothing was "
                f"written; {last.name} is intact",
                str(self.root),
            )

    def _write_small_files(self, temp_dir: Path, files: dict[str, bytes], step: int) -> dict[str, dict[str, Any]]:
        """This rank's files besides the tensors, written durably; their digest entries."""
        written = {}
        with storage.reported(temp_dir, f"write checkpoint step {step}", _MOVE_HINT):
            for rel, data in files.items():
                ondisk.write_durably(temp_dir / rel, data)
                written[rel] = ondisk.digest_entry(len(data), ondisk.bytes_digest(data), co.rank())
        return written

    def _write_failed(self, err: BaseException, temp_dir: Path, step: int) -> BaseException:
        """What to raise for a tensor write that failed: a StorageError for a storage failure (the
        unfinished temp directory is removed, the previous checkpoint stays), else `err` itself."""
        cause = _os_error_in(err)
        if cause is None and storage.free_bytes(temp_dir) < _NEARLY_FULL:
            cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # torch's writer lost the errno
        if co.rank() == 0:
            shutil.rmtree(temp_dir, ignore_errors=True)
        if cause is None:
            return err
        previous = self.checkpoints()
        kept = f"; nothing was published, {previous[-1].name} is intact" if previous else ""
        failure = storage.storage_error(cause, self.root, f"write checkpoint step {step}", _MOVE_HINT)
        return StorageError(failure.errno, f"{failure}{kept}", failure.filename)

    def _publish(self, temp_dir: Path, final_dir: Path, step: int) -> Path:
        """Marker, rename, pointer, prune: the only steps that make a checkpoint visible."""
        with storage.reported(temp_dir, f"publish checkpoint step {step}", _MOVE_HINT):
            manifest = ondisk.build_manifest(temp_dir, step, co.world_size())
            ondisk.write_marker(temp_dir, manifest)
            if final_dir.exists():  # the same step saved again (e.g. after resuming from an earlier one)
                ondisk.remove_tree(final_dir)
            os.replace(temp_dir, final_dir)
            ondisk.fsync_dir(self.root)
            ondisk.write_pointer(self.root, final_dir)
            self._checked[final_dir] = ondisk.encode_manifest(manifest)  # hashed as written
            self._prune(newest=final_dir)
            self._remove_temp_entries()
        return final_dir

    def _prune(self, newest: Path) -> None:
        if self.keep_last is None:
            return
        older = [path for path in reversed(self.checkpoints()) if path != newest]
        for path in older[self.keep_last - 1 :]:
            ondisk.remove_tree(path)
            self._checked.pop(path, None)

    def _remove_temp_entries(self) -> None:
        """Leftovers of crashed saves; safe because no save of ours is in flight here."""
        for entry in ondisk.temp_entries(self.root):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _finish_async(self, pending: _PendingSave, future: Any, temp_dir: Path, step: int) -> None:
        try:
            try:
                future.result()  # DCP's last collective: every rank's files, digests and .metadata are written
            except (Exception, CheckpointException) as err:
                raise self._write_failed(err, temp_dir, step) from err
            if co.rank() == 0:
                self._publish(temp_dir, pending.final_dir, step)
        except BaseException as err:  # noqa: BLE001 - surfaced by wait()
            pending.error = err

    def _async_kwargs(self) -> dict[str, Any]:
        """DCP's async writer runs collectives from a background thread, so it gets its own
        gloo group: sharing one with the training loop would interleave collectives."""
        if not co.is_distributed():
            return {"no_dist": True}
        if self._async_group is None:
            self._async_group = co.new_gloo_group()
        return {"process_group": self._async_group}


def no_valid_checkpoint_message(where: Path, rejected: Iterable[Rejected]) -> str:
    """One line: every checkpoint under `where` that failed its check and why, and what to do."""
    listed = "; ".join(f"{r.path.name}: {r.reason}" for r in rejected)
    return (
        f"no valid checkpoint in {where}, nothing was changed there. Rejected: {listed}. Resume from a good "
        "copy with resume=PATH, start a new run in another run_dir=..., or start this one over with "
        f"resume=fresh (the rejected checkpoints are moved to {where / ondisk.SET_ASIDE_DIR}, not deleted)"
    )


# ------------------------------------------------------------------------------- helpers


def _dist_kwargs() -> dict[str, Any]:
    return {} if co.is_distributed() else {"no_dist": True}


def _as_module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"checkpoint 'model' must be the torch.nn.Module itself (plain or parallelised), got {type(model).__name__}"
        )
    return model


def _as_optimizers(optim: Optimizers) -> list[torch.optim.Optimizer]:
    if optim is None:
        return []
    optimizers = [optim] if isinstance(optim, torch.optim.Optimizer) else list(optim)
    for item in optimizers:
        if not isinstance(item, torch.optim.Optimizer):
            raise TypeError(
                f"checkpoint 'optim' must be an optimizer, a list of optimizers or None, got {type(item).__name__}"
            )
    return optimizers


def _state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, dict[str, Any]]:
    """Sharded, name-keyed state; note that DCP initialises an optimizer without state by
    a zero-lr step (so saving before the first step gives step counters of 1)."""
    if optimizers:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=STATE_DICT_OPTIONS)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model, options=STATE_DICT_OPTIONS)}


def _encode_trainer(trainer: Mapping[str, Any]) -> bytes:
    if not isinstance(trainer, Mapping):
        raise TypeError(f"checkpoint 'trainer' must be a dict, got {type(trainer).__name__}")
    try:
        return json.dumps(trainer, indent=1, sort_keys=True, allow_nan=True).encode()
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"checkpoint 'trainer' must be JSON-serialisable ({err}); store tensors in the model "
            "(buffers) and convert other values to numbers, strings, lists or dicts"
        ) from err


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _read_dcp_metadata(ckpt: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(ckpt).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure here means the file is unusable
        raise CheckpointCorruptError(
            f"DCP metadata {ckpt / ondisk.DCP_METADATA} is missing or unreadable ({err})"
        ) from err


def _check_digests(ckpt: Path, manifest: dict[str, Any], files: list[str]) -> None:
    with storage.reported(ckpt, f"read checkpoint {ckpt}"):
        ondisk.check_files(ckpt, manifest, files)


def _os_error_in(err: BaseException) -> Optional[OSError]:
    """The OSError behind a failed DCP call: DCP wraps each rank's exception in a CheckpointException."""
    found = storage.first_os_error(err)
    if found is None and isinstance(err, CheckpointException):
        for failure, _trace in err.failures.values():
            found = found or storage.first_os_error(failure)
    return found


def _read_trainer(ckpt: Path) -> dict[str, Any]:
    path = ckpt / ondisk.TRAINER_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_rng(ckpt: Path) -> Optional[RngState]:
    """This rank's RNG state, else rank 0's (a checkpoint from fewer ranks), else None."""
    saved_world = ondisk.read_manifest(ckpt).get("world_size")
    if saved_world != co.world_size() and co.rank() == 0:
        warnings.warn(
            f"checkpoint {ckpt} was written by {saved_world} ranks and is loaded by {co.world_size()}: "
            "each rank gets the RNG state of the same rank, or rank 0's if that rank did not exist; "
            "bitwise-exact resume is only promised for the same parallel layout",
            stacklevel=3,
        )
    own = ckpt / ondisk.rng_file(co.rank())
    fallback = ckpt / ondisk.rng_file(0)
    path = own if own.is_file() else fallback
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def _newest_valid(
    root: Path, below_step: Optional[int] = None, already_reported: Optional[Path] = None
) -> Optional[Path]:
    for step, path in reversed(ondisk.step_dirs(root)):
        if below_step is not None and step >= below_step:
            continue
        if ondisk.is_valid(path):
            return path
        if path == already_reported:
            continue
        warnings.warn(f"skipping invalid checkpoint {path} (no or mismatching {ondisk.MARKER} manifest)", stacklevel=3)
    return None


def _candidates(root: Path) -> list[Path]:
    """Where to look for the newest checkpoint under `root`, in order: the one `latest` names, then
    every step_* directory, newest first (a bad pointer is warned about and ignored)."""
    try:
        pointed = ondisk.read_pointer(root)
    except CheckpointCorruptError as err:
        warnings.warn(f"{err}; looking for the newest valid checkpoint instead", stacklevel=4)
        pointed = None
    found = [path for _, path in reversed(ondisk.step_dirs(root))]
    if pointed is not None and pointed not in found:
        warnings.warn(f"{root / ondisk.POINTER} names {pointed.name}, which does not exist; "
                      "looking for the newest valid checkpoint instead", stacklevel=4)
    return ([pointed] if pointed in found else []) + [path for path in found if path != pointed]


def _corrupt_message(ckpt: Path, problem: str) -> str:
    step = ondisk.parse_step(ckpt.name.split(ondisk.TEMP_TAG)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = _newest_valid(ckpt.parent, below_step=step) if step is not None else None
    if previous is not None:
        advice = f"load the previous checkpoint {previous} instead (resume=auto skips invalid checkpoints)"
    else:
        advice = f"no earlier valid checkpoint exists in {ckpt.parent}; start over with resume=fresh or another run_dir"
    return f"checkpoint {ckpt} is corrupt or incomplete: {problem}; {advice}"


def _named(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_NAMED])
    return shown + (f" (+{len(keys) - _MAX_NAMED} more)" if len(keys) > _MAX_NAMED else "")


def _leaves(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """The entries DCP stores for `value` under key `name`: nested dicts become dotted keys.

    A module's extra state may be a dict of tensors (e.g. `ExpertBalancer.get_extra_state`);
    DCP saves each of its tensors as `<name>.<key>`, so that is how it is matched on load.
    Tuples and lists of numbers (optimizer hyperparameters) stay one entry, as in DCP.
    """
    if isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _leaves(f"{name}.{key}", inner)
    else:
        yield name, value


def _flat_keys(state: dict[str, dict[str, Any]]) -> set[str]:
    return {flat for section, values in state.items() for flat, _ in _leaves(section, values)}


def _select_against_checkpoint(
    state: dict[str, dict[str, Any]], metadata: Metadata, ckpt: Path, wanted_anywhere: set[str]
) -> dict[str, Any]:
    """What to read from `ckpt` into `state`; CheckpointMismatchError if it does not fit.

    Model and optimizer-state keys must match exactly (names and global shapes); a key of
    the checkpoint is unexpected only if no rank wants it (`wanted_anywhere`).
    Optimizer hyperparameters missing from the checkpoint (e.g. a field added by a newer
    torch) keep their current values, so they are simply not read.
    """
    saved = metadata.state_dict_metadata
    if "optim" in state and not any(key.startswith("optim.") for key in saved):
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} holds no optimizer state; load it with optimizer=None "
            "(fresh optimizer state) or pick a checkpoint saved with its optimizer"
        )
    missing, unexpected, misshapen = [], [], []
    selected: dict[str, dict[str, Any]] = {}
    for section, values in state.items():
        selected[section] = {}
        for key, value in values.items():
            leaves = list(_leaves(f"{section}.{key}", value))
            absent = [flat for flat, _ in leaves if flat not in saved]
            if absent:
                missing += [flat for flat in absent if not flat.startswith(_PARAM_GROUPS)]
                continue
            for flat, leaf in leaves:
                stored = saved[flat]
                if isinstance(leaf, torch.Tensor):
                    if not isinstance(stored, TensorStorageMetadata):
                        misshapen.append(f"{flat} (tensor here, non-tensor in checkpoint)")
                    elif tuple(stored.size) != tuple(leaf.shape):
                        misshapen.append(f"{flat} {tuple(stored.size)} in checkpoint vs {tuple(leaf.shape)} here")
                elif isinstance(stored, TensorStorageMetadata):
                    misshapen.append(f"{flat} (non-tensor here, tensor in checkpoint)")
            selected[section][key] = value
        prefix = section + "."
        unexpected += [
            key
            for key in saved
            if key.startswith(prefix) and key not in wanted_anywhere and not key.startswith(_PARAM_GROUPS)
        ]
    if missing or unexpected or misshapen:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_named(missing)}")
        if unexpected:
            parts.append(f"unexpected in the checkpoint: {_named(unexpected)}")
        if misshapen:
            parts.append(f"shape mismatch: {_named(misshapen)}")
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} does not fit this model/optimizer: {'; '.join(parts)}. Load it into a model "
            "built from the same config (trainer.json keeps the run's config), or pass optimizer=None "
            "to restore only the model."
        )
    return selected


__all__ = ["CheckpointManager", "Rejected", "STATE_DICT_OPTIONS", "Selection", "no_valid_checkpoint_message"]
