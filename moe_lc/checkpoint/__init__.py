"""Atomic, layout-independent checkpoints (torch.distributed.checkpoint) with keep-last-N and async save.

    manager = CheckpointManager("runs/x/checkpoints", keep_last=3, async_save=False)
    manager.save(step, {"model": model, "optim": optimizer, "trainer": {...}})
    trainer, rng = manager.load("latest", model, optimizer)   # or a path
    restore_rng(rng)
"""

from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .manager import STATE_DICT_OPTIONS, CheckpointManager
from .rng import RngState, capture_rng, restore_rng

__all__ = [
    "CheckpointManager",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "RngState",
    "STATE_DICT_OPTIONS",
    "capture_rng",
    "restore_rng",
]
