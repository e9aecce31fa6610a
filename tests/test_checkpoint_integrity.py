"""Checkpoint integrity: every file's sha256 in a manifest that checks itself, computed by the
rank that wrote the file (in the background thread for an async save), checked before a load;
damage the size check cannot see is caught and the load falls back to the previous checkpoint.
The digests are compared with hashlib over the file bytes read here, not with the library's own."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from parallel_harness import run_distributed
from torch import nn

from moe_lc.checkpoint import CheckpointCorruptError, CheckpointManager, ondisk

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*uninitialized:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _save_two(root: Path, **kw) -> tuple[nn.Module, nn.Module]:
    """Checkpoints at steps 1 and 2 of different weights; returns those two models."""
    manager = CheckpointManager(root, keep_last=None, **kw)
    first, second = _model(1), _model(2)
    manager.save(1, {"model": first, "trainer": {"step": 1}})
    manager.save(2, {"model": second, "trainer": {"step": 2}})
    manager.close()
    return first, second


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _scale_tensor_in_place(ckpt: Path, tensor: torch.Tensor, factor: float) -> Path:
    """Overwrite the bytes of `tensor` inside the checkpoint's tensor file with `tensor * factor`:
    the file keeps its size, so only a checksum can tell."""
    (data_file,) = ckpt.glob("*.distcp")
    raw = data_file.read_bytes()
    needle = tensor.detach().contiguous().numpy().tobytes()
    assert raw.count(needle) == 1
    size = data_file.stat().st_size
    data_file.write_bytes(raw.replace(needle, (tensor.detach() * factor).contiguous().numpy().tobytes()))
    assert data_file.stat().st_size == size
    return data_file


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_save", [False, True])
def test_manifest_records_every_files_sha256(tmp_path, async_save):
    _save_two(tmp_path, async_save=async_save)
    ckpt = tmp_path / "step_00000002"
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE")
    assert sorted(manifest["files"]) == on_disk and any(rel.endswith(".distcp") for rel in on_disk)
    for rel, entry in manifest["files"].items():
        assert entry == {"size": (ckpt / rel).stat().st_size, "sha256": _sha256(ckpt / rel), "rank": 0}, rel
    assert manifest["version"] == 2 and not (ckpt / "digests").exists()


@pytest.mark.timeout(60)
def test_same_size_damage_in_a_tensor_file_is_caught_and_the_load_falls_back(tmp_path):
    first, second = _save_two(tmp_path)
    newest = tmp_path / "step_00000002"
    damaged = _scale_tensor_in_place(newest, second[0].weight, 1.5)
    assert ondisk.is_valid(newest)  # sizes and small files agree: the cheap check cannot see it

    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load(newest, _model(9))
    assert f"file {damaged} does not match its checksum" in str(err.value)
    assert "previous checkpoint" in str(err.value) and "step_00000001" in str(err.value)

    found = manager.select("latest")
    assert found.path == tmp_path / "step_00000001"
    assert [(r.path, r.reason) for r in found.rejected] == [
        (newest, f"file {damaged} does not match its checksum in {newest / 'COMPLETE'}")
    ]
    loaded = _model(9)
    with pytest.warns(UserWarning, match=f"skipping invalid checkpoint {newest}: file {damaged}"):
        trainer, _ = CheckpointManager(tmp_path).load("latest", loaded)
    assert trainer == {"step": 1} and _same_weights(loaded, first)


@pytest.mark.timeout(60)
def test_any_change_to_the_manifest_is_caught(tmp_path):
    _save_two(tmp_path)
    ckpt = tmp_path / "step_00000002"
    marker = ckpt / "COMPLETE"
    good = marker.read_bytes()
    for i in range(len(good)):
        for flip in (0x01, 0x20):  # a digit or letter changes; whitespace turns into other whitespace
            damaged = bytearray(good)
            damaged[i] ^= flip
            marker.write_bytes(bytes(damaged))
            with pytest.raises(CheckpointCorruptError, match="COMPLETE"):
                ondisk.read_manifest(ckpt)
    marker.write_bytes(good)
    assert ondisk.read_manifest(ckpt)["step"] == 2


@pytest.mark.timeout(60)
def test_a_checkpoint_is_hashed_once_per_launch(tmp_path, monkeypatch):
    _save_two(tmp_path)
    hashed: list[str] = []
    real = ondisk.file_digest
    monkeypatch.setattr(ondisk, "file_digest", lambda path: hashed.append(Path(path).name) or real(path))
    manager = CheckpointManager(tmp_path)
    manager.select("latest")
    listed = json.loads((tmp_path / "step_00000002/COMPLETE").read_text())["files"]
    assert sorted(hashed) == sorted(Path(rel).name for rel in listed)
    hashed.clear()
    manager.load("latest", _model(0))  # checked by select a moment ago: not hashed again
    manager.save(3, {"model": _model(3)})
    manager.load("latest", _model(0))  # written and hashed by this manager
    # only the save hashed: its tensor file as written, and .metadata (written last, by DCP) at publish
    assert hashed == ["__0_0.distcp", ".metadata"]


@pytest.mark.timeout(60)
def test_a_version_1_checkpoint_loads_with_its_tensor_files_checked_by_size(tmp_path):
    """Manifests written before every file was hashed: sizes for all files, sha256 of the small
    ones, no checksum of their own."""
    first, _ = _save_two(tmp_path)
    ckpt = tmp_path / "step_00000001"
    files = {}
    for rel, entry in json.loads((ckpt / "COMPLETE").read_text())["files"].items():
        files[rel] = {"size": entry["size"]} if rel.endswith(".distcp") else {k: entry[k] for k in ("size", "sha256")}
    legacy = {"format": "moe-lc-checkpoint", "version": 1, "step": 1, "world_size": 1, "files": files}
    (ckpt / "COMPLETE").write_text(json.dumps(legacy, indent=1, sort_keys=True))
    loaded = _model(9)
    with pytest.warns(UserWarning, match="predates per-file checksums"):
        CheckpointManager(tmp_path).load(ckpt, loaded)
    assert _same_weights(loaded, first)
    (ckpt / "trainer.json").write_text('{"step": 7}')  # its small files are still checked
    with pytest.raises(CheckpointCorruptError, match="trainer.json"):
        CheckpointManager(tmp_path).load(ckpt, _model(9))


# --------------------------------------------------------------------------- two ranks


def _fsdp_model(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _two_rank_saves_and_damaged_load(root: str) -> dict:
    """Save steps 1 (sync) and 2 (async) from 2 FSDP ranks, recording which thread hashed what;
    then damage a file rank 1 wrote and load the newest."""
    import torch.distributed as dist

    rank = dist.get_rank()
    hashed: list[tuple[str, str]] = []
    real = ondisk.file_digest

    def recording(path):
        hashed.append((threading.current_thread().name, Path(path).name))
        return real(path)

    ondisk.file_digest = recording
    for step, use_async in ((1, False), (2, True)):
        manager = CheckpointManager(Path(root), keep_last=None, async_save=use_async)
        manager.save(step, {"model": _fsdp_model(step)})
        manager.close()
    writes = list(hashed)
    hashed.clear()
    newest = Path(root) / "step_00000002"
    if rank == 1:
        (victim,) = newest.glob("__1_*.distcp")
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40  # same size
        victim.write_bytes(bytes(data))
    dist.barrier()
    found = CheckpointManager(Path(root)).select("latest")
    return {"writes": writes, "checks": list(hashed), "found": found.path,
            "rejected": [(r.path, r.reason) for r in found.rejected]}


@pytest.mark.timeout(120)
def test_each_rank_hashes_the_files_it_wrote_and_checks_its_share(tmp_path):
    ranks = run_distributed(_two_rank_saves_and_damaged_load, 2, str(tmp_path))
    main = threading.main_thread().name
    for rank, result in enumerate(ranks):
        own = f"__{rank}_0.distcp"
        # step 1 (sync): hashed in the main thread; step 2 (async): in DCP's writer thread
        assert [name for thread, name in result["writes"] if name == own and thread == main] == [own]
        assert [name for thread, name in result["writes"] if name == own and thread != main] == [own]
        assert {name for _, name in result["writes"]} <= {own, ".metadata"}
        # the full check: each rank hashed only the files its rank wrote (rank 0 also .metadata, trainer.json)
        mine = {own, f"rank_{rank}.pt"} | ({".metadata", "trainer.json"} if rank == 0 else set())
        assert {name for _, name in result["checks"]} == mine
        assert result["found"] == tmp_path / "step_00000001"
        (path, reason), = result["rejected"]
        assert path == tmp_path / "step_00000002" and "__1_0.distcp does not match its checksum" in reason
    manifest = json.loads((tmp_path / "step_00000001" / "COMPLETE").read_text())
    for rel, entry in manifest["files"].items():
        writer = 1 if rel in ("__1_0.distcp", "rng/rank_1.pt") else 0
        assert entry["rank"] == writer and entry["sha256"] == _sha256(tmp_path / "step_00000001" / rel), rel
