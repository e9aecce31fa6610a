"""Capture and restore the random number generators a training step draws from.

Exact resume needs every generator back where it was: torch's CPU generator, the
current CUDA device's generator (only if CUDA is in use, so that a CPU run never
initialises CUDA), numpy's legacy global generator and Python's `random`.
The state is built from tensors, ints, floats, strings and tuples only, so that it
round-trips through `torch.save` / `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RngState = dict[str, Any]


def capture_rng() -> RngState:
    """The current state of the torch (CPU, current CUDA device), numpy and Python RNGs."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: RngState = {
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # current device: one device per rank
    return state


def restore_rng(state: RngState) -> None:
    """Put every generator captured by `capture_rng` back in that state.

    A CUDA state is restored onto the current CUDA device; a saved CUDA state is
    ignored when CUDA is unavailable (a GPU checkpoint resumed on CPU).
    """
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(
            f"RNG state lacks {sorted(missing)}; pass a dict produced by capture_rng() "
            "(or the rng value returned by CheckpointManager.load)"
        )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
