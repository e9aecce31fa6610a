"""Fused AttnRes depth mixture on Triton: autograd Function and launches.

h = sum_i a_i v_i with a = softmax_i(w . (g * v_i / rms(v_i))) over S sources v_i [..., D].
Forward: one kernel writes h once; it keeps only the sources (which the residual stream holds
anyway) and the mixture weights and inverse rms, fp32 [S, N]. Backward: one kernel writes every
source gradient once and per-program partial sums of the query's and the gain's [D] gradient,
summed here in torch (deterministic, no atomics). Each pass has two kernels: a resident one that
holds whole rows in registers and reads every source (and the output gradient) once, for rows of
up to ``*_resident_max_d`` columns, and a tiled one for any width, which walks a row in tiles and
reads it twice (its statistics, then the mixture or the gradients; the second read from L2).
The unfused composition makes a dozen passes over [tokens, D] per source each way. With
``out_norm`` the same kernels also apply the RMSNorm that reads the mixture (the sublayer's
pre-norm): the forward writes the normalised mixture in place of h (re-reading h from L2) and keeps
one fp32 inverse rms per token; the backward recomputes h in its tiles instead of reading it, so
the unfused norm's passes over h and its gradient, and the stored h, are gone. Triton is
imported on first use, so this module imports without it (moe-lc's ``depth_mixture`` op is the
public entry point: it checks the inputs and picks these kernels or its PyTorch reference).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from moe_lc_kernels.tuning import parse_launch_choices

# The kernels unroll over the sources (one tuple argument of S pointers, depth_mixture_triton.py):
# code size and compile time grow with S. 32 covers block mode and "full" mode up to 15 layers.
MAX_SOURCES = 32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch choices, per pass: ROWS rows of BLOCK_D columns per tile and program, and warps. With
# BLOCK_D = 256 and ROWS = warps a warp owns one row of a tile (bf16: 16 bytes a lane), so the
# reductions per tile and source stay within the warp (no barrier). Compiled for sm_90 with
# Triton 3.6, 4 x 256 at 4 warps took 64 (fwd) and 128 (bwd) registers at S = 7 and 96 / 168 at
# S = 10, without spills; only the backward at S = 32 spilled (144 bytes); one row at one warp
# takes fewer.
# ``l2_budget``: the bytes of rows in flight between a row's two reads that the grid is sized for:
# programs = l2_budget / (ROWS x a row's bytes over the sources, and the gradient in the
# backward), at least one per SM, against an H200's 50 MB L2. The bytes in flight are then about
# l2_budget x BLOCK_D / D, so a wide D wants a larger BLOCK_D. ``programs`` overrides the grid
# (None: from the budget). Measured on one H200 (benchmarks/bench_depth_mixture.py, 16384 x 2048,
# forward + backward, S = 4 / 7): one row and one warp per program 0.652 / 1.144 ms; four rows
# and four warps 0.918 / 1.551 (2 and 2: 0.751 / 1.397; 8 and 8: 1.023 / 1.633); four rows with
# a fixed grid of 1,056 programs 0.832 / 1.074, with a 64 MiB budget 0.828 / 1.314, 20 MiB
# 1.196 / 2.064; the compiled PyTorch reference 1.012 / 1.699 (docs/performance.md §12.3).
# ``{fwd,bwd}_resident_max_d``: rows of at most this many columns (rounded up to a power of two) run
# that pass's resident kernel instead (ROWS whole rows of every tensor in registers, each read from
# memory once; 0: never), at ``*_resident_cols_per_warp`` columns a warp and ``*_resident_per_sm``
# programs an SM. Measured on one H100 (docs/performance.md §12.17): k3-small's step at 8 of its 20
# layers 2.8% faster with both passes resident at two programs an SM than tiled (1.411 against
# 1.452 s); alone (bench_depth_mixture.py --pre-norm, 16,384 x 2,048 bf16, S = 2 / 3 / 4) the
# backward took 1.008 / 0.984 / 0.624 ms tiled, 0.833 / 0.699 / 0.540 resident.
# ``resident_max_values``: at most this many fp32 values a thread over the sources (S x ROWS x BLOCK /
# (32 x warps)); where more, a launch of more than 256 columns a warp spreads the row over twice the
# warps at half the programs an SM, and at 256 (8 values a source) the tiled kernels take it. Compiled for sm_90 (Triton 3.9, d 2048: 8
# values a thread and source), neither resident kernel spills up to S = 10 and both do from S = 12.
TUNING = dict(fwd_rows=1, fwd_block_d=256, fwd_warps=1, bwd_rows=1, bwd_block_d=256, bwd_warps=1,
              l2_budget=40 << 20, programs=None, resident_max_values=80,
              fwd_resident_max_d=4096, fwd_resident_rows=1, fwd_resident_cols_per_warp=512, fwd_resident_per_sm=4,
              fwd_resident_prefetch=0,
              bwd_resident_max_d=4096, bwd_resident_rows=1, bwd_resident_cols_per_warp=256, bwd_resident_per_sm=2,
              bwd_resident_prefetch=0, fwd_resident_maxnreg=128, bwd_resident_maxnreg=128)
# ``*_resident_maxnreg``: a cap on a resident kernel's registers a thread (0: the compiler's choice), so that
# more programs fit an SM. The forward at 4 warps a row of d 2048 and four programs an SM (5 sources
# at most, capped at 128 registers so that four fit: 145 uncapped at 5, 18 spill instructions capped;
# 6 and 7 take 8 warps at two, as before), the backward capped at 128 registers (it took 164-202
# from 4 sources, one 8-warp program an SM; at 128, no spills at 4 sources, 12-26 spill instructions at 5-6):
# on one H100, k3-small at 11 layers, with SiTU's backward at 1024 x 8, 1.840 s a step against 1.859
# (-1.0%, two rounds; docs/performance.md §12.25); alone, 4 sources, forward 0.139 ms against 0.197 and
# backward 0.258 against 0.375.
# MOE_LC_DEPTH_MIXTURE_TUNING="key=value,..." overrides (a choice tried in a whole step: benchmarks/bench_ab.py;
# programs=0 sizes the grid as None does).
TUNING.update(parse_launch_choices(os.environ.get("MOE_LC_DEPTH_MIXTURE_TUNING", ""), TUNING, "depth mixture"))
if TUNING["programs"] == 0:
    TUNING["programs"] = None


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA: Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _resident_shape(N: int, D: int, S: int, device: torch.device, prefix: str) -> Optional[tuple[int, int, int, int]]:
    """(programs, ROWS, BLOCK, warps) of a pass's resident kernel where S sources of a row fit it
    (``*_resident_max_d``, ``resident_max_values``), else None."""
    import triton

    block = triton.next_power_of_2(D)
    if block > TUNING[f"{prefix}_resident_max_d"]:
        return None
    rows = TUNING[f"{prefix}_resident_rows"]
    warps = max(1, min(16, rows * block // TUNING[f"{prefix}_resident_cols_per_warp"]))
    per_sm = TUNING[f"{prefix}_resident_per_sm"]
    while S * rows * block > TUNING["resident_max_values"] * 32 * warps and rows * block // (2 * warps) >= 256:
        warps, per_sm = 2 * warps, max(1, per_sm // 2)
    if S * rows * block > TUNING["resident_max_values"] * 32 * warps:
        return None
    programs = TUNING["programs"]
    if programs is None:
        programs = _sm_count(device) * per_sm
    return max(1, min(programs, triton.cdiv(N, rows))), rows, block, warps


def _register_cap(prefix: str) -> dict:
    """The resident kernel's ``maxnreg`` launch option where ``*_resident_maxnreg`` sets one."""
    cap = TUNING[f"{prefix}_resident_maxnreg"]
    return {"maxnreg": cap} if cap else {}


def _launch_shape(N: int, D: int, row_bytes: int, device: torch.device, prefix: str) -> tuple[int, int, int, int]:
    """(programs, ROWS, BLOCK_D, warps) for a launch: BLOCK_D shrunk to the next power of two of a
    small D, the grid from the L2 budget (module comment) and never more than the row blocks."""
    import triton

    rows, warps = TUNING[f"{prefix}_rows"], TUNING[f"{prefix}_warps"]
    block_d = min(TUNING[f"{prefix}_block_d"], triton.next_power_of_2(D))
    programs = TUNING["programs"]
    if programs is None:
        programs = max(_sm_count(device), TUNING["l2_budget"] // (rows * row_bytes))
    return max(1, min(programs, triton.cdiv(N, rows))), rows, block_d, warps


def _row_bytes(D: int, tensors) -> int:
    """Bytes of one row across ``tensors`` (all [.., D])."""
    return D * sum(t.element_size() for t in tensors)


class GradientSum:
    """One source's gradient summed over the depth mixtures that read it, by their backward kernels
    (each adds its share to the sum as it writes it), where autograd would add every mixture's
    gradient into the sum in a pass of its own: one read, add and write of [tokens, D] per reader.

    The first mixture to read a source in the forward is the last to run backward: every later
    reader reads something computed from the first one's output (the residual stream's next
    partial sum, or a block sum that contains it), so autograd cannot run the first one's backward
    before theirs. The first reader hands the sum to autograd as the source's gradient; the others
    add into it and hand autograd nothing for that source. A recompute under activation
    checkpointing claims nothing new: the backward runs the forward's own nodes.

    ``seed``: a gradient of the source from outside the mixtures (the residual stream's next partial
    sum, ``add_to_partial_sum``), which the next reader to run backward adds into its share in its
    kernel and then drops, where autograd would add it to the sum in a pass of its own. Not ours to
    write: the kernel reads it and writes the sum elsewhere.
    """

    def __init__(self) -> None:
        self.claimed = False
        self.handed_over = False
        self.total: Optional[Tensor] = None
        self.seed: Optional[Tensor] = None

    def claim(self) -> bool:
        """True for the source's first reader (the one that hands the sum to autograd)."""
        first = not self.claimed
        self.claimed = True
        return first

    def takes_seed(self) -> bool:
        """Whether a reader that sums in its kernel is still to run backward (so a seed is not lost)."""
        return self.claimed and not self.handed_over and self.seed is None


class _PartialSumAdd(torch.autograd.Function):
    """partial + f, whose backward hands the partial's gradient to the partial's mixture as a seed
    (``GradientSum.seed``) when one of its readers sums in its kernel, instead of to autograd."""

    @staticmethod
    def forward(ctx, partial: Tensor, f: Tensor, total: GradientSum) -> Tensor:
        ctx.total = total
        return partial + f

    @staticmethod
    def backward(ctx, grad: Tensor):
        total = ctx.total
        if ctx.needs_input_grad[0] and total.takes_seed() and grad.is_contiguous():
            total.seed = grad
            return None, grad, None
        return grad, grad, None


def add_to_partial_sum(partial: Tensor, f: Tensor, total: GradientSum) -> Tensor:
    """partial + f (same shape and dtype), where ``total`` is the partial's :class:`GradientSum`: its
    gradient is then added in the partial's mixture's backward kernel, not by autograd."""
    if partial.shape != f.shape or partial.dtype != f.dtype or not torch.is_grad_enabled():
        return partial + f
    return _PartialSumAdd.apply(partial, f, total)


class _DepthMixtureFunction(torch.autograd.Function):
    """The mixture, or with ``out_gain`` the pre-norm of the mixture: out_gain * h^ / rms(h^) (h^ the
    mixture rounded to the output dtype), where h itself is neither written to memory nor kept."""

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, eps: float, sums: Optional[tuple],
                out_gain: Optional[Tensor], out_eps: float, *sources: Tensor) -> Tensor:
        from moe_lc_kernels import depth_mixture_triton as kt

        shape, D, S = sources[0].shape, sources[0].shape[-1], len(sources)
        N = sources[0].numel() // D
        out_dtype = sources[0].dtype
        for v in sources[1:]:
            out_dtype = torch.promote_types(out_dtype, v.dtype)
        device = sources[0].device
        h = torch.empty(shape, device=device, dtype=out_dtype)
        a = torch.empty(S, N, device=device, dtype=torch.float32)
        row_stats = torch.empty(2 * S, N, device=device, dtype=torch.float32)  # r_i, then the logits r_i (w . v_i)
        norm = out_gain is not None
        rho = torch.empty(N, device=device, dtype=torch.float32) if norm else None
        # without NORM the kernels never touch gamma and rho: any tensor stands in for them
        args = (tuple(sources), _folded_query(query, norm_weight), h, a, row_stats, out_gain if norm else a,
                rho if norm else a, N, D, eps, out_eps)
        resident = _resident_shape(N, D, S, device, "fwd")
        if resident is not None:
            programs, rows, block, warps = resident
            kt.depth_mixture_fwd_resident_kernel[(programs,)](*args, S=S, ROWS=rows, BLOCK=block, NORM=norm,
                                                              PREFETCH=bool(TUNING["fwd_resident_prefetch"]),
                                                              num_warps=warps, **_register_cap("fwd"))
        else:
            programs, rows, block_d, warps = _launch_shape(N, D, _row_bytes(D, sources), device, "fwd")
            kt.depth_mixture_fwd_kernel[(programs,)](*args, S=S, ROWS=rows, BLOCK_D=block_d, NORM=norm,
                                                     num_warps=warps)
        ctx.save_for_backward(query, norm_weight, a, row_stats, out_gain if norm else None, rho, *sources)
        ctx.sums = sums
        ctx.hands_over = None if sums is None else tuple(total.claim() for total in sums)
        return h

    @staticmethod
    def backward(ctx, grad: Tensor):
        from moe_lc_kernels import depth_mixture_triton as kt

        query, norm_weight, a, row_stats, out_gain, rho, *sources = ctx.saved_tensors
        S, N = a.shape
        D = sources[0].shape[-1]
        grad = grad.contiguous()
        sums = ctx.sums or (None,) * S
        # each source's gradient goes into the sum so far (added in place), or a new tensor, plus a seed if any
        dsources, seeds, add_to = [], [], 0
        for i, (v, total) in enumerate(zip(sources, sums)):
            so_far = None if total is None else total.total
            seed = None if total is None or not ctx.needs_input_grad[6 + i] else total.seed
            if seed is not None:
                total.seed = None
                if so_far is not None:  # the kernel adds one tensor: fold the seed into the sum first
                    so_far.add_(seed)
                    seed = None
            addend = so_far if so_far is not None else seed
            dsources.append(torch.empty_like(v) if so_far is None else so_far)
            seeds.append(dsources[-1] if addend is None else addend)  # read only where bit i of ADD_TO is set
            add_to |= (addend is not None) << i
        dsources, seeds = tuple(dsources), tuple(seeds)
        norm = out_gain is not None
        resident = _resident_shape(N, D, S, grad.device, "bwd")
        if resident is not None:  # each program writes its rows of the partial sums whole
            programs, rows, block, warps = resident
            part = torch.empty(programs, D, device=grad.device, dtype=torch.float32)
            part2 = torch.empty_like(part) if norm else part
        else:  # each program adds into its rows of the partial sums
            programs, rows, block_d, warps = _launch_shape(N, D, _row_bytes(D, [grad, *sources]), grad.device, "bwd")
            part = torch.zeros(programs, D, device=grad.device, dtype=torch.float32)
            part2 = torch.zeros(programs, D, device=grad.device, dtype=torch.float32) if norm else part
        args = (tuple(sources), dsources, seeds, grad, _folded_query(query, norm_weight), a, row_stats, part,
                out_gain if norm else part, rho if norm else a, part2, N, D)
        if resident is not None:
            kt.depth_mixture_bwd_resident_kernel[(programs,)](*args, S=S, ROWS=rows, BLOCK=block, ADD_TO=add_to,
                                                              NORM=norm, PREFETCH=bool(TUNING["bwd_resident_prefetch"]),
                                                              num_warps=warps, **_register_cap("bwd"))
        else:
            kt.depth_mixture_bwd_kernel[(programs,)](*args, S=S, ROWS=rows, BLOCK_D=block_d, ADD_TO=add_to, NORM=norm,
                                                     num_warps=warps)
        weighted = part.sum(0)  # sum over tokens and sources of dl_i u_i
        d_query = (weighted * norm_weight.float()).to(query.dtype) if ctx.needs_input_grad[0] else None
        d_norm = (weighted * query.float()).to(norm_weight.dtype) if ctx.needs_input_grad[1] else None
        d_gain = part2.sum(0).to(out_gain.dtype) if norm and ctx.needs_input_grad[4] else None
        grads = []
        for i, dv in enumerate(dsources):
            total = sums[i]
            if not ctx.needs_input_grad[6 + i]:
                grads.append(None)
            elif total is None or ctx.hands_over[i]:  # the sum, complete: autograd takes it from here
                if total is not None:
                    total.total, total.handed_over = None, True
                grads.append(dv)
            else:  # a later reader: its share stays in the sum for the first reader to hand over
                total.total = dv
                grads.append(None)
        return d_query, d_norm, None, None, d_gain, None, *grads


def _folded_query(query: Tensor, norm_weight: Tensor) -> Tensor:
    """w = g * query in fp32, [D]: the logits are r_i (w . v_i)."""
    return (norm_weight.float() * query.float()).contiguous()


def depth_mixture_triton(sources: list[Tensor], query: Tensor, norm_weight: Tensor, eps: float,
                         sums: Optional[Sequence[GradientSum]] = None,
                         out_norm: Optional[tuple[Tensor, float]] = None) -> Tensor:
    """sum_i a_i v_i, a = softmax_i(query . (norm_weight * v_i / rms(v_i))), over the last dim.

    ``sums``: one :class:`GradientSum` per source, shared by every mixture that reads that source
    (the residual stream keeps them), so that the backward kernels sum each source's gradient
    themselves; None: every mixture returns its own share to autograd.
    ``out_norm``: (gain [D], eps) of an RMSNorm applied to the mixture in the same kernels (the
    sublayer's pre-norm): the result is gain * h / rms(h), h rounded to the output dtype first as a
    stored h would be, and differentiable in the gain too; h is never written or kept.

    Sources of one shape [..., D] and device, each fp32/bf16/fp16 (they may differ); output in
    their promoted dtype, each source's gradient in its own dtype; fp32 math. Differentiable in
    the sources, ``query`` and ``norm_weight`` ([D] each). Use ``moe_lc.ops.depth_mixture``, which
    picks this or the reference.
    """
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"depth_mixture_triton: 1 to {MAX_SOURCES} sources, got {len(sources)}")
    first = sources[0]
    for v in sources:
        if v.shape != first.shape or v.device != first.device or v.dtype not in DTYPES:
            raise ValueError(f"depth_mixture_triton: sources must share shape and device and be fp32/bf16/fp16, "
                             f"got {tuple(v.shape)} {v.dtype} {v.device} next to {tuple(first.shape)} {first.device}")
    D = first.shape[-1]
    out_gain, out_eps = out_norm if out_norm is not None else (None, 0.0)
    for p in (query, norm_weight) if out_gain is None else (query, norm_weight, out_gain):
        if p.shape != (D,) or p.device != first.device or p.dtype not in DTYPES:
            raise ValueError(f"depth_mixture_triton: query, norm_weight and the out_norm gain must be fp32/bf16/fp16 "
                             f"[{D}] on {first.device}, got {p.dtype} {tuple(p.shape)} on {p.device}")
    if first.numel() == 0:  # nothing to launch: an empty mixture that autograd connects to every input
        scale = (query * norm_weight).sum() * (1 if out_gain is None else out_gain.sum())
        return sum(v * scale for v in sources)
    # contiguous() copies only a source whose rows are not dense [N, D] (the residual stream's always are)
    if sums is not None and len(sums) != len(sources):
        raise ValueError(f"depth_mixture_triton: {len(sums)} gradient sums for {len(sources)} sources; pass one per source")
    return _DepthMixtureFunction.apply(query, norm_weight, float(eps), None if sums is None else tuple(sums),
                                       out_gain, float(out_eps), *(v.contiguous() for v in sources))
