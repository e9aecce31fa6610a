"""The on-disk layout of a checkpoint root, and the integrity rules that make saves atomic.

    root/
      step_00000123/            a complete checkpoint (never written in place)
        .metadata, *.distcp     torch.distributed.checkpoint files (model + optimizer)
        trainer.json            the trainer's JSON state (step, stage, data position, ...)
        rng/rank_{r}.pt         per-rank RNG states
        COMPLETE                manifest: every file's size, sha256 of the small files
      step_00000124.tmp-3f2a…   a save in progress (or left by a crash): never loaded
      latest                    text file naming the newest complete directory

A directory only gets its final `step_*` name after its COMPLETE marker is on disk,
and `latest` is replaced (os.replace) only after that rename, so a crash at any moment
leaves the previous complete checkpoint intact and findable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

from .errors import CheckpointCorruptError

MARKER = "COMPLETE"
POINTER = "latest"
TRAINER_FILE = "trainer.json"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
TEMP_TAG = ".tmp-"
FORMAT = "moe-lc-checkpoint"
FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_DATA_SUFFIX = ".distcp"  # large tensor files: size checked, not hashed
_HASH_CHUNK = 1 << 20


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> Optional[int]:
    """The step of a complete-checkpoint directory name, None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank}.pt"


def temp_name(final_name: str) -> str:
    return f"{final_name}{TEMP_TAG}{uuid.uuid4().hex[:12]}"


def is_temp(name: str) -> bool:
    return TEMP_TAG in name


# ---------------------------------------------------------------------------- durability


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside `path` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` all-or-nothing: temp file, fsync, atomic replace, fsync dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temp_name(path.name))
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory without ever leaving a half-deleted `step_*` behind.

    It is first renamed to a temp name (atomic), so that a crash mid-delete leaves
    only a temp directory, which every reader ignores and the next save cleans.
    """
    doomed = path.with_name(temp_name(path.name) + "-deleted")
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


# ------------------------------------------------------------------------------ manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_hashed(rel: str) -> bool:
    return not rel.endswith(_DATA_SUFFIX)


def build_manifest(ckpt_dir: Path, step: int, world_size: int) -> dict[str, Any]:
    """Describe every file under `ckpt_dir`: size for all, sha256 for the small metadata files."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt_dir).as_posix()
        if rel == MARKER or is_temp(path.name):
            continue
        entry: dict[str, Any] = {"size": path.stat().st_size}
        if _is_hashed(rel):
            entry["sha256"] = _sha256(path)
        files[rel] = entry
    if DCP_METADATA not in files:
        raise CheckpointCorruptError(
            f"DCP metadata file {ckpt_dir / DCP_METADATA} was not written; the tensor save did not finish"
        )
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "files": files,
    }


def write_marker(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    write_durably(ckpt_dir / MARKER, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The COMPLETE marker's manifest; CheckpointCorruptError if absent or unreadable."""
    marker = ckpt_dir / MARKER
    if not marker.is_file():
        raise CheckpointCorruptError(
            f"{ckpt_dir} has no {MARKER} marker: the save was interrupted before it finished"
        )
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointCorruptError(f"{marker} is unreadable ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointCorruptError(f"{marker} is not a {FORMAT} manifest")
    return manifest


def verify(ckpt_dir: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Check `ckpt_dir` against its manifest; return the manifest or raise CheckpointCorruptError.

    Sizes catch truncated tensor files; checksums catch damaged metadata. Hashing
    reads only the small files, so this is cheap even for large checkpoints.
    """
    manifest = read_manifest(ckpt_dir)
    for rel, entry in manifest["files"].items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointCorruptError(f"file {path} listed in {ckpt_dir / MARKER} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointCorruptError(
                f"file {path} has {size} bytes but the manifest records {entry['size']} (truncated or overwritten)"
            )
        if check_hashes and "sha256" in entry and _sha256(path) != entry["sha256"]:
            raise CheckpointCorruptError(f"file {path} does not match its checksum in {ckpt_dir / MARKER}")
    return manifest


def is_valid(ckpt_dir: Path) -> bool:
    try:
        verify(ckpt_dir)
    except (CheckpointCorruptError, OSError):
        return False
    return True


# ------------------------------------------------------------------ discovery and pointer


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """All final-named `step_*` directories under `root` (complete or not), by ascending step."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def temp_entries(root: Path) -> list[Path]:
    """Leftovers of interrupted saves, pointer updates and deletions."""
    if not root.is_dir():
        return []
    return sorted(child for child in root.iterdir() if is_temp(child.name))


def read_pointer(root: Path) -> Optional[Path]:
    """The directory named by `root/latest`, or None if there is no readable pointer."""
    try:
        name = (root / POINTER).read_text().strip()
    except OSError:
        return None
    if parse_step(name) is None:
        return None
    return root / name


def write_pointer(root: Path, ckpt_dir: Path) -> None:
    write_durably(root / POINTER, (ckpt_dir.name + "\n").encode())

