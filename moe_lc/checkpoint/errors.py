"""Checkpoint errors: each message names the path and what to do about it."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class for every checkpoint failure raised by moe_lc.checkpoint."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint directory that is incomplete or damaged (marker, manifest or DCP metadata)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit the model/optimizer it is loaded into."""
