"""MLA's keys on Triton: k = [k_nope, shared key broadcast to every head] and v, from kv = [k_nope, v].

Why: the plain composition (``torch.cat`` of kv's strided k_nope columns and the expanded shared key,
then ``split``'s backward joining dk_nope and dv) runs two strided concatenations per MLA layer and
micro-batch at ~0.7-1.0 TB/s on an H100 (~0.26 ms each at k3-small's [16K, 16, 192] keys), plus a
reduction over the heads for the shared key's gradient. Here the forward is one copy kernel and v
stays a view of kv; the backward writes kv's gradient whole (no zero fill, no concatenation) and sums
the shared key's gradient over the heads in the same kernel. Bitwise the copies; the head sum in fp32.
Triton is imported on first use (moe-lc's ``mla_keys`` op is the public entry point: it checks the
inputs and picks these kernels or its PyTorch reference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TUNING = dict(warps=4)  # one token a program: [heads, channels] tiles of a few KB


def _blocks(*sizes: int) -> list[int]:
    import triton

    return [triton.next_power_of_2(max(1, n)) for n in sizes]


class _MLAKeysFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: Tensor, shared: Tensor, nope: int):
        from moe_lc_kernels import mla_keys_triton as kt

        B, S, H, width = kv.shape
        SH = shared.shape[-1]
        k = kv.new_empty(B, S, H, nope + SH)
        BH, BN, BS = _blocks(H, nope, SH)
        kt.mla_keys_fwd_kernel[(S, B)](kv, shared, k, H, nope, SH, kv.stride(0), kv.stride(1), kv.stride(2),
                                       shared.stride(0), shared.stride(1), BH=BH, BN=BN, BS=BS,
                                       num_warps=TUNING["warps"])
        ctx.nope, ctx.shared_width, ctx.kv_shape, ctx.shared_dtype = nope, SH, kv.shape, shared.dtype
        return k, kv[..., nope:]

    @staticmethod
    def backward(ctx, dk: Tensor, dv: Tensor):
        from moe_lc_kernels import mla_keys_triton as kt

        B, S, H, width = ctx.kv_shape
        nope, SH = ctx.nope, ctx.shared_width
        V = width - nope
        some = dk if dk is not None else dv  # autograd calls with at least one
        if dk is None:
            dk = some.new_zeros(B, S, H, nope + SH)
        if dv is None:
            dv = some.new_zeros(B, S, H, V)
        dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dk, dv))
        dkv = dk.new_empty(B, S, H, width)
        dshared = torch.empty(B, S, SH, device=dk.device, dtype=ctx.shared_dtype)
        BH, BN, BS, BV = _blocks(H, nope, SH, V)
        kt.mla_keys_bwd_kernel[(S, B)](dk, dv, dkv, dshared, H, nope, SH, V, dk.stride(0), dk.stride(1), dk.stride(2),
                                       dv.stride(0), dv.stride(1), dv.stride(2), BH=BH, BN=BN, BS=BS, BV=BV,
                                       num_warps=TUNING["warps"])
        return dkv, dshared, None


def shape_error(kv: Tensor, shared: Tensor, nope: int) -> Optional[str]:
    """What is wrong with the shapes of kv, shared and nope for MLA's keys (None when nothing is)."""
    if kv.dim() != 4 or shared.dim() != 3 or shared.shape[:2] != kv.shape[:2] or not 0 < nope < kv.shape[-1]:
        return (f"kv [B, S, H, nope + V] and shared [B, S, SH] with 0 < nope < nope + V, got kv {tuple(kv.shape)}, "
                f"shared {tuple(shared.shape)}, nope {nope}")
    return None


def mla_keys_triton(kv: Tensor, shared: Tensor, nope: int) -> tuple[Tensor, Tensor]:
    """(k, v): k [B, S, H, nope + SH] contiguous, each head's kv[..., :nope] then ``shared`` [B, S, SH];
    v = kv[..., nope:] (a view). kv [B, S, H, nope + V] with its last dim contiguous, shared's last
    dim contiguous, one dtype (fp32/bf16/fp16) and device."""
    problem = shape_error(kv, shared, nope)
    if problem is not None:
        raise ValueError(f"mla_keys_triton: {problem}")
    if kv.dtype != shared.dtype or kv.dtype not in DTYPES or kv.device != shared.device:
        raise ValueError(f"mla_keys_triton: kv and shared must share an fp32/bf16/fp16 dtype and a device, got "
                         f"{kv.dtype} on {kv.device} and {shared.dtype} on {shared.device}")
    if kv.stride(-1) != 1 or shared.stride(-1) != 1:
        raise ValueError("mla_keys_triton: kv's and shared's last dims must be contiguous")
    return _MLAKeysFunction.apply(kv, shared, nope)
