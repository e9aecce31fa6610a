"""Triton kernels of MLA's keys (launched from mla_keys.py): k = [k_nope, shared key] per head.

One program per token (grid (S, B)): it copies the token's [H, NOPE] no-position key channels out of
kv's [H, NOPE + V] rows and writes its one shared key [SH] into every head's last SH channels; the
backward writes the token's [H, NOPE + V] kv gradient (dk's first NOPE channels, then dv) and the
shared key's gradient, dk's last SH channels summed over the heads in fp32. Any token and head
strides (dk and dv come from attention's backward in its own layout); the last dim is contiguous.
Token offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _token_program(H, BH: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
    """This program's token (position s of row b, S positions a row) and its head and channel ranges."""
    heads = tl.arange(0, BH)
    return (tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.num_programs(0), heads,
            tl.arange(0, BN), tl.arange(0, BS), heads < H)


@triton.jit
def mla_keys_fwd_kernel(kv, shared, k, H, NOPE, SH, KV_B, KV_S, KV_H, SHARED_B, SHARED_S,
                        BH: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr):
    s_idx, b_idx, S, heads, nope, sh, h_in = _token_program(H, BH, BN, BS)
    row = kv + b_idx * KV_B + s_idx * KV_S + heads[:, None] * KV_H
    x = tl.load(row + nope[None, :], mask=h_in[:, None] & (nope < NOPE)[None, :])
    out = k + (b_idx * S + s_idx) * (H * (NOPE + SH)) + heads[:, None] * (NOPE + SH)
    tl.store(out + nope[None, :], x, mask=h_in[:, None] & (nope < NOPE)[None, :])
    z = tl.load(shared + b_idx * SHARED_B + s_idx * SHARED_S + sh, mask=sh < SH)
    every_head = tl.zeros([BH, BS], dtype=z.dtype) + z[None, :]
    tl.store(out + NOPE + sh[None, :], every_head, mask=h_in[:, None] & (sh < SH)[None, :])


@triton.jit
def mla_keys_bwd_kernel(dk, dv, dkv, dshared, H, NOPE, SH, V, DK_B, DK_S, DK_H, DV_B, DV_S, DV_H,
                        BH: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr):
    s_idx, b_idx, S, heads, nope, sh, h_in = _token_program(H, BH, BN, BS)
    vc = tl.arange(0, BV)
    token = b_idx * S + s_idx
    grad_k = dk + b_idx * DK_B + s_idx * DK_S + heads[:, None] * DK_H
    out = dkv + token * (H * (NOPE + V)) + heads[:, None] * (NOPE + V)
    n_mask = h_in[:, None] & (nope < NOPE)[None, :]
    tl.store(out + nope[None, :], tl.load(grad_k + nope[None, :], mask=n_mask), mask=n_mask)
    v_mask = h_in[:, None] & (vc < V)[None, :]
    g_v = tl.load(dv + b_idx * DV_B + s_idx * DV_S + heads[:, None] * DV_H + vc[None, :], mask=v_mask)
    tl.store(out + NOPE + vc[None, :], g_v, mask=v_mask)
    s_mask = h_in[:, None] & (sh < SH)[None, :]
    g_shared = tl.load(grad_k + NOPE + sh[None, :], mask=s_mask, other=0.0).to(tl.float32)
    tl.store(dshared + token * SH + sh, tl.sum(g_shared, axis=0).to(dshared.dtype.element_ty), mask=sh < SH)
