"""Chunked KDA on the Triton kernels: launch plan, autograd Function and the public entry points.

Two entry points:
- :func:`chunk_kda_fused` takes the raw projections (q, k before L2 norm, the decay logit z with
  ``A_log``/``dt_bias``/``lower_bound``, beta logits) and fuses L2 norm, bounded gate, in-chunk
  cumsum and beta sigmoid into the kernels (what a layer should call for speed).
- :func:`chunk_kda_triton` takes what a KDA op backend takes (normalised q/k, log-decay g, beta in
  (0, 1)); the moe-lc KDA op registers it as its backend ``"triton"``.

Packed documents come as host boundaries (``seq_bounds``, the FlashAttention ``cu_seqlens`` as
ints): the launch plan is built on the host from them, and the kernels never need the device copy.
The bounded gate's floor comes as an argument too (``lower_bound`` / ``gate_lower_bound``), so that
nothing is read back from the GPU to check it.

Long sequences with few heads (B*H small) leave most multiprocessors idle in a serial state pass.
The plan then cuts every sequence into segments of ``segment_chunks`` chunks and runs
1. each segment from a zero state, carrying K identity columns too, so that it ends with its own
   final state S~_j and transition M_j (S_end = M_j S_start + S~_j), all segments in parallel;
2. the composition S_{j+1} = M_j S_j + S~_j, a short serial loop over segments;
3. every segment again from its true start state, writing outputs, all in parallel.
This is the algebra of context parallelism (KCP) inside one device. Backward mirrors it with M^T.

Memory: the forward saves the inputs, the segment start states and transitions (fp32), the row
norms (8 bytes a row and head) and, with ``save_prep="inverse"`` (default), Aqk and the UT inverse
X; never per-chunk states. The backward holds per-chunk states (bf16 by default) and state
gradients (fp32): T/64 * H * K * V * (2 + 4) bytes, 6.4 GB at T=256K, H=16, K=V=128), the in-chunk
cumsum G (one fp32 [T, H, K], 2.1 GB there) and [T, H, K] fp32 scratch only while one layer's
backward runs (``bwd_states`` in TUNING).

Plans (chunk and segment tables) are cached per (lengths, device, segments) and uploaded in one
pinned, non-blocking copy per dtype (``transfer.upload_tables``): a copy from pageable memory synchronised the
stream on every call and left the GPU idle while the host launched the next kernels (0.6 ms of 2.7 at B=8,T=4K).
Each table starts 16-byte aligned: Triton specialises on pointer alignment, and tables packed end to end
recompiled the state kernels for every new batch layout (~1 s each, the slow steps of a run's first minutes).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from moe_lc_kernels.transfer import upload_tables
from moe_lc_kernels.tuning import parse_launch_choices

CHUNK = 64
# Launch choices (docs/performance.md §4.9); MOE_LC_KDA_TUNING="key=value,..." overrides.
# Backward products: ``score_prec`` for the key-tile score gradients, whose contributions to dG
# cancel in pairs (at "tf32" the kernel rounds their operands itself so that the pairs stay equal),
# ``bwd_prec`` for all the others. ``*_maxnreg``: a register cap per thread (0: the compiler's).
# ``state_prec``: the backward's state passes multiply bf16 operands with the fp32 state-side operand
# as two bf16 halves ("bf16x2", 16 mantissa bits; default: B=8,T=4K 8.20 -> 7.98 ms, B=1,T=64K 18.19 ->
# 17.70 against "tf32", fuzz unchanged at 3.9e-3), in tf32, or in plain bf16 ("bf16": faster still,
# but d beta up to 3.5x further from float64 on the H200 fuzz, measured up to 9.2e-3).
# ``save_prep``: what the forward keeps for the backward besides q, k, v, z: "none" (recompute the
# prep), "inverse" (the UT inverse and Aqk, ~0.4x the inputs' bytes, the same trade as fla's
# default: only the prep's elementwise part is recomputed; measured 18.99 -> 17.50 ms at B=8,T=4K,
# 40.35 -> 36.01 at B=1,T=64K) or "all" (every prep output, ~1.4x; 16.53 / 34.90 ms).
# ``bwd_states``: "fp32", or the state-pass outputs the backward keeps in bf16 ("bf16": all; or some
# of states+delta+dh+ddelta joined by "+"). Default: all but the state gradients dh (H200, same call:
# B=8,T=4K 7.91 -> 7.66 ms, B=2,T=8K,H=64 15.81 -> 15.39 against "states" alone; fuzz 4.40e-3, was
# 3.92e-3 with all fp32). bf16 state gradients ("dh") double d A_log's error (7.5e-3 on one H200
# fuzz case), "bf16" (all four) 8.0e-3: too close to 1e-2.
# Kernels by prefix: ``norm`` row norms, ``prep`` elementwise prep, ``score`` forward tile-pair
# scores, ``state`` the state passes (``state_bv`` / ``state_bwd_bv``: the forward / backward pass's
# value block, 0: ``state_value_block`` picks it from the shape), ``vside``
# the value-side backward (``vside_bk``: key block per program), ``kside`` / ``ktile`` / ``kgate`` the
# key-side backward's chunk, tile and gate kernels; ``*_stages``: software pipelining of a loop's
# loads (``ktile_stages=3``: 10.99 -> 10.44 ms at B=8,T=4K).
TUNING = dict(save_prep="inverse", norm_warps=4, norm_bk=32, prep_warps=4, prep_bk=32, prep_maxnreg=0,
              score_warps=1, score_bk=64, inv_warps=2, wu_warps=4, state_warps=4, state_stages=1, state_bv=0,
              state_bwd_bv=0, bwd_states="states+delta+ddelta", state_prec="bf16x2", bwd_prec="tf32", score_prec="tf32",
              vside_warps=4, vside_bk=64, vside_bv=64, vside_maxnreg=0, kside_warps=4, kside_bk=16, kside_stages=1,
              ktile_warps=4, ktile_bk=64, ktile_maxnreg=168, ktile_stages=3, kgate_warps=4, kgate_bk=32)
_PRECISIONS = ("tf32", "tf32x3", "ieee")
_BWD_BUFFERS = ("states", "delta", "dh", "ddelta")  # the backward's state-pass outputs
_TEXT_TUNING = {"save_prep": ("none", "inverse", "all"),
                "bwd_states": ("fp32", "bf16", *("+".join(b for i, b in enumerate(_BWD_BUFFERS) if mask >> i & 1)
                                                for mask in range(1, 2 ** len(_BWD_BUFFERS) - 1))),
                "state_prec": ("tf32", "bf16", "bf16x2"), "bwd_prec": _PRECISIONS, "score_prec": _PRECISIONS}


def parse_tuning(text: str) -> dict:
    """``"key=value,..."`` as TUNING entries; unknown keys and malformed items are errors."""
    return parse_launch_choices(text, TUNING, "KDA", _TEXT_TUNING)


TUNING.update(parse_tuning(os.environ.get("MOE_LC_KDA_TUNING", "")))
GATE_SPAN_LIMIT = 5.5  # |g| per step above which exp(16 |g|) could overflow fp32/bf16 in a tile


@dataclass(frozen=True)
class _Plan:
    """Chunk and segment tables for one call (host-built; all index tensors int32 on the device)."""

    chunk_bos: Tensor
    chunk_eos: Tensor
    seg_chunk0: Tensor
    seg_nchunks: Tensor
    seg_bos: Tensor  # first token of the segment
    seg_eos: Tensor  # end of the segment's sequence (masks the last, partial chunk)
    seq_seg0: Tensor
    seq_nseg: Tensor
    # Segments in launch order, longest first (a pass lasts as long as its longest program, which
    # should not start last): every segment; those of split sequences (pass 1 needs their end state
    # and transition); those after a sequence's first (the backward's partial pass needs their dS~)
    seg_order: Tensor
    split_order: Tensor
    later_order: Tensor
    # The composition over segments runs on [J, N] grids (J: the most segments of a sequence), step j
    # holding every sequence's segment j: compose_index maps (j, n) to that segment, or to num_segments
    # (an identity transition, no state added) past the sequence's last; compose_slot maps each segment
    # to its (j, n) slot. One batched GEMM a step, whatever the documents.
    compose_index: Tensor  # [J * N] (long)
    compose_slot: Tensor  # [num_segments] (long)
    compose_steps: int  # J
    last_seg: Tensor  # [N] (long): last segment of each sequence
    first_seg: Tensor  # [N] (long)
    num_chunks: int
    num_segments: int
    num_seqs: int
    segmented: bool


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def auto_segment_chunks(seq_chunks: list[int], heads: int, value_blocks: int, device: torch.device) -> int | None:
    """Chunks per segment, or None when the plain serial pass already fills the device.

    The segmented path does about three passes of state work instead of one, so it pays only when
    the serial pass would use a small fraction of the multiprocessors.
    """
    sms = _num_sms(device)
    serial_programs = len(seq_chunks) * heads * value_blocks
    if serial_programs >= sms:
        return None
    target = 2 * sms  # programs of the final pass
    total_chunks = sum(seq_chunks)
    per_segment = max(8, math.ceil(total_chunks * heads * value_blocks / target))
    if max(seq_chunks) < 2 * per_segment:
        return None
    return per_segment


def build_plan(seq_lens: list[int], device: torch.device, segment_chunks: int | None) -> _Plan:
    chunk_bos, chunk_eos, seg_chunk0, seg_nchunks, seq_seg0, seq_nseg = [], [], [], [], [], []
    seg_bos, seg_eos = [], []
    start = 0
    for length in seq_lens:
        n_chunks = -(-length // CHUNK)
        first_chunk = len(chunk_bos)
        chunk_bos.extend(range(start, start + length, CHUNK))
        chunk_eos.extend(range(start + CHUNK, start + length, CHUNK))
        chunk_eos.append(start + length)
        per = n_chunks if segment_chunks is None else segment_chunks
        seq_seg0.append(len(seg_chunk0))
        for c in range(0, n_chunks, per):
            seg_chunk0.append(first_chunk + c)
            seg_nchunks.append(min(per, n_chunks - c))
            seg_bos.append(start + c * CHUNK)
            seg_eos.append(start + length)
        seq_nseg.append(len(seg_chunk0) - seq_seg0[-1])
        start += length

    longest_first = sorted(range(len(seg_chunk0)), key=lambda s: -seg_nchunks[s])
    seq_of = [n for n, count in enumerate(seq_nseg) for _ in range(count)]
    split_order = [s for s in longest_first if seq_nseg[seq_of[s]] > 1]
    later_order = [s for s in longest_first if s != seq_seg0[seq_of[s]]]

    # One upload per dtype (no wait for queued GPU work), every table 16-byte aligned (``upload_tables``)
    tables = (chunk_bos, chunk_eos, seg_chunk0, seg_nchunks, seg_bos, seg_eos, seq_seg0, seq_nseg, longest_first,
              split_order, later_order)
    ints = upload_tables(tables, torch.int32, device)

    steps = max(seq_nseg, default=0)
    n_seqs = len(seq_lens)
    compose_index = [len(seg_chunk0)] * (steps * n_seqs)
    compose_slot = [0] * len(seg_chunk0)
    for n, (seg0, count) in enumerate(zip(seq_seg0, seq_nseg)):
        for j in range(count):
            compose_index[j * n_seqs + n] = seg0 + j
            compose_slot[seg0 + j] = j * n_seqs + n
    last = [seg0 + count - 1 for seg0, count in zip(seq_seg0, seq_nseg)]
    longs = upload_tables([compose_index, compose_slot, last, seq_seg0], torch.long, device)
    return _Plan(
        chunk_bos=ints[0], chunk_eos=ints[1], seg_chunk0=ints[2], seg_nchunks=ints[3], seg_bos=ints[4],
        seg_eos=ints[5], seq_seg0=ints[6], seq_nseg=ints[7], seg_order=ints[8], split_order=ints[9],
        later_order=ints[10],
        compose_index=longs[0], compose_slot=longs[1], compose_steps=steps, last_seg=longs[2],
        first_seg=longs[3], num_chunks=len(chunk_bos), num_segments=len(seg_chunk0), num_seqs=len(seq_lens),
        segmented=len(seg_chunk0) > len(seq_lens),
    )


_PLANS: dict = {}
_PLAN_CACHE_SIZE = 64


def cached_plan(seq_lens: list[int], device: torch.device, segment_chunks: int | None) -> _Plan:
    """:func:`build_plan`, remembered for the latest few (lengths, device, segment) keys: a training
    step calls every KDA layer with the same lengths, forward and backward."""
    key = (tuple(seq_lens), str(device), segment_chunks)
    plan = _PLANS.pop(key, None)
    if plan is None:
        plan = build_plan(seq_lens, device, segment_chunks)
        while len(_PLANS) >= _PLAN_CACHE_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan  # most recent last
    return plan


@dataclass(frozen=True)
class _Flags:
    gate_in_kernel: bool
    l2norm: bool
    beta_sigmoid: bool
    scale: float
    lower_bound: float
    # keep every chunk's start state and Delta = U - W S (bf16 by ``bwd_states``: (T/64) H K V + T H V
    # values) from the forward's state pass for the backward, which then skips its own state pass
    keep_states: bool = False
    # keep every prep output (W, U, Gamma Q, Gamma_C K, G and its per-chunk total; save_prep="all") for
    # the backward whatever TUNING's save_prep says: the backward skips the prep's elementwise rerun
    keep_prep: bool = False


def state_value_block(num_seqs: int, heads: int, value_dim: int, sms: int) -> int:
    """The state passes' value block when TUNING leaves it automatic (0).

    A serial pass runs one program per (sequence, head, value block). 64 wide when that fills the
    multiprocessors; else 16 wide when that does (4x the programs: at k3-small's two 8K rows
    per micro-batch, 2-4 sequences of 16 heads, f+b 4.44 -> 4.36 ms a layer on an H200 against 64
    with segments, docs/performance.md §4.9); else 64 and the segmented passes (§4.4) supply the
    parallelism (one long sequence).
    """
    for bv in (64, 16):
        if num_seqs * heads * max(1, value_dim // bv) >= sms:
            return bv
    return 64


def _config(q: Tensor, v: Tensor, num_seqs: int) -> dict:
    inter = torch.float32 if q.dtype == torch.float32 else torch.bfloat16
    exact = inter == torch.float32
    heads, width = q.shape[-2], min(q.shape[-1], v.shape[-1])
    auto = None
    if not (TUNING["state_bv"] and TUNING["state_bwd_bv"]):
        auto = state_value_block(num_seqs, heads, v.shape[-1], _num_sms(q.device))
    return dict(inter=inter, dot="ieee" if exact else "tf32",
                BV=min(TUNING["state_bv"] or auto, width), BV_BWD=min(TUNING["state_bwd_bv"] or auto, width))


def _prep(kt, q, k, v, gz, beta, A_log, dt_bias, plan: _Plan, flags: _Flags, cfg: dict,
          scores: tuple[Tensor, Tensor] | None = None, rnorm: Tensor | None = None):
    """W, U, Gamma Q, Gamma_C / Gamma K, Aqk, Gamma_C and the UT inverse X of every chunk, then G (the
    in-chunk cumsum, log2 units) and the row norms. With ``scores`` = (Aqk, X) and ``rnorm`` kept
    from the forward, only the elementwise outputs are computed."""
    total, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    inter = cfg["inter"]
    f32 = dict(device=q.device, dtype=torch.float32)
    w = torch.empty(total, heads, key_dim, device=q.device, dtype=inter)
    qg = torch.empty_like(w)
    kend = torch.empty_like(w)
    u = torch.empty(total, heads, value_dim, device=q.device, dtype=inter)
    gc = torch.empty(plan.num_chunks, heads, key_dim, **f32)
    gcum = torch.empty(total, heads, key_dim, **f32)
    if scores is None:
        aqk = torch.empty(total, heads, CHUNK, device=q.device, dtype=inter)
        x = torch.empty(plan.num_chunks, heads, CHUNK, CHUNK, **f32)
    else:
        aqk, x = scores
    a_log = A_log if A_log is not None else gc
    dtb = dt_bias if dt_bias is not None else gc
    grid = (plan.num_chunks * heads,)
    bk = min(TUNING["prep_bk"], key_dim)
    if rnorm is None:
        rnorm = torch.empty(total, heads, 2, **f32)
        kt._row_norms_kernel[grid](q, k, plan.chunk_bos, plan.chunk_eos, rnorm, heads, K=key_dim,
                                   BK=min(TUNING["norm_bk"], key_dim), BT=CHUNK, L2NORM=flags.l2norm,
                                   num_warps=TUNING["norm_warps"], num_stages=1)
    # w holds Gamma K until _wu_kernel turns it into W; x holds A until _ut_inverse_kernel turns it into X
    kt._prep_blocked_kernel[(plan.num_chunks * heads * (key_dim // bk),)](
        q, k, gz, a_log, dtb, plan.chunk_bos, plan.chunk_eos, rnorm, w, qg, kend, gc, gcum, flags.scale,
        flags.lower_bound, heads, K=key_dim, BK=bk, BT=CHUNK, GATE_IN_KERNEL=flags.gate_in_kernel,
        HAS_DT_BIAS=dt_bias is not None, num_warps=TUNING["prep_warps"], num_stages=1, **_register_cap("prep"))
    if scores is None:
        kt._prep_scores_kernel[(plan.num_chunks * heads * 10,)](
            q, k, beta, plan.chunk_bos, plan.chunk_eos, gcum, rnorm, aqk, x, flags.scale, heads, K=key_dim,
            BK=min(TUNING["score_bk"], key_dim), BT=CHUNK, BETA_SIGMOID=flags.beta_sigmoid, DOT_PREC=cfg["dot"],
            num_warps=TUNING["score_warps"], num_stages=1)
        # the 16x16 inverse products run in exact fp32
        kt._ut_inverse_kernel[grid](x, heads, BT=CHUNK, INV_PREC="ieee", num_warps=TUNING["inv_warps"], num_stages=1)
    kt._wu_kernel[grid](v, beta, x, plan.chunk_bos, plan.chunk_eos, w, u, heads, K=key_dim, V=value_dim, BT=CHUNK,
                        BC=min(64, key_dim, value_dim), BETA_SIGMOID=flags.beta_sigmoid, DOT_PREC=cfg["dot"],
                        num_warps=TUNING["wu_warps"], num_stages=2)
    return (w, u, qg, kend, aqk, gc, x), gcum, rnorm


def _state_operands(w: Tensor, backward: bool) -> dict:
    """``OPD`` and ``SPLIT`` of the state-pass products: the intermediates' dtype; in the backward's
    passes fp32 (tf32 products) with ``state_prec="tf32"``, or bf16 with the fp32 state-side operand
    split in two bf16 halves with ``"bf16x2"``."""
    import triton.language as tl  # here, not at import: moe_lc_kernels imports without Triton

    if w.dtype == torch.float32 or (backward and TUNING["state_prec"] == "tf32"):
        return dict(OPD=tl.float32, SPLIT=False)
    return dict(OPD=tl.bfloat16, SPLIT=backward and TUNING["state_prec"] == "bf16x2")


def _state_fwd(kt, w, u, qg, kend, aqk, gc, plan, cfg, *, init, transition, out=None, states=None, delta=None):
    """One forward state pass over every segment; returns the segment end states. With ``states``
    (the backward) every chunk's start state and its Delta = U - W S (into ``delta``) are kept."""
    heads, key_dim = w.shape[1], w.shape[2]
    value_dim = u.shape[-1]
    bv = cfg["BV"]
    v_end = value_dim + (key_dim if transition else 0)
    seg_end = torch.empty(plan.num_segments, heads, key_dim, v_end, device=w.device, dtype=torch.float32)
    order = plan.split_order if transition else plan.seg_order  # pass 1 skips unsplit sequences
    grid = (v_end // bv, len(order) * heads)
    kt._state_fwd_kernel[grid](
        w, u, qg, kend, aqk, gc, out if out is not None else w, states if states is not None else w,
        delta if delta is not None else w, init if init is not None else seg_end, seg_end,
        plan.seg_chunk0, plan.seg_nchunks, plan.seg_bos, plan.seg_eos, order, heads,
        K=key_dim, V=value_dim, BV=bv, BT=CHUNK, V_END=v_end, HAS_INIT=init is not None,
        TRANSITION=transition, STORE_OUTPUT=out is not None, STORE_STATES=states is not None,
        DOT_PREC=cfg["dot"], **_state_operands(w, states is not None),
        num_warps=TUNING["state_warps"], num_stages=TUNING["state_stages"],
    )
    return seg_end


def _state_buffers(q: Tensor, v: Tensor, plan: "_Plan", cfg: dict) -> tuple[Tensor, Tensor]:
    """Every chunk's start state [chunks, H, K, V] and Delta [T, H, V], in ``bwd_states``' dtypes."""
    dtypes = bwd_dtypes(TUNING["bwd_states"], cfg["inter"])
    total, heads, key_dim = q.shape
    states = torch.empty(plan.num_chunks, heads, key_dim, v.shape[-1], device=q.device, dtype=dtypes["states"])
    delta = torch.empty(total, heads, v.shape[-1], device=q.device, dtype=dtypes["delta"])
    return states, delta


def _on_steps(transitions: Tensor, increments: Tensor, plan: "_Plan") -> tuple[Tensor, Tensor, Tensor]:
    """The composition's operands on its [J, N H] grid (step j: every sequence's segment j): the
    transitions [J, N H, K, K] and increments [J, N H, K, V], an identity and zero past a sequence's
    last segment, and an empty fp32 grid of states for the steps."""
    heads, key_dim, value_dim = increments.shape[1:]
    eye = torch.eye(key_dim, device=increments.device, dtype=torch.float32).expand(1, heads, key_dim, key_dim)
    grid = (plan.compose_steps, plan.num_seqs * heads)
    m = torch.cat([transitions, eye])[plan.compose_index].view(*grid, key_dim, key_dim)
    add = torch.cat([increments, increments.new_zeros(1, heads, key_dim, value_dim)])[plan.compose_index]
    states = torch.empty(*grid, key_dim, value_dim, device=increments.device, dtype=torch.float32)
    return m, add.view(*grid, key_dim, value_dim), states


def _segment_starts(kt, w, u, qg, kend, aqk, gc, plan, cfg, initial_state):
    """Pass 1 + composition: (start state of every segment, transitions [NS, H, K, K]).

    The composition S_{j+1} = M_j S_j + S~_j is a short serial loop of batched fp32 GEMMs, one a step
    over every sequence at once (an identity past a sequence's last segment).
    """
    heads, key_dim = w.shape[1], w.shape[2]
    value_dim = u.shape[-1]
    buf = _state_fwd(kt, w, u, qg, kend, aqk, gc, plan, cfg, init=None, transition=True)
    s_tilde, transitions = buf[..., :value_dim], buf[..., value_dim:].contiguous()
    m, add, starts = _on_steps(transitions, s_tilde, plan)
    if initial_state is not None:
        starts[0] = initial_state.reshape(-1, key_dim, value_dim)
    else:
        starts[0].zero_()
    for j in range(plan.compose_steps - 1):
        torch.baddbmm(add[j], m[j], starts[j], out=starts[j + 1])
    return starts.view(-1, heads, key_dim, value_dim)[plan.compose_slot], transitions


def _segment_end_grads(dpart, transitions, dfinal, plan):
    """dS at every segment end, last segment first: dS_end(j-1) = M_j^T dS_end(j) + dS~_j."""
    heads, key_dim, value_dim = dpart.shape[1:]
    m, add, grads = _on_steps(transitions, dpart, plan)
    # dfinal belongs to each sequence's last segment; identity steps past it carry it down unchanged
    if dfinal is not None:
        grads[-1] = dfinal.reshape(-1, key_dim, value_dim)
    else:
        grads[-1].zero_()
    for j in reversed(range(1, plan.compose_steps)):
        # dS~ of a first segment is neither computed nor needed (its start gradient comes from the last pass)
        torch.baddbmm(add[j], m[j].transpose(-1, -2), grads[j], out=grads[j - 1])
    return grads.view(-1, heads, key_dim, value_dim)[plan.compose_slot]


def bwd_dtypes(chosen: str, inter: torch.dtype) -> dict[str, torch.dtype]:
    """dtype of each state-pass output kept for the backward: fp32, or ``inter`` (bf16) for those
    that ``chosen`` (TUNING's ``bwd_states``) names ("bf16": all four)."""
    low = set(_BWD_BUFFERS) if chosen == "bf16" else set() if chosen == "fp32" else set(chosen.split("+"))
    return {name: inter if name in low else torch.float32 for name in _BWD_BUFFERS}


def _register_cap(kernel: str) -> dict:
    """``maxnreg`` launch option from TUNING (absent when 0, which the interpreter also needs)."""
    cap = TUNING[f"{kernel}_maxnreg"]
    return {"maxnreg": cap} if cap else {}


def _bwd_vside(kt, v: Tensor, beta: Tensor, delta: Tensor, x: Tensor, states: Tensor, dh: Tensor,
               ddelta: Tensor, do: Tensor, dv: Tensor, plan: _Plan, meta: dict) -> dict[str, Tensor]:
    """Backward, part 1: dv, and the V-contracted gradients into fp32 scratch (3 of [T, H, K])."""
    total, heads = delta.shape[:2]
    key_dim = states.shape[2]
    value_dim = v.shape[-1]
    dev = v.device
    scratch = {name: torch.empty(total, heads, key_dim, device=dev, dtype=torch.float32)
               for name in ("dqg", "dw", "dkend")}
    for name in ("daqk", "dt"):
        scratch[name] = torch.empty(plan.num_chunks, heads, CHUNK, CHUNK, device=dev, dtype=torch.float32)
    scratch["dgc"] = torch.empty(plan.num_chunks, heads, key_dim, device=dev, dtype=torch.float32)
    args = (v, beta, plan.chunk_bos, plan.chunk_eos, x, delta, states, dh, ddelta, do,
            dv, scratch["dqg"], scratch["dw"], scratch["dkend"], scratch["daqk"], scratch["dt"], scratch["dgc"], heads)
    bk = min(TUNING["vside_bk"], key_dim)
    kt._bwd_vside_kernel[(plan.num_chunks * heads * (2 * (key_dim // bk) + 2),)](
        *args, K=key_dim, V=value_dim, BK=bk, BV=min(TUNING["vside_bv"], value_dim),
        num_warps=TUNING["vside_warps"], **_register_cap("vside"), **meta)
    return scratch


def _bwd_kside(kt, q: Tensor, k: Tensor, gz: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor, x: Tensor,
               gcum: Tensor, rnorm: Tensor, scratch: dict[str, Tensor], dq: Tensor, dk: Tensor, dgz: Tensor,
               dbeta: Tensor, plan: _Plan, flags: _Flags, has_dt_bias: bool, prec: str,
               score_prec: str) -> tuple[Tensor, Tensor]:
    """Backward, part 2 (three kernels): dq, dk, dgz, dbeta from the scratch, which they overwrite (dA
    over dT, d(Gamma K) then dG over dW, unnormalised dq / dk over dQg / dKend), with G (``gcum``) and
    the row norms as the prep left them. Returns the per-chunk partials of dA_log [chunks, H, blocks]
    and d dt_bias [chunks, H, K] (gate in kernel)."""
    total, heads, key_dim = q.shape
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    tile_bk = min(TUNING["ktile_bk"], key_dim)
    gate_bk = min(TUNING["kgate_bk"], key_dim)
    tile_blocks = key_dim // tile_bk
    db_part = torch.empty(1 + tile_blocks, total, heads, **f32)
    row_part = torch.empty(2 * tile_blocks, total, heads, **f32) if flags.l2norm else db_part
    esum_part = torch.empty(plan.num_chunks, heads, CHUNK // 16, key_dim, **f32)
    gate = flags.gate_in_kernel
    dA_part = torch.empty(plan.num_chunks, heads, key_dim // gate_bk, **f32) if gate else esum_part
    ddtb_part = torch.empty(plan.num_chunks, heads, key_dim, **f32) if gate and has_dt_bias else esum_part
    gate_flags = dict(GATE_IN_KERNEL=gate, HAS_DT_BIAS=has_dt_bias, L2NORM=flags.l2norm,
                      BETA_SIGMOID=flags.beta_sigmoid)
    kt._bwd_kside_chunk_kernel[(plan.num_chunks * heads,)](
        k, beta, plan.chunk_bos, plan.chunk_eos, x, scratch["dw"], scratch["dt"], gcum, rnorm,
        db_part, heads, K=key_dim, BK=min(TUNING["kside_bk"], key_dim), BT=CHUNK, BETA_SIGMOID=flags.beta_sigmoid,
        PREC=prec, SCORE_PREC=score_prec, num_warps=TUNING["kside_warps"], num_stages=TUNING["kside_stages"])
    kt._bwd_kside_tile_kernel[(plan.num_chunks * heads * (CHUNK // 16) * tile_blocks,)](
        q, k, beta, plan.chunk_bos, plan.chunk_eos, gcum, rnorm, scratch["dqg"], scratch["dw"], scratch["dkend"],
        scratch["daqk"], scratch["dt"], dq, dk, db_part, row_part, esum_part, flags.scale, total, heads,
        K=key_dim, BK=tile_bk, BT=CHUNK, L2NORM=flags.l2norm, BETA_SIGMOID=flags.beta_sigmoid,
        SCORE_PREC=score_prec, num_warps=TUNING["ktile_warps"], num_stages=TUNING["ktile_stages"],
        **_register_cap("ktile"))
    kt._bwd_kside_gate_kernel[(plan.num_chunks * heads * (key_dim // gate_bk),)](
        q, k, gz, beta, A_log, dt_bias, plan.chunk_bos, plan.chunk_eos, gcum, rnorm, scratch["dqg"], scratch["dw"],
        scratch["dkend"], scratch["dgc"], esum_part, db_part, row_part, dq, dk, dgz, dbeta, dA_part, ddtb_part,
        flags.lower_bound, total, heads, K=key_dim, BK=gate_bk, BT=CHUNK, TILE_BLOCKS=tile_blocks, **gate_flags,
        num_warps=TUNING["kgate_warps"], num_stages=1)
    return dA_part, ddtb_part


class _ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gz, beta, A_log, dt_bias, initial_state, plan: _Plan, flags: _Flags):
        from moe_lc_kernels import kda_triton as kt

        cfg = _config(q, v, plan.num_seqs)
        prep, gcum, rnorm = _prep(kt, q, k, v, gz, beta, A_log, dt_bias, plan, flags, cfg)
        w, u, qg, kend, aqk, gc, x = prep
        init = None if initial_state is None else initial_state.float().contiguous()
        transitions = None
        if plan.segmented:
            seg_init, transitions = _segment_starts(kt, w, u, qg, kend, aqk, gc, plan, cfg, init)
        else:
            seg_init = init
        o = torch.empty_like(v)
        states = delta = None
        if flags.keep_states:  # the pass runs at the backward's precision (_state_operands), as it would there
            states, delta = _state_buffers(q, v, plan, cfg)
        seg_end = _state_fwd(kt, w, u, qg, kend, aqk, gc, plan, cfg, init=seg_init, transition=False, out=o,
                             states=states, delta=delta)
        final = seg_end[plan.last_seg]
        saved = "all" if flags.keep_prep else TUNING["save_prep"]
        kept = {"none": (), "inverse": (aqk, x), "all": (*prep, gcum)}[saved]
        del gcum
        ctx.save_for_backward(q, k, v, gz, beta, A_log, dt_bias, seg_init, transitions, rnorm, states, delta, *kept)
        ctx.plan, ctx.flags, ctx.has_init = plan, flags, initial_state is not None
        ctx.init_dtype = None if initial_state is None else initial_state.dtype
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        from moe_lc_kernels import kda_triton as kt

        q, k, v, gz, beta, A_log, dt_bias, seg_init, transitions, rnorm, states, delta, *kept = ctx.saved_tensors
        plan, flags = ctx.plan, ctx.flags
        cfg = _config(q, v, plan.num_seqs)
        total, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        bv = cfg["BV_BWD"]
        do = do.contiguous()
        if len(kept) == 8:  # save_prep="all"
            w, u, qg, kend, aqk, gc, x, gcum = kept
        else:  # "inverse" hands back (Aqk, X); "none" nothing. G is kept for the key side (+1 fp32
            # [T, H, K] during the state passes) so that its chunk kernel does not redo the gate and cumsum
            (w, u, qg, kend, aqk, gc, x), gcum, _ = _prep(kt, q, k, v, gz, beta, A_log, dt_bias, plan, flags, cfg,
                                                          scores=tuple(kept) or None, rnorm=rnorm)
        dtypes = bwd_dtypes(TUNING["bwd_states"], cfg["inter"])
        if states is None:  # not kept by the forward: the state pass again, keeping them
            states, delta = _state_buffers(q, v, plan, cfg)
            _state_fwd(kt, w, u, qg, kend, aqk, gc, plan, cfg, init=seg_init, transition=False, states=states,
                       delta=delta)

        dh = torch.empty_like(states, dtype=dtypes["dh"])
        ddelta = torch.empty(total, heads, value_dim, device=q.device, dtype=dtypes["ddelta"])
        dstart = torch.empty(plan.num_segments, heads, key_dim, value_dim, device=q.device, dtype=torch.float32)
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        grid = (value_dim // bv, plan.num_segments * heads)
        common = dict(K=key_dim, V=value_dim, BV=bv, BT=CHUNK, DOT_PREC=cfg["dot"],
                      **_state_operands(w, True), num_warps=TUNING["state_warps"],
                      num_stages=TUNING["state_stages"])
        if plan.segmented:
            dpart = torch.empty_like(dstart)
            kt._state_bwd_kernel[(value_dim // bv, len(plan.later_order) * heads)](
                qg, w, kend, aqk, gc, do, dh, ddelta, dstart, dpart, plan.seg_chunk0, plan.seg_nchunks, plan.seg_bos,
                plan.seg_eos, plan.later_order, heads, HAS_INIT=False, STORE=False, **common)
            dend = _segment_end_grads(dpart, transitions, dfinal, plan)
        else:
            dend = dfinal
        kt._state_bwd_kernel[grid](qg, w, kend, aqk, gc, do, dh, ddelta, dend if dend is not None else dstart,
                                   dstart, plan.seg_chunk0, plan.seg_nchunks, plan.seg_bos, plan.seg_eos,
                                   plan.seg_order, heads,
                                   HAS_INIT=dend is not None, STORE=True, **common)
        del u, qg, kend, aqk

        dq, dk, dv, dgz = (torch.empty_like(t) for t in (q, k, v, gz))
        dbeta = torch.empty_like(beta)
        gate = flags.gate_in_kernel
        exact = cfg["dot"] == "ieee"
        a_log = A_log if A_log is not None else gc
        dtb = dt_bias if dt_bias is not None else gc
        prec = "ieee" if exact else TUNING["bwd_prec"]
        del w
        score_prec = "ieee" if exact else TUNING["score_prec"]
        scratch = _bwd_vside(kt, v, beta, delta, x, states, dh, ddelta, do, dv, plan,
                             dict(BT=CHUNK, BETA_SIGMOID=flags.beta_sigmoid, PREC=prec,
                                  ROUND_DAQK=score_prec == "tf32", num_stages=1))
        del delta, states, dh, ddelta  # the largest buffers; the k-side kernels read only the scratch
        dA_part, ddtb_part = _bwd_kside(kt, q, k, gz, beta, a_log, dtb, x, gcum, rnorm, scratch, dq, dk, dgz, dbeta,
                                        plan, flags, dt_bias is not None, prec, score_prec)
        del scratch, gcum
        del x
        dA_log = (dA_part.sum((0, 2)).to(A_log.dtype)
                  if gate and A_log is not None and ctx.needs_input_grad[5] else None)
        ddt_bias = (ddtb_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype)
                    if gate and dt_bias is not None and ctx.needs_input_grad[6] else None)
        dinit = dstart[plan.first_seg].to(ctx.init_dtype) if ctx.has_init else None
        return dq, dk, dv, dgz, dbeta, dA_log, ddt_bias, dinit, None, None


# ----------------------------------------------------------------------------- entry points
def _check(name: str, q: Tensor, k: Tensor, v: Tensor, gz: Tensor, beta: Tensor, seq_bounds: Sequence[int] | None,
           initial_state) -> list[int]:
    """Shape checks; returns the length of every sequence (packed document or batch row)."""
    if q.dim() != 4 or k.shape != q.shape or gz.shape != q.shape:
        raise ValueError(f"{name}: q, k and g/z must be [B, T, H, K] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(gz.shape)}")
    batch, seq_len, heads, key_dim = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] and beta [B, T, H] matching q {tuple(q.shape)}")
    value_dim = v.shape[-1]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: the Triton kernels take fp32/bf16/fp16 inputs, got {q.dtype}; "
                        f'use backend="torch" for float64')
    for label, dim in (("K", key_dim), ("V", value_dim)):
        if not kernel_head_dim_ok(dim):
            raise ValueError(f"{name}: head dim {label}={dim} must be a power of two in [16, 256]; "
                             f'use backend="torch" for other sizes')
    if seq_bounds is None:
        lens = [seq_len] * batch
    else:
        if batch != 1:
            raise ValueError(f"{name}: with seq_bounds the documents are packed in one row, so B must be 1 "
                             f"(got B={batch})")
        bounds = [int(b) for b in seq_bounds]
        if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len
                or any(b <= a for a, b in zip(bounds, bounds[1:]))):
            raise ValueError(f"{name}: seq_bounds must rise strictly from 0 to T={seq_len}, got {bounds}")
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if initial_state is not None and initial_state.shape != (len(lens), heads, key_dim, value_dim):
        raise ValueError(f"{name}: initial_state must be [N, H, K, V] = {(len(lens), heads, key_dim, value_dim)}, "
                         f"got {tuple(initial_state.shape)}")
    return lens


def _run(q, k, v, gz, beta, A_log, dt_bias, initial_state, output_final_state, flags, segment_chunks, lens):
    batch, seq_len, heads, _ = q.shape
    value_dim = v.shape[-1]
    if segment_chunks == 0:
        segment_chunks = None
    elif segment_chunks is None:
        segment_chunks = auto_segment_chunks([-(-n // CHUNK) for n in lens], heads,
                                             value_dim // _config(q, v, len(lens))["BV"], q.device)
    plan = cached_plan(lens, q.device, segment_chunks)
    flat = [t.reshape(batch * seq_len, *t.shape[2:]).contiguous() for t in (q, k, v, gz, beta)]
    o, final = _ChunkKDAFunction.apply(*flat, A_log, dt_bias, initial_state, plan, flags)
    return o.reshape(batch, seq_len, heads, value_dim), (final if output_final_state else None)


def chunk_kda_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    beta_logits: Tensor,
    A_log: Tensor,
    dt_bias: Tensor | None = None,
    lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    seq_bounds: Sequence[int] | None = None,
    segment_chunks: int | None = None,
    keep_states: bool = False,
    keep_prep: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KDA from raw projections, everything fused: returns ``(o, final_state or None)``.

    Computes ``q/|q|``, ``k/|k|`` (``x / sqrt(sum x^2 + 1e-6)``), ``g = lower_bound *
    sigmoid(exp(A_log) * (z + dt_bias))``, ``beta = sigmoid(beta_logits)`` inside the kernels and
    then KDA as :func:`chunk_kda_triton`. Shapes as there; ``A_log`` [H], ``dt_bias`` [H*K] or
    [H, K]. ``seq_bounds``: host boundaries of packed documents (0, ..., T; B must be 1).
    ``segment_chunks``: chunks per parallel segment (None: automatic, 0: never split).
    ``keep_states``: the forward keeps every chunk's state for the backward ((T/64) H K V + T H V
    bf16 values more), which then skips its own state pass; same gradients up to rounding.
    ``keep_prep``: the forward keeps every prep output (``save_prep="all"``: ~1.5 KB more per head and
    token at K = V = 128), which the backward then does not recompute; bit-identical gradients.
    Differentiable in q, k, v, z, beta_logits, A_log, dt_bias and initial_state.
    """
    if lower_bound is None or not lower_bound < 0 or lower_bound < -GATE_SPAN_LIMIT:
        raise ValueError(f"chunk_kda_fused: lower_bound must be in [-{GATE_SPAN_LIMIT}, 0) (the bounded gate; got "
                         f"{lower_bound}); the unbounded softplus gate needs a non-Triton KDA implementation "
                         "(the torch backend)")
    lens = _check("chunk_kda_fused", q, k, v, z, beta_logits, seq_bounds, initial_state)
    heads, key_dim = q.shape[2], q.shape[3]
    if A_log.shape != (heads,):
        raise ValueError(f"chunk_kda_fused: A_log must be [H]=[{heads}], got {tuple(A_log.shape)}")
    if dt_bias is not None:
        if dt_bias.numel() != heads * key_dim:
            raise ValueError(f"chunk_kda_fused: dt_bias must have H*K={heads * key_dim} entries, got {tuple(dt_bias.shape)}")
    flags = _Flags(gate_in_kernel=True, l2norm=True, beta_sigmoid=True,
                   scale=key_dim**-0.5 if scale is None else float(scale), lower_bound=float(lower_bound),
                   keep_states=keep_states, keep_prep=keep_prep)
    return _run(q, k, v, z, beta_logits, A_log, dt_bias, initial_state, output_final_state, flags, segment_chunks,
                lens)


# Largest head dim run forward and backward on an H200 (d=128: every output and gradient within
# 5.3e-3 of float64; larger dims were never compiled for a GPU; see docs/performance.md §9).
MAX_TRAINING_HEAD_DIM = 128


def kernel_head_dim_ok(dim: int) -> bool:
    """Head dims the kernels take: powers of two in [16, 256]."""
    return 16 <= dim <= 256 and dim & (dim - 1) == 0


def training_dims_ok(key_dim: int, value_dim: int) -> bool:
    """Head dims the kernels take and have been run forward and backward on a GPU with."""
    return all(kernel_head_dim_ok(d) and d <= MAX_TRAINING_HEAD_DIM for d in (key_dim, value_dim))


def gate_is_bounded(g: Tensor, lower_bound: float | None = None) -> bool:
    """Whether every per-step log-decay is within the span the dense tile path handles: from
    ``lower_bound`` (a floor the caller guarantees for ``g``) when it is within that span, else by
    reading ``g.min()`` (a device-to-host copy, which waits for the queued GPU work)."""
    if lower_bound is not None and lower_bound >= -GATE_SPAN_LIMIT:
        return True
    return bool(g.numel() == 0 or float(g.detach().min()) >= -GATE_SPAN_LIMIT)


def chunk_kda_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    seq_bounds: Sequence[int] | None = None,
    gate_lower_bound: float | None = None,
    segment_chunks: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA on the Triton kernels with q, k, g, beta as given (normalised q/k, log-decay g, beta in (0, 1)).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; states [N, H, K, V]; ``seq_bounds``:
    host boundaries of packed documents (0, ..., T; B must be 1). ``g`` must be a bounded log-decay
    (every step >= -5.5, e.g. the bounded gate with lower bound -5). ``gate_lower_bound``: a floor
    the caller guarantees for ``g`` (not checked); without one, ``g.min()`` is read to check it (a
    device-to-host copy that waits for the queued GPU work). Unbounded gates need the torch backend.
    """
    lens = _check("chunk_kda_triton", q, k, v, g, beta, seq_bounds, initial_state)
    if not gate_is_bounded(g, gate_lower_bound):
        raise ValueError(f"chunk_kda_triton: g reaches {float(g.detach().min()):.3g} < -{GATE_SPAN_LIMIT}; the Triton "
                         "kernels need the bounded gate (lower bound -5); use the torch backend otherwise")
    flags = _Flags(gate_in_kernel=False, l2norm=False, beta_sigmoid=False,
                   scale=q.shape[-1] ** -0.5 if scale is None else float(scale), lower_bound=0.0)
    return _run(q, k, v, g, beta, None, None, initial_state, output_final_state, flags, segment_chunks, lens)
