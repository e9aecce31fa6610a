"""The LM loss's elementwise part on Triton: per-token cross-entropy of logits and, optionally, its
gradient softmax - onehot written over the logits.

Why: the gradient is written over the logits, which nothing reads after it, so a chunk needs one
[4096, 65536] buffer where the compiled PyTorch composition needs two (0.5 GiB less at k3-small's
peak), and nothing is compiled. One pass keeps an online maximum and sum (``cross_entropy_triton``)
and a second writes the gradient. Measured on an H100, it is no faster than the compiled composition
(~0.7 ms a chunk both: the second pass still reads from DRAM, a row being 128 KB with ~1,000 rows in
flight; docs/performance.md §12.20). Triton is imported on first use (``moe_lc.ops.linear_cross_entropy`` is the public entry point: it picks these
kernels or its PyTorch reference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns per block and warps a row: a row is one program, V / BLOCK iterations of each pass.
TUNING = dict(block=4096, warps=8)


def shape_error(logits: Tensor, labels: Tensor) -> Optional[str]:
    """What is wrong with logits [n, V] and integer labels [n] for these kernels (None when nothing is)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or logits.shape[1] == 0:
        return f"logits [n, V] with V > 0 and labels [n], got {tuple(logits.shape)} and {tuple(labels.shape)}"
    if logits.dtype not in DTYPES or labels.dtype not in (torch.int64, torch.int32):
        return f"fp32/bf16/fp16 logits and int64/int32 labels, got {logits.dtype} and {labels.dtype}"
    if logits.stride(1) != 1 or logits.device != labels.device:
        return "logits with contiguous rows, on the labels' device"
    return None


def cross_entropy_rows(logits: Tensor, labels: Tensor, ignore_index: int,
                       grad_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(loss [n] fp32, gradient [n, V] or None): loss_t = logsumexp(z_t) - z_t[y_t], 0 where y_t is
    ``ignore_index``; with ``grad_dtype`` the gradient softmax(z_t) - onehot(y_t) (zero rows where
    ignored), written **over the logits** when ``grad_dtype`` is theirs (the caller hands over a
    buffer it no longer needs), else into a new tensor."""
    import triton

    from moe_lc_kernels import cross_entropy_triton as kt

    problem = shape_error(logits, labels)
    if problem is not None:
        raise ValueError(f"cross_entropy_rows: {problem}")
    n, vocab = logits.shape
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    grad = None
    if grad_dtype is not None:
        grad = logits if grad_dtype == logits.dtype else torch.empty(n, vocab, device=logits.device, dtype=grad_dtype)
    if n:
        block = min(TUNING["block"], triton.next_power_of_2(vocab))
        target = grad if grad is not None else logits
        kt.cross_entropy_rows_kernel[(n,)](logits, labels, loss, target, vocab, logits.stride(0), target.stride(0),
                                           ignore_index, BLOCK=block, WRITE_GRAD=grad is not None,
                                           num_warps=TUNING["warps"])
    return loss, grad
