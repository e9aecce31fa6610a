"""Atomic, layout-independent checkpoints (torch.distributed.checkpoint) with keep-last-N and async save.

    manager = CheckpointManager("runs/x/checkpoints", keep_last=3, async_save=False)
    manager.save(step, {"model": model, "optim": optimizer, "trainer": {...}})
    trainer, rng = manager.load("latest", model, optimizer)   # or a path; every file checked first
    restore_rng(rng)
    manager.select("latest")   # which checkpoint that would load, and those rejected on the way
"""

from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from .manager import STATE_DICT_OPTIONS, CheckpointManager, Rejected, Selection, no_valid_checkpoint_message
from .rng import RngState, capture_rng, restore_rng

__all__ = [
    "CheckpointManager",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Rejected",
    "RngState",
    "Selection",
    "STATE_DICT_OPTIONS",
    "capture_rng",
    "no_valid_checkpoint_message",
    "restore_rng",
]
