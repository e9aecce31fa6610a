"""Storage that refuses: a full disk (before and during a save, while logging), missing
permissions, paths no filesystem can hold and a `latest` pointer of garbage bytes each give
one line naming the path and the fix, and the previous checkpoint stays loadable.

The failures are injected (the tests run as root, whom chmod does not stop): `shutil.disk_usage`,
the streams DCP writes through, `Path.mkdir` and `open`.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from test_train_errors import ONE_STEP  # a two-step run of the smoke recipe
from torch import nn

from moe_lc.checkpoint import CheckpointCorruptError, CheckpointManager, ondisk
from moe_lc.storage import StorageError
from moe_lc.train.main import run_train_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*uninitialized:UserWarning")

Usage = namedtuple("Usage", "total used free")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(64, 64)


def _one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message, message
    return message


def _first_checkpoint(root: Path) -> tuple[CheckpointManager, nn.Module]:
    manager = CheckpointManager(root, keep_last=None)
    model = _model(1)
    manager.save(1, {"model": model, "trainer": {"step": 1}})
    return manager, model


def _assert_step1_intact(root: Path, model: nn.Module) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # no temp dir left
    loaded = _model(9)
    assert CheckpointManager(root).load("latest", loaded)[0] == {"step": 1}
    assert torch.equal(loaded.weight, model.weight)


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, (1 << 40) - free, free))


class _FullDisk(io.FileIO):
    """A file that takes `budget` bytes, then fails like a full disk (with or without its errno)."""

    budget = 2000
    lost_errno = False

    def write(self, data) -> int:
        if self.tell() + memoryview(data).nbytes > self.budget:
            if self.lost_errno:  # what torch's zip writer reports when it swallowed the OSError
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


@contextlib.contextmanager
def _full_disk_stream(self, path, mode):
    with _FullDisk(path, mode) as stream:
        yield stream


# ------------------------------------------------------------------------------ saving


@pytest.mark.timeout(60)
def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    manager, model = _first_checkpoint(tmp_path)
    size = sum(p.stat().st_size for p in (tmp_path / "step_00000001").rglob("*") if p.is_file())
    _free(monkeypatch, size)  # the last checkpoint's size is not enough: a save needs 10% more
    with pytest.raises(StorageError) as err:
        manager.save(2, {"model": _model(2)})
    message = _one_line(str(err.value))
    assert err.value.errno == errno.ENOSPC
    assert f"not enough free space to save checkpoint step 2 in {tmp_path}" in message
    assert "checkpoint.dir" in message and "step_00000001 is intact" in message
    _assert_step1_intact(tmp_path, model)
    _free(monkeypatch, 2 * size)
    assert manager.save(2, {"model": _model(2)}) == tmp_path / "step_00000002"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("lost_errno", [False, True])
def test_disk_full_while_writing_tensors_is_one_line_and_keeps_the_old_checkpoint(
    tmp_path, monkeypatch, async_save, lost_errno
):
    _, model = _first_checkpoint(tmp_path)
    manager = CheckpointManager(tmp_path, keep_last=None, async_save=async_save)
    monkeypatch.setattr(_FullDisk, "lost_errno", lost_errno)
    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", _full_disk_stream)
    if lost_errno:
        _free(monkeypatch, 1 << 20)  # the writer lost the errno; the disk is (nearly) full
    with pytest.raises(StorageError) as err:
        manager.save(2, {"model": _model(2)})
        manager.close()  # an async save reports its failure here
    message = _one_line(str(err.value))
    assert err.value.errno == errno.ENOSPC
    assert message.startswith(f"cannot write checkpoint step 2: the disk is full (ENOSPC) at {tmp_path}")
    assert "checkpoint.dir" in message and message.endswith("nothing was published, step_00000001 is intact")
    monkeypatch.undo()
    _assert_step1_intact(tmp_path, model)


@pytest.mark.timeout(60)
def test_a_write_failure_that_is_not_the_storage_is_not_disguised(tmp_path, monkeypatch):
    manager, _ = _first_checkpoint(tmp_path)
    monkeypatch.setattr(_FullDisk, "lost_errno", True)
    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", _full_disk_stream)
    _free(monkeypatch, 1 << 40)  # plenty of space: this is some other bug, shown as it is
    with pytest.raises(BaseException, match="unexpected pos") as err:
        manager.save(2, {"model": _model(2)})
    assert not isinstance(err.value, StorageError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_checkpoint_dir_that_cannot_be_created(tmp_path, monkeypatch, code):
    root = tmp_path / "ro" / "checkpoints"
    real_mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(code, "refused", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(StorageError) as err:
        CheckpointManager(root).save(1, {"model": _model(1)})
    message = _one_line(str(err.value))
    assert err.value.errno == code and str(root) in message and "checkpoint.dir" in message
    assert message.startswith("cannot create a directory for checkpoint step 1: ")


# ----------------------------------------------------------------------------- loading


@pytest.mark.timeout(60)
def test_an_unreadable_file_rejects_its_checkpoint(tmp_path, monkeypatch):
    manager, model = _first_checkpoint(tmp_path)
    newest = manager.save(2, {"model": _model(2), "trainer": {"step": 2}})
    (victim,) = newest.glob("*.distcp")
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if str(file) == str(victim):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    found = CheckpointManager(tmp_path).select("latest")
    assert found.path == tmp_path / "step_00000001"
    (rejected,) = found.rejected
    assert rejected.reason == (f"cannot read checkpoint {newest}: permission denied (EACCES) at {victim}; "
                               "fix the permissions")
    with pytest.raises(StorageError, match=f"permission denied .* at {victim}"):
        CheckpointManager(tmp_path).load(newest, _model(9))


@pytest.mark.timeout(60)
def test_a_latest_pointer_of_garbage_bytes_falls_back_to_scanning(tmp_path):
    manager, _ = _first_checkpoint(tmp_path)
    newest = manager.save(2, {"model": _model(2), "trainer": {"step": 2}})
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointCorruptError, match="latest is unreadable .*utf-8"):
        ondisk.read_pointer(tmp_path)
    with pytest.warns(UserWarning, match="latest is unreadable") as caught:
        assert CheckpointManager(tmp_path).latest() == newest
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with pytest.warns(UserWarning, match="latest is unreadable"):
        assert CheckpointManager(tmp_path).load("latest", _model(9))[0] == {"step": 2}
    manager.save(3, {"model": _model(3)})  # the next save rewrites the pointer
    assert (tmp_path / "latest").read_text() == "step_00000003\n"


# --------------------------------------------------------------------- the trainer CLI


def _cli_error(capsys, *args: str) -> str:
    assert run_train_cli([*ONE_STEP, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ")
    return _one_line(err)


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_run_dir_that_cannot_be_made_is_one_line(capsys, tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    real_mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if str(self).startswith(str(blocked)):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    err = _cli_error(capsys, f"run_dir={blocked}")
    assert err == (f"error: cannot create the run directory: permission denied (EACCES) at {blocked}; "
                   "fix the permissions or set run_dir=... to a directory you can write")
    monkeypatch.undo()
    (tmp_path / "a_file").write_text("")
    err = _cli_error(capsys, f"run_dir={tmp_path / 'a_file'}")
    assert f"a file is in the way of a directory (EEXIST) at {tmp_path / 'a_file'}" in err and "run_dir=" in err
    # (Hydra refuses a NUL byte in an override itself; the library says so for paths given in code)
    with pytest.raises(StorageError, match=r"nul\\0byte/checkpoints contains a NUL byte, which no path can hold"):
        CheckpointManager(f"{tmp_path}/nul\0byte/checkpoints")


@pytest.mark.usefixtures("shared_corpus_cache")
def test_disk_full_while_logging_stops_the_run_with_one_line(capsys, tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    real_open = builtins.open

    class FullAfterOneRecord(io.FileIO):
        def write(self, data) -> int:
            if self.tell() > 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    def opening(file, mode="r", *args, **kwargs):
        if str(file) == str(metrics):
            return FullAfterOneRecord(file, mode.replace("b", ""))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", opening)
    err = _cli_error(capsys, f"run_dir={tmp_path}")
    assert err == (f"error: cannot append to metrics.jsonl: the disk is full (ENOSPC) at {metrics}; free space "
                   "there or set run_dir=... to another directory")
    assert len(metrics.read_text().splitlines()) == 1  # step 1 logged; the run stopped at step 2
