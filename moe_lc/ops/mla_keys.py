"""MLA's keys and values from the up-projected latent, one dispatch point.

    kv = [k_nope, v] per head   ->   k = [k_nope, k_shared] per head,  v

``k_shared`` [B, S, SH] is one key per token, the same for every head (MLA's position slot, never
rotated here). ``mla_keys_reference`` is the definition (plain PyTorch: a split and a concatenation
with the broadcast shared key); ``mla_keys`` picks it or the Triton kernels
(moe_lc_kernels.mla_keys: one copy kernel forward, v a view of kv; the backward writes kv's
gradient and the shared key's head sum in one kernel, where the reference runs two strided
concatenations and a reduction). The Triton entry point is a graph break under ``torch.compile``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc_kernels.mla_keys import DTYPES, mla_keys_triton, shape_error

__all__ = ["mla_keys_reference", "mla_keys", "resolve_backend", "triton_unsupported_reason"]


def mla_keys_reference(kv: Tensor, shared: Tensor, nope: int) -> tuple[Tensor, Tensor]:
    """(k, v) in plain PyTorch: k = cat(kv[..., :nope], shared broadcast to every head), v = kv[..., nope:]."""
    B, S, H, width = kv.shape
    k_nope, v = kv.split([nope, width - nope], dim=-1)
    return torch.cat([k_nope, shared.unsqueeze(2).expand(B, S, H, shared.shape[-1])], dim=-1), v


def triton_unsupported_reason(kv: Tensor, shared: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs here, or None when they can."""
    reason = triton_device_reason(kv.device)
    if reason is not None:
        return reason
    if kv.dtype != shared.dtype or kv.dtype not in DTYPES:
        return f"the kernels take kv and the shared key in one of fp32/bf16/fp16, got {kv.dtype} and {shared.dtype}"
    if kv.device != shared.device:
        return f"kv and the shared key are on {kv.device} and {shared.device}"
    if kv.stride(-1) != 1 or shared.stride(-1) != 1:
        return "the kernels take kv and the shared key with their last dims contiguous"
    return None


def resolve_backend(kv: Tensor, shared: Tensor, backend: str = "auto") -> str:
    """The backend ``mla_keys`` runs: "auto" takes Triton only on CUDA (never the slow CPU interpreter)."""
    return choose_backend("mla_keys", backend, "triton", triton_unsupported_reason(kv, shared),
                          auto_takes_fast=kv.is_cuda)


_mla_keys_fused = torch.compiler.disable(mla_keys_triton)


def mla_keys(kv: Tensor, shared: Tensor, nope: int, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """(k [B, S, H, nope + SH], v [B, S, H, V]) from kv [B, S, H, nope + V] and shared [B, S, SH].

    Backends: "torch" (the reference), "triton" (one kernel each way; kv and shared of one
    fp32/bf16/fp16 dtype with contiguous last dims), "auto" (triton for such CUDA inputs, else torch).
    """
    problem = shape_error(kv, shared, nope)
    if problem is not None:
        raise ValueError(f"mla_keys: {problem}")
    if resolve_backend(kv, shared, backend) == "torch":
        return mla_keys_reference(kv, shared, nope)
    return _mla_keys_fused(kv, shared, nope)
