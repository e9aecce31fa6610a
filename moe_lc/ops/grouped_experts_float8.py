"""The routed experts' three grouped GEMMs in float8 (``float8.experts=true`` under ``precision=fp8``).

The same math as ``grouped_glu_mm`` (``moe_lc.ops.grouped_experts``), with each grouped GEMM
replaced by torchao's row-wise float8 grouped GEMM (operands scaled per row and cast to e4m3 on
the fly, then ``torch._scaled_grouped_mm``; its backward quantizes the gradients the same way).
That GEMM wants every expert's rows to be a multiple of 16, and the router gives any counts, so
the rows are first spread into groups padded with zero rows:

    expert e's rows [o_{e-1}, o_e) move to [p_{e-1}, p_{e-1} + n_e), p_e = p_{e-1} + ceil16(n_e)

all on the device (no host read of the counts). The padded buffer has a fixed size, rows + E x 15
rounded up to 16, so its shape never depends on the routing; the slack after the last expert's
rows joins the last group, so every row belongs to a group and none is left unwritten. Zero rows
contribute nothing to the weight gradients, and the output keeps only the real rows.

Weights go to the GEMM in their own dtype (fp32 master weights are scaled from fp32: no bf16
copy of the stacked weights is made); the activations in bf16.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

GROUP_ROWS = 16  # torch._scaled_grouped_mm: each group's rows a multiple of 16
DIM_MULTIPLE = 16  # and both weight dimensions

GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x [rows, k], w_t [E, k, n], ends [E] int32) -> [rows, n]


def pad_groups(x: Tensor, ends: Tensor, multiple: int = GROUP_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """(x spread into groups padded to ``multiple`` rows, their int32 ends, each real row's new index).

    ``ends``: int32 [E] cumulative row counts (``expert_offsets``), on x's device."""
    rows, experts = x.shape[0], ends.shape[0]
    ends = ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends = ((counts + multiple - 1) // multiple * multiple).cumsum(0)
    total = -(-(rows + experts * (multiple - 1)) // multiple) * multiple  # fixed: any routing fits
    padded_ends = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), total)])  # the slack joins the last group
    padded_starts = torch.cat([padded_ends.new_zeros(1), padded_ends[:-1]])
    row = torch.arange(rows, device=x.device)
    expert = torch.searchsorted(ends, row, right=True)  # the expert of each row: ends are exclusive
    new_index = row - (ends - counts)[expert] + padded_starts[expert]
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, new_index, x)
    return padded, padded_ends.to(torch.int32), new_index


def padded_grouped_glu(x: Tensor, ends: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor,
                       act: Callable[[Tensor, Tensor], Tensor], gmm: GroupedMM,
                       multiple: int = GROUP_ROWS) -> Tensor:
    """``act(x W_gate[e]^T, x W_in[e]^T) W_out[e]^T`` per expert through ``gmm`` on padded groups."""
    padded, padded_ends, new_index = pad_groups(x.contiguous(), ends, multiple)
    a = gmm(padded, w_gate.transpose(-2, -1), padded_ends)
    c = gmm(padded, w_in.transpose(-2, -1), padded_ends)
    return gmm(act(a, c).contiguous(), w_out.transpose(-2, -1), padded_ends).index_select(0, new_index)


@functools.cache
def float8_grouped_mm() -> GroupedMM:
    """torchao's row-wise float8 grouped GEMM (bf16 out), as a ``GroupedMM``."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    def gmm(x: Tensor, w_t: Tensor, ends: Tensor) -> Tensor:
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w_t, ends, out_dtype=torch.bfloat16,
                                                      pad_token_groups_for_grouped_mm=False)
    return gmm


def float8_unsupported_reason(x: Tensor, w_gate: Tensor) -> Optional[str]:
    """Why the float8 grouped GEMM cannot run these operands here, or None."""
    if not x.is_cuda:
        return f"the float8 grouped GEMM runs on CUDA GPUs with FP8 tensor cores; x is on {x.device}"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "the float8 grouped GEMM (torch._scaled_grouped_mm) needs compute capability 9.0+ (H100/H200)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        float8_grouped_mm()
    except ImportError as err:
        return f"torchao's float8 grouped GEMM did not import ({err}); pip install 'moe-lc[fp8]'"
    hidden, width = w_gate.shape[1], w_gate.shape[2]
    if hidden % DIM_MULTIPLE or width % DIM_MULTIPLE:
        return f"the float8 grouped GEMM needs expert dimensions divisible by {DIM_MULTIPLE}, got {width} x {hidden}"
    return None


def float8_grouped_glu(x: Tensor, ends: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor,
                       act: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """The experts' GLU with float8 grouped GEMMs; x in bf16 (cast if it is not), weights as they are."""
    reason = float8_unsupported_reason(x, w_gate)
    if reason is not None:
        raise RuntimeError(f"grouped_glu: backend \"float8\" unavailable: {reason}; use float8.experts=false")
    return padded_grouped_glu(x.to(torch.bfloat16), ends, w_gate, w_in, w_out, act, float8_grouped_mm())
