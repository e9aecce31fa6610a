"""The on-disk layout of a checkpoint root, and the integrity rules that make saves atomic and loads safe.

    root/
      step_00000123/            a complete checkpoint (never written in place)
        .metadata, *.distcp     torch.distributed.checkpoint files (model + optimizer)
        trainer.json            the trainer's JSON state (step, stage, data position, ...)
        rng/rank_{r}.pt         per-rank RNG states
        COMPLETE                manifest: every file's size and sha256 (and the rank that wrote
                                it), plus the sha256 of the manifest itself
      step_00000124.tmp-3f2a…   a save in progress (or left by a crash): never loaded
      latest                    text file naming the newest complete directory
      set-aside/<time>-<why>/   checkpoints a restart moved out of the way (never deleted)

A directory only gets its final `step_*` name after its COMPLETE marker is on disk,
and `latest` is replaced (os.replace) only after that rename, so a crash at any moment
leaves the previous complete checkpoint intact and findable.

Each rank hashes the files it wrote right after writing them and leaves the digests in
`digests/rank_{r}.json` of the temp directory; rank 0 merges them into COMPLETE. A check
reads the manifest (which must hash to its own recorded sha256, byte for byte) and then
any subset of the files: `verify` the small ones (cheap, for discovery), `owned_by` one
rank's share of all of them (the full check before a load, spread over the ranks).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from .errors import CheckpointCorruptError

MARKER = "COMPLETE"
POINTER = "latest"
TRAINER_FILE = "trainer.json"
RNG_DIR = "rng"
DIGESTS_DIR = "digests"
SET_ASIDE_DIR = "set-aside"
DCP_METADATA = ".metadata"
TEMP_TAG = ".tmp-"
FORMAT = "moe-lc-checkpoint"
# 1: sizes of all files, sha256 of the small files only (tensor files checked by size)
# 2: sha256 of every file, by the rank that wrote it; the manifest's own sha256 in MANIFEST_DIGEST
FORMAT_VERSION = 2
HASH = "sha256"
MANIFEST_DIGEST = "manifest_sha256"

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_DATA_SUFFIX = ".distcp"  # the large tensor files
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


# ------------------------------------------------------------------------------ digests


def bytes_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks (hashlib releases the GIL: a background
    thread hashing does not stall the training loop)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_entry(size: int, digest: str, rank: int) -> dict[str, Any]:
    return {"size": size, HASH: digest, "rank": rank}


def write_rank_digests(ckpt_dir: Path, rank: int, entries: dict[str, dict[str, Any]]) -> None:
    """Leave this rank's digests of the files it wrote for rank 0 to merge into the manifest."""
    write_durably(ckpt_dir / DIGESTS_DIR / f"rank_{rank}.json", json.dumps(entries, sort_keys=True).encode())


def _rank_digests(ckpt_dir: Path) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    folder = ckpt_dir / DIGESTS_DIR
    for path in sorted(folder.glob("rank_*.json")) if folder.is_dir() else []:
        merged.update(json.loads(path.read_text()))
    return merged


# ------------------------------------------------------------------------------ manifest


def build_manifest(ckpt_dir: Path, step: int, world_size: int) -> dict[str, Any]:
    """Describe every file under `ckpt_dir` (size, sha256, writer rank) from the ranks' digests.

    A file no rank reported (the DCP `.metadata`, written by the coordinator after the other
    files) is hashed here, by rank 0.
    """
    reported = _rank_digests(ckpt_dir)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(ckpt_dir).as_posix()
        if rel == MARKER or rel.startswith(DIGESTS_DIR + "/") or is_temp(path.name):
            continue
        size = path.stat().st_size
        entry = reported.get(rel) or digest_entry(size, file_digest(path), 0)
        if entry["size"] != size:
            raise CheckpointCorruptError(
                f"file {path} changed after rank {entry['rank']} hashed it ({entry['size']} -> {size} bytes)"
            )
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


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The COMPLETE file's bytes: readable JSON that carries the sha256 of its own content, so
    that any change to it (a digit, a key, even whitespace) is detected."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    body[MANIFEST_DIGEST] = bytes_digest(_canonical(body))
    return _canonical(body)


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"


def write_marker(ckpt_dir: Path, manifest: dict[str, Any]) -> None:
    write_durably(ckpt_dir / MARKER, encode_manifest(manifest))
    shutil.rmtree(ckpt_dir / DIGESTS_DIR, ignore_errors=True)  # merged into the manifest


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The COMPLETE marker's manifest; CheckpointCorruptError if absent, unreadable or altered.

    Version-1 manifests (written before every file was hashed) carry no checksum of their own
    and are read as they are.
    """
    marker = ckpt_dir / MARKER
    if not marker.is_file():
        raise CheckpointCorruptError(
            f"{ckpt_dir} has no {MARKER} marker: the save was interrupted before it finished"
        )
    raw = marker.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as err:  # also bytes that are not UTF-8
        raise CheckpointCorruptError(f"{marker} is unreadable ({err})") from err
    if (
        not isinstance(manifest, dict) or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointCorruptError(f"{marker} is not a {FORMAT} manifest")
    if manifest.get("version") == 1 and MANIFEST_DIGEST not in manifest:
        return manifest
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{marker} has manifest version {manifest.get('version')!r}; "
            f"this moe-lc reads versions 1 and {FORMAT_VERSION}"
        )
    if raw != encode_manifest(manifest):
        raise CheckpointCorruptError(f"{marker} does not match its own checksum: it was altered after it was written")
    return manifest


def small_files(manifest: dict[str, Any]) -> list[str]:
    """Every file but the tensor data: cheap to hash, enough to tell a complete save from a broken one."""
    return [rel for rel in manifest["files"] if not rel.endswith(_DATA_SUFFIX)]


def owned_by(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """Rank `rank`'s share of a full check: the files written by the same rank (under an unchanged
    layout, the ones it reads), the files of ranks that no longer exist dealt round-robin."""
    return [rel for rel, entry in manifest["files"].items() if int(entry.get("rank", 0)) % world_size == rank]


def hashed_bytes(manifest: dict[str, Any], files: Iterable[str]) -> int:
    return sum(manifest["files"][rel]["size"] for rel in files if HASH in manifest["files"][rel])


def check_files(ckpt_dir: Path, manifest: dict[str, Any], hashed: Iterable[str] = ()) -> None:
    """Every listed file present with its recorded size; the files `hashed` (of those that have
    a recorded digest: version-1 tensor files have none) with their recorded sha256."""
    for rel, entry in manifest["files"].items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointCorruptError(f"file {path} listed in {ckpt_dir / MARKER} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointCorruptError(
                f"file {path} has {size} bytes but the manifest records {entry['size']} (truncated or overwritten)"
            )
    for rel in hashed:
        expected = manifest["files"][rel].get(HASH)
        if expected is not None and file_digest(ckpt_dir / rel) != expected:
            raise CheckpointCorruptError(f"file {ckpt_dir / rel} does not match its checksum in {ckpt_dir / MARKER}")


def verify(ckpt_dir: Path, check_hashes: bool = True) -> dict[str, Any]:
    """The cheap check: the manifest, every file's size and the small files' checksums; returns
    the manifest or raises CheckpointCorruptError. The tensor files' checksums are checked
    before a load (`CheckpointManager.verify`), spread over the ranks."""
    manifest = read_manifest(ckpt_dir)
    check_files(ckpt_dir, manifest, small_files(manifest) if check_hashes else ())
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
    """The directory named by `root/latest`; None if there is no pointer file.

    CheckpointCorruptError for a pointer file that names no checkpoint directory (bytes that
    are not UTF-8, another name, unreadable): the caller falls back to scanning.
    """
    pointer = root / POINTER
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"{pointer} is unreadable ({err})") from err
    if parse_step(name) is None:
        raise CheckpointCorruptError(f"{pointer} holds {name[:40]!r}, which is not a step_XXXXXXXX directory name")
    return root / name


def write_pointer(root: Path, ckpt_dir: Path) -> None:
    write_durably(root / POINTER, (ckpt_dir.name + "\n").encode())


def set_aside(root: Path, entries: Iterable[Path], why: str) -> Path:
    """Move checkpoint directories (and files such as `latest`) of `root` into a new
    `root/set-aside/<UTC time>-<why>/`, keeping their names; returns that folder. Nothing is
    deleted: a restart that must not build on them keeps them for inspection."""
    base = root / SET_ASIDE_DIR / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{why}"
    dest, n = base, 1
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}-{n}")
    dest.mkdir(parents=True)
    for entry in entries:
        os.replace(entry, dest / entry.name)
    fsync_dir(dest)
    fsync_dir(root)
    return dest
