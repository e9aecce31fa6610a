"""One clear line for storage that refuses a read or a write: disk full, permissions, a bad path.

Checkpoints and run records (train.log, metrics.jsonl, ...) live on filesystems that fail in a
handful of ways. Each is turned into a `StorageError` whose message names the path, the cause
and the fix, so that the CLI prints one line (exit code 2) instead of a traceback. A
StorageError is an OSError: its errno is the cause's, so callers can still test for ENOSPC.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, os.PathLike]

# errno -> (what happened, the generic fix); the caller adds the setting that moves the path.
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full (ENOSPC)", "free space there"),
    errno.EDQUOT: ("the disk quota is exhausted (EDQUOT)", "free space or raise the quota"),
    errno.EACCES: ("permission denied (EACCES)", "fix the permissions"),
    errno.EPERM: ("operation not permitted (EPERM)", "fix the permissions"),
    errno.EROFS: ("the filesystem is read-only (EROFS)", "use a writable filesystem"),
    errno.ENAMETOOLONG: ("the path is too long (ENAMETOOLONG)", "use a shorter path"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory (ENOTDIR)", "use a directory path"),
    errno.EEXIST: ("a file is in the way of a directory (EEXIST)", "use a directory path"),
    errno.EISDIR: ("a directory is in the way of a file (EISDIR)", "remove or rename it"),
    errno.EIO: ("the storage reported an I/O error (EIO)", "check the filesystem, then retry"),
    errno.EINVAL: ("the path is not valid here (EINVAL)", "use a plain path"),
}


RUN_DIR_FIX = "or set run_dir=... to a directory you can write"


class StorageError(OSError):
    """A filesystem refused a read or write; the message names the path, the cause and the fix."""

    def __str__(self) -> str:
        return str(self.strerror)


def storage_error(err: OSError, path: PathLike, doing: str, fix: str = "") -> StorageError:
    """The StorageError for `err`, raised while `doing` (e.g. "write checkpoint step 4") at `path`.

    `fix` names the setting that moves the path elsewhere (e.g. "or set run_dir=... elsewhere").
    """
    if isinstance(err, StorageError):
        return err
    cause, generic = _CAUSES.get(err.errno or 0, (err.strerror or str(err), "check the path"))
    where = err.filename if err.filename is not None else path
    message = f"cannot {doing}: {cause} at {where}; {generic}{' ' + fix if fix else ''}"
    return StorageError(err.errno, message, str(where))


def check_path(path: PathLike, setting: str) -> Path:
    """`path` as a Path; a StorageError now (not a ValueError deep inside open) for one no filesystem
    can hold, such as one with a NUL byte. `setting` names what sets the path (e.g. "run_dir")."""
    text = os.fspath(path)
    if "\0" in text:
        shown = text.replace("\0", "\\0")
        raise StorageError(errno.EINVAL, f"{setting}: {shown} contains a NUL byte, which no path can hold; "
                           "use a plain path", shown)
    return Path(path)


@contextmanager
def reported(path: PathLike, doing: str, fix: str = "") -> Iterator[None]:
    """Turn an OSError raised inside the block into a StorageError (see `storage_error`)."""
    try:
        yield
    except OSError as err:
        raise storage_error(err, path, doing, fix) from err


def free_bytes(path: PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) `path`."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def first_os_error(err: Optional[BaseException]) -> Optional[OSError]:
    """The first OSError in `err`'s chain of causes (what a wrapping library raised about), if any."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
