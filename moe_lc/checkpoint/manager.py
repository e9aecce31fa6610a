"""CheckpointManager: atomic, layout-independent training checkpoints on torch.distributed.checkpoint.

A save writes model + optimizer tensors with DCP (each rank writes its own shards;
`get_state_dict` turns FSDP2/TP DTensor parameters into sharded state that DCP can
re-shard on load; a module's extra state that is a dict of tensors is stored one entry
per tensor), the trainer's JSON dict (rank 0) and every rank's RNG state into a
temp directory; after all ranks are done, rank 0 writes the COMPLETE manifest, renames
the directory to `step_XXXXXXXX`, points `latest` at it and prunes old checkpoints.
See `ondisk.py` for the layout and why a crash at any moment is harmless.

Every public method that touches tensors (`save`, `load`, `wait`, `close`) is
collective when torch.distributed is initialised: all ranks call it, in the same order.
The checkpoint root must be on a filesystem that all ranks share.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from . import coordination as co
from . import ondisk
from .errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from .rng import RngState, capture_rng

PathLike = Union[str, os.PathLike]
Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]

# Sharded (not gathered) state, and optimizer state keyed by parameter name
# ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"), so that neither the parallel
# layout nor the grouping of parameters into optimizer groups is baked into the files.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

_STATE_KEYS = {"model", "optim", "trainer", "rng"}

# DCP warns on every single-process save/load, even when asked for one explicitly (no_dist).
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
_PARAM_GROUPS = "optim.param_groups."
_NOT_FOUND_HINT = "use resume=none or point to a dir containing step_* checkpoints"
_MAX_NAMED = 5


@dataclass
class _PendingSave:
    """An async save whose tensors are still being written by DCP's background thread."""

    final_dir: Path
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None


class CheckpointManager:
    """Saves and restores training state under `root`; see the module docstring.

    keep_last: how many complete checkpoints to keep (the newest is never pruned);
        None keeps all.
    async_save: write tensors in the background with `dcp.async_save`: `save` returns
        once the state is staged in CPU memory, and the checkpoint is published
        (marker, rename, `latest`) once its files are durable. A pending save is
        finished before the next save, before a load and in `close()`.
    """

    def __init__(self, root: PathLike, keep_last: Optional[int] = 3, async_save: bool = False) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep all), got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self._coordinator = co.Coordinator()
        self._async_group: Optional[Any] = None
        self._pending: Optional[_PendingSave] = None

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Checkpoint `state` as step `step`; returns the final `root/step_XXXXXXXX` path.

        state["model"]: the nn.Module (plain, FSDP2- or TP-parallelised); required.
        state["optim"]: an optimizer, a list of optimizers, or None.
        state["trainer"]: a JSON-serialisable dict (step, stage, data position, ...).
        state["rng"]: this rank's RNG state; omitted = `capture_rng()` now; None = not saved.
        With async_save the returned path appears once the background write is durable.
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
        temp_dir = self._coordinator.rank0_decides(lambda: self._make_temp_dir(final_dir))
        if rng is not None:
            ondisk.write_durably(temp_dir / ondisk.rng_file(co.rank()), _torch_bytes(rng))
        if co.rank() == 0:
            ondisk.write_durably(temp_dir / ondisk.TRAINER_FILE, trainer_json)
        writer = dcp.FileSystemWriter(temp_dir, sync_files=True)

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

        dcp.save(tensors, storage_writer=writer, **_dist_kwargs())
        self._coordinator.barrier()  # every rank's shards and RNG file are on disk
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
        """The newest complete, verified checkpoint: where `latest` points, else found by scanning."""
        pointed = ondisk.read_pointer(self.root)
        if pointed is not None:
            if ondisk.is_valid(pointed):
                return pointed
            warnings.warn(
                f"{self.root / ondisk.POINTER} names {pointed.name}, which is missing or invalid; "
                "using the newest complete checkpoint instead",
                stacklevel=2,
            )
        return _newest_valid(self.root, already_reported=pointed)

    def resolve(self, path: Optional[PathLike] = None) -> Path:
        """The verified checkpoint directory meant by `path`.

        None, "latest" or "auto": `latest()` under this manager's root. A directory
        holding step_* checkpoints: the newest valid one in it. Else a checkpoint dir.
        """
        if path is None or str(path) in ("latest", "auto"):
            found = self.latest()
            if found is None:
                raise CheckpointNotFoundError(f"no checkpoint at {self.root}; {_NOT_FOUND_HINT}")
            return found
        candidate = Path(path)
        if not candidate.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint at {candidate}; {_NOT_FOUND_HINT}")
        if ondisk.is_temp(candidate.name):
            raise CheckpointCorruptError(
                _corrupt_message(candidate, "it is the temp directory of an unfinished save")
            )
        looks_like_root = ondisk.parse_step(candidate.name) is None and not (candidate / ondisk.MARKER).exists()
        if looks_like_root and not (candidate / ondisk.DCP_METADATA).exists():
            found = _latest_under(candidate)
            if found is None:
                raise CheckpointNotFoundError(f"no checkpoint at {candidate}; {_NOT_FOUND_HINT}")
            return found
        try:
            ondisk.verify(candidate)
            _read_dcp_metadata(candidate)
        except CheckpointCorruptError as err:
            raise CheckpointCorruptError(_corrupt_message(candidate, str(err))) from err
        return candidate

    # ------------------------------------------------------------------------------ load

    def load(
        self,
        path: Optional[PathLike],
        model: nn.Module,
        optimizer: Optimizers = None,
    ) -> tuple[dict[str, Any], Optional[RngState]]:
        """Restore `model` (and `optimizer`) in place from a checkpoint; return (trainer dict, rng).

        `path`: see `resolve` (None / "latest" = newest complete checkpoint under root).
        Tensors are re-sharded to the current parallel layout. The RNG state is this
        rank's; if the checkpoint was written by fewer ranks, rank 0's state is returned
        instead (exact resume is only promised for the same layout). Restore it with
        `restore_rng`. With optimizer=None only the model is restored.
        """
        module = _as_module(model)
        optimizers = _as_optimizers(optimizer)
        self.wait()
        ckpt = self._coordinator.rank0_decides(lambda: self.resolve(path))
        metadata = _read_dcp_metadata(ckpt)
        state = _state_dicts(module, optimizers)
        # A sharded optimizer (ZeRO-1) holds only this rank's share of the state: a key is
        # unexpected only if no rank wants it.
        wanted_anywhere = self._coordinator.union(_flat_keys(state))
        to_read = self._coordinator.every_rank_runs(
            lambda: _select_against_checkpoint(state, metadata, ckpt, wanted_anywhere)
        )
        dcp.load(to_read, storage_reader=dcp.FileSystemReader(ckpt), **_dist_kwargs())
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

    # ------------------------------------------------------------------- rank-0 internals

    def _make_temp_dir(self, final_dir: Path) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_temp_entries()
        temp_dir = self.root / ondisk.temp_name(final_dir.name)
        (temp_dir / ondisk.RNG_DIR).mkdir(parents=True)
        return temp_dir

    def _publish(self, temp_dir: Path, final_dir: Path, step: int) -> Path:
        """Marker, rename, pointer, prune: the only steps that make a checkpoint visible."""
        manifest = ondisk.build_manifest(temp_dir, step, co.world_size())
        ondisk.write_marker(temp_dir, manifest)
        if final_dir.exists():  # the same step saved again (e.g. after resuming from an earlier one)
            ondisk.remove_tree(final_dir)
        os.replace(temp_dir, final_dir)
        ondisk.fsync_dir(self.root)
        ondisk.write_pointer(self.root, final_dir)
        self._prune(newest=final_dir)
        self._remove_temp_entries()
        return final_dir

    def _prune(self, newest: Path) -> None:
        if self.keep_last is None:
            return
        older = [path for path in reversed(self.checkpoints()) if path != newest]
        for path in older[self.keep_last - 1 :]:
            ondisk.remove_tree(path)

    def _remove_temp_entries(self) -> None:
        """Leftovers of crashed saves; safe because no save of ours is in flight here."""
        for entry in ondisk.temp_entries(self.root):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _finish_async(self, pending: _PendingSave, future: Any, temp_dir: Path, step: int) -> None:
        try:
            future.result()  # DCP's last collective: every rank's files and .metadata are written
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
            _corrupt_message(ckpt, f"DCP metadata {ckpt / ondisk.DCP_METADATA} is missing or unreadable ({err})")
        ) from err


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


def _latest_under(root: Path) -> Optional[Path]:
    pointed = ondisk.read_pointer(root)
    if pointed is not None and ondisk.is_valid(pointed):
        return pointed
    return _newest_valid(root)


def _corrupt_message(ckpt: Path, problem: str) -> str:
    step = ondisk.parse_step(ckpt.name.split(ondisk.TEMP_TAG)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = _newest_valid(ckpt.parent, below_step=step) if step is not None else None
    if previous is not None:
        advice = f"load the previous checkpoint {previous} instead (resume=auto skips invalid checkpoints)"
    else:
        advice = f"no earlier valid checkpoint exists in {ckpt.parent}; start fresh with resume=none"
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


__all__ = ["CheckpointManager", "STATE_DICT_OPTIONS"]
