"""Checkpoints: bitwise round trips, atomicity under SIGKILL, pruning, async save,
layout independence (FSDP2 on 2 gloo ranks <-> 1 process) and error messages."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from moe_lc.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    capture_rng,
    restore_rng,
)
from moe_lc.checkpoint import manager as manager_module
from moe_lc.checkpoint import ondisk
from moe_lc.model.balancing import ExpertBalancer

# DCP warns on every single-process save/load; the library filters it, pytest resets filters.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*uninitialized:UserWarning")

# fork is fast; once CUDA is usable here, a forked child must not touch it (DCP's writer
# would), so children are spawned instead. Children rebuild their state from seeds.
CTX = multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork")
FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


class TinyNet(nn.Module):
    """Odd sizes (uneven FSDP shards) and a buffer standing in for the QB bias."""

    def __init__(self, width: int = 6, extra_layer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.out = nn.Linear(width, 3)
        if extra_layer:
            self.extra = nn.Linear(3, 3)
        self.register_buffer("bias_state", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))) + self.bias_state


def make(seed: int, **kw) -> tuple[TinyNet, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = TinyNet(**kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 5, generator=data)
    loss = model(x).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.bias_state.add_(0.25)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Gathered model + optimizer state, keyed by name, detached copies on CPU."""
    model_sd, optim_sd = get_state_dict(model, opt, options=FULL)
    merged = {f"model.{k}": v for k, v in model_sd.items()}
    merged.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return {k: v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v for k, v in merged.items()}


def assert_bitwise(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, key
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def draws() -> tuple:
    return (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random())


# ----------------------------------------------------------------------------- round trip


@pytest.mark.timeout(60)
def test_round_trip_is_bitwise_for_model_optimizer_trainer_and_rng(tmp_path):
    model, opt = make(0)
    for s in range(3):
        train_step(model, opt, s)
    trainer = {"step": 3, "stage": 1, "consumed": [128, 40], "schedule": {"lr": 1e-3}, "name": "x"}
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    expected = full_state(model, opt)

    manager = CheckpointManager(tmp_path)
    path = manager.save(3, {"model": model, "optim": opt, "trainer": trainer})
    after_save = draws()
    train_step(model, opt, 99)
    continued = full_state(model, opt)

    fresh, fresh_opt = make(123)
    assert not torch.equal(fresh.inp.weight, model.inp.weight)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    loaded_trainer, rng = CheckpointManager(tmp_path).load(None, fresh, fresh_opt)

    assert path == tmp_path / "step_00000003" and path.is_dir()
    assert loaded_trainer == trainer
    assert_bitwise(full_state(fresh, fresh_opt), expected)
    restore_rng(rng)
    assert draws() == after_save
    # The restored optimizer continues exactly like the original (step counts, moments).
    train_step(fresh, fresh_opt, 99)
    assert_bitwise(full_state(fresh, fresh_opt), continued)


def test_rng_capture_restore_covers_torch_numpy_python():
    state = capture_rng()
    first = draws()
    restore_rng(state)
    assert draws() == first
    with pytest.raises(ValueError, match="capture_rng"):
        restore_rng({"torch": state["torch"]})


@pytest.mark.timeout(60)
def test_keep_last_prunes_oldest_and_latest_points_to_newest(tmp_path):
    model, opt = make(0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        train_step(model, opt, step)
        manager.save(step, {"model": model, "optim": opt, "trainer": {"step": step}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000040"
    assert manager.latest() == tmp_path / "step_00000040"
    assert manager.checkpoints() == [tmp_path / "step_00000030", tmp_path / "step_00000040"]

    # Saving a step again (resumed from an earlier checkpoint) replaces it; the newest is never pruned.
    manager.save(30, {"model": model, "optim": opt, "trainer": {"step": 30, "again": True}})
    assert manager.latest() == tmp_path / "step_00000030"
    assert manager.load(None, *make(1))[0] == {"step": 30, "again": True}
    assert [p.name for p in manager.checkpoints()] == ["step_00000030", "step_00000040"]

    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


@pytest.mark.timeout(60)
def test_latest_falls_back_when_pointer_is_stale(tmp_path):
    model, opt = make(0)
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        manager.save(step, {"model": model, "optim": opt})
    (tmp_path / "latest").write_text("step_00000099\n")  # points nowhere
    with pytest.warns(UserWarning, match="missing or invalid"):
        assert manager.latest() == tmp_path / "step_00000002"
    (tmp_path / "latest").write_text("step_00000002\n")
    (tmp_path / "step_00000002" / "COMPLETE").unlink()
    with pytest.warns(UserWarning, match="missing or invalid"):
        assert manager.latest() == tmp_path / "step_00000001"
    (tmp_path / "latest").unlink()
    with pytest.warns(UserWarning, match="skipping invalid checkpoint"):
        assert manager.latest() == tmp_path / "step_00000001"


# ------------------------------------------------------------------------- crash safety


def _block(reached, *_args, **_kwargs):
    reached.set()
    time.sleep(120)


def _install_crash_point(phase: str, reached) -> None:
    """Make the save stop (for SIGKILL) at one phase; runs in the forked child only."""
    if phase == "mid_tensor_write":

        class HalfWrittenDCP:
            FileSystemWriter = manager_module.dcp.FileSystemWriter

            @staticmethod
            def save(state, storage_writer, **kwargs):
                (Path(str(storage_writer.path)) / "__0_0.distcp").write_bytes(b"\0" * 100)
                _block(reached)

        manager_module.dcp = HalfWrittenDCP
    elif phase == "before_marker":
        ondisk.build_manifest = lambda *a, **k: _block(reached)
    elif phase == "torn_marker":

        def torn(ckpt_dir, manifest):
            (ckpt_dir / ondisk.MARKER).write_text(json.dumps(manifest)[:40])
            _block(reached)

        ondisk.write_marker = torn
    elif phase == "before_pointer":
        ondisk.write_pointer = lambda *a, **k: _block(reached)
    elif phase == "mid_prune":
        real_rmtree = ondisk.shutil.rmtree

        def partial_rmtree(path, *a, **k):
            if "-deleted" in str(path):
                next(p for p in Path(path).rglob("*.distcp")).unlink()
                _block(reached)
            real_rmtree(path, *a, **k)

        ondisk.shutil.rmtree = partial_rmtree  # the shutil module itself: this child only


def _state_at(step: int) -> tuple[TinyNet, torch.optim.AdamW]:
    model, opt = make(0)
    for s in range(step):
        train_step(model, opt, s)
    return model, opt


def _save_and_hang(root, phase, reached):
    torch.set_num_threads(1)
    _install_crash_point(phase, reached)
    model, opt = _state_at(2)
    CheckpointManager(root, keep_last=1).save(2, {"model": model, "optim": opt, "trainer": {"step": 2}})
    os._exit(3)  # the crash point was never reached


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "phase", ["mid_tensor_write", "before_marker", "torn_marker", "before_pointer", "mid_prune"]
)
def test_sigkill_mid_save_leaves_a_complete_latest(tmp_path, phase):
    model, opt = _state_at(1)
    CheckpointManager(tmp_path, keep_last=1).save(1, {"model": model, "optim": opt, "trainer": {"step": 1}})
    at_step1 = full_state(model, opt)
    at_step2 = full_state(*_state_at(2))  # what the child saves as step 2

    reached = CTX.Event()
    child = CTX.Process(target=_save_and_hang, args=(tmp_path, phase, reached))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not reached.wait(0.1) and child.is_alive() and time.monotonic() < deadline:
            pass
        assert reached.is_set(), f"crash point {phase} not reached (exit code {child.exitcode})"
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()

    # Only the prune (after the pointer moved) can leave step 2 as latest; before that, step 1.
    published = phase == "mid_prune"
    manager = CheckpointManager(tmp_path, keep_last=1)
    latest = manager.latest()
    assert latest == tmp_path / ("step_00000002" if published else "step_00000001")
    if phase != "before_pointer":  # killed before the pointer's temp file existed
        assert ondisk.temp_entries(tmp_path), "the interrupted save should have left a temp entry behind"
    fresh, fresh_opt = make(7)
    trainer, _ = manager.load("latest", fresh, fresh_opt)
    assert trainer == {"step": 2 if published else 1}
    assert_bitwise(full_state(fresh, fresh_opt), at_step2 if published else at_step1)

    # The next save cleans the leftovers and prunes to keep_last.
    manager.save(3, {"model": fresh, "optim": fresh_opt})
    assert ondisk.temp_entries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003"]


# ------------------------------------------------------------------------- error messages


@pytest.mark.timeout(60)
def test_missing_checkpoint_errors_name_the_path_and_the_fix(tmp_path):
    model, opt = make(0)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*nowhere.*resume=none"):
        CheckpointManager(tmp_path).load(tmp_path / "nowhere", model, opt)
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at {tmp_path}"):
        CheckpointManager(tmp_path).load(None, model, opt)
    # A directory holding step_* checkpoints resolves to its newest one.
    CheckpointManager(tmp_path / "run").save(5, {"model": model, "optim": opt, "trainer": {"step": 5}})
    assert CheckpointManager(tmp_path / "other").load(tmp_path / "run", model, opt)[0] == {"step": 5}


def _two_checkpoints(root: Path) -> Path:
    model, opt = make(0)
    manager = CheckpointManager(root, keep_last=None)
    manager.save(1, {"model": model, "optim": opt, "trainer": {"step": 1}})
    train_step(model, opt, 1)
    return manager.save(2, {"model": model, "optim": opt, "trainer": {"step": 2}})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncate_tensors", "flip_metadata_byte", "remove_marker", "remove_metadata"])
def test_corrupt_checkpoint_is_detected_and_the_previous_one_suggested(tmp_path, damage):
    newest = _two_checkpoints(tmp_path)
    target = {
        "truncate_tensors": "__0_0.distcp",
        "flip_metadata_byte": ".metadata",
        "remove_marker": "COMPLETE",
        "remove_metadata": ".metadata",
    }[damage]
    path = newest / target
    if damage == "truncate_tensors":
        os.truncate(path, path.stat().st_size // 2)
    elif damage == "flip_metadata_byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()

    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        manager.load(newest, *make(1))
    message = str(err.value)
    assert target in message and str(newest) in message
    assert "previous checkpoint" in message and "step_00000001" in message
    with pytest.warns(UserWarning):
        trainer, _ = manager.load("latest", *make(1))
    assert trainer == {"step": 1}


@pytest.mark.timeout(60)
def test_unreadable_dcp_metadata_with_consistent_manifest_is_reported(tmp_path):
    newest = _two_checkpoints(tmp_path)
    (newest / ".metadata").write_bytes(b"not a pickle")
    ondisk.write_marker(newest, ondisk.build_manifest(newest, 2, 1))  # manifest agrees with the damage
    with pytest.raises(CheckpointCorruptError, match=r"DCP metadata .*\.metadata is missing or unreadable"):
        CheckpointManager(tmp_path).load(newest, *make(1))


@pytest.mark.timeout(60)
def test_model_or_optimizer_mismatch_names_the_keys(tmp_path):
    model, opt = make(0)
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, {"model": model, "optim": opt})
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: model\.extra\.bias"):
        manager.load(path, *make(0, extra_layer=True))
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch: .*model\.inp\.weight \(6, 5\) in checkpoint vs \(4, 5\)"):
        manager.load(path, *make(0, width=4))
    # Model-only checkpoint loaded with an optimizer: say so; without an optimizer it works.
    model_only = manager.save(2, {"model": model})
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state; load it with optimizer=None"):
        manager.load(model_only, *make(0))
    fresh, _ = make(3)
    manager.load(path, fresh)
    assert torch.equal(fresh.inp.weight, model.inp.weight)
    with pytest.raises(ValueError, match="unknown"):
        manager.save(3, {"model": model, "scheduler": {}})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        manager.save(3, {"model": model, "trainer": {"t": torch.zeros(1)}})


@pytest.mark.timeout(60)
def test_nested_extra_state_round_trips_entry_by_entry(tmp_path):
    """A module's extra state that is a dict of tensors (the expert balancer's step accumulators)
    is saved as one entry per tensor and restored as that dict: a step checkpointed half-way
    finishes exactly as the uninterrupted one."""
    torch.manual_seed(0)
    first, rest = torch.rand(30, 8), torch.rand(20, 8)
    for exact in (False, True):
        src = nn.Sequential(ExpertBalancer(8, 2, exact=exact)).train()
        dst = nn.Sequential(ExpertBalancer(8, 2, exact=exact)).train()
        src[0].select(first)
        dst[0].select(torch.rand(30, 8))  # other accumulators of the same shapes, to be overwritten
        manager = CheckpointManager(tmp_path / f"exact_{exact}")
        path = manager.save(1, {"model": src, "rng": None})
        saved = {k for k in manager_module._read_dcp_metadata(path).state_dict_metadata if "_extra_state" in k}
        assert saved == {f"model.0._extra_state.{name}" for name in src[0].get_extra_state()}
        manager.load(path, dst)
        for balancer in (src[0], dst[0]):
            balancer.select(rest)
            balancer.update()
        assert torch.equal(dst[0].bias, src[0].bias) and torch.equal(dst[0].last_loads, src[0].last_loads)
        assert src[0].bias.abs().sum() > 0
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: model\.0\._extra_state\.step_required"):
        CheckpointManager(tmp_path / "exact_False").load(None, nn.Sequential(ExpertBalancer(8, 2, exact=True)))


# ----------------------------------------------------------------------------- async save


@pytest.mark.timeout(60)
def test_async_save_round_trip_and_wait_semantics(tmp_path):
    model, opt = make(0)
    train_step(model, opt, 0)
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    expected = full_state(model, opt)
    path = manager.save(1, {"model": model, "optim": opt, "trainer": {"step": 1}})
    train_step(model, opt, 1)  # mutate in place while the write may still be running
    assert manager.wait() == path and (path / "COMPLETE").is_file()
    assert manager.latest() == path
    for step in (2, 3):
        manager.save(step, {"model": model, "optim": opt, "trainer": {"step": step}})
    final = full_state(model, opt)
    trainer, _ = manager.load(path.parent / "step_00000003", *make(5))  # load waits for step 3
    manager.close()
    assert trainer == {"step": 3}
    assert [p.name for p in manager.checkpoints()] == ["step_00000002", "step_00000003"]
    fresh, fresh_opt = make(5)
    CheckpointManager(tmp_path).load(None, fresh, fresh_opt)
    assert_bitwise(full_state(fresh, fresh_opt), final)

    # Step 1's content is what the model held when save() returned, not after the next step.
    async_again = CheckpointManager(tmp_path / "again", async_save=True)
    model, opt = make(0)
    train_step(model, opt, 0)
    async_again.save(1, {"model": model, "optim": opt})
    train_step(model, opt, 1)
    async_again.close()
    fresh, fresh_opt = make(5)
    async_again.load(None, fresh, fresh_opt)
    assert_bitwise(full_state(fresh, fresh_opt), expected)


# ------------------------------------------------------------------- layout independence


def _run_ranks(fn, world_size: int, *args, timeout: float = 90.0) -> None:
    """Run fn(rank, world_size, *args) in forked processes; fail on error or timeout."""
    procs = [CTX.Process(target=_rank_main, args=(fn, r, world_size, *args)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes = [proc.exitcode for proc in procs]
        assert all(code == 0 for code in codes), f"rank exit codes {codes} (None = timed out)"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _rank_main(fn, rank, world_size, store, *args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _sharded(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(seed)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.inp.weight, DTensor) and model.inp.weight.to_local().shape[0] == 3
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _two_rank_job(rank, world_size, from_single: str, out: str):
    out_dir = Path(out)
    torch.manual_seed(100 + rank)  # distinct per-rank RNG streams
    # 1-process checkpoint -> 2 sharded ranks.
    model, opt = _sharded(seed=42)
    trainer, rng = CheckpointManager(from_single).load(None, model, opt)
    loaded = full_state(model, opt)
    if rank == 0:
        torch.save({"state": loaded, "trainer": trainer, "rng_torch": rng["torch"]}, out_dir / "loaded.pt")
    # rank 1 had no RNG file in the 1-process checkpoint: it gets rank 0's.
    assert torch.equal(rng["torch"], torch.load(Path(from_single) / "step_00000004/rng/rank_0.pt")["torch"])
    # Train on, then save sharded: once synchronously, once asynchronously.
    for step, use_async in ((5, False), (6, True)):
        train_step(model, opt, step * 10 + rank)  # different data per rank
        manager = CheckpointManager(out_dir / ("async" if use_async else "sync"), async_save=use_async)
        manager.save(step, {"model": model, "optim": opt, "trainer": {"step": step}})
        reference = full_state(model, opt)
        train_step(model, opt, 999)  # must not leak into the async checkpoint
        manager.close()
        if rank == 0:
            torch.save(reference, out_dir / f"reference_{step}.pt")
        # Restore the pre-mutation state so that the next round continues from it.
        manager.load(None, model, opt)
        assert_bitwise(full_state(model, opt), reference)


@pytest.mark.timeout(150)
def test_layout_independence_fsdp2_two_ranks_and_one_process(tmp_path):
    single_root = tmp_path / "single"
    model, opt = make(42)
    for s in range(4):
        train_step(model, opt, s)
    CheckpointManager(single_root).save(4, {"model": model, "optim": opt, "trainer": {"step": 4}})
    saved_by_one = full_state(model, opt)

    _run_ranks(_two_rank_job, 2, str(tmp_path / "store"), str(single_root), str(tmp_path))

    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded["trainer"] == {"step": 4}
    assert_bitwise(loaded["state"], saved_by_one)
    for step, kind in ((5, "sync"), (6, "async")):
        reference = torch.load(tmp_path / f"reference_{step}.pt")
        assert not torch.equal(reference["model.inp.weight"], saved_by_one["model.inp.weight"])
        ckpt = tmp_path / kind / f"step_{step:08d}"
        assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
        assert json.loads((ckpt / "COMPLETE").read_text())["world_size"] == 2
        fresh, fresh_opt = make(0)
        with pytest.warns(UserWarning, match="written by 2 ranks and is loaded by 1"):
            trainer, rng = CheckpointManager(tmp_path / kind).load(None, fresh, fresh_opt)
        assert trainer == {"step": step}
        assert torch.equal(rng["torch"], torch.load(ckpt / "rng/rank_0.pt")["torch"])
        assert_bitwise(full_state(fresh, fresh_opt), reference)
