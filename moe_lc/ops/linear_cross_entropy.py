"""Token cross-entropy of a linear head, with its gradients computed in the forward, chunk by chunk.

    loss = sum over tokens t with a label of  logsumexp_v(z_t) - z_t[y_t],   z_t = h_t W_v^T

W_v is the first ``vocab_size`` rows of W: a padded head's other rows take no part in the softmax
and get a zero gradient. Tokens labelled IGNORE_INDEX contribute nothing.

Why: checkpointed chunks (``MoELCModel.chunked_lm_loss``'s other path) run each chunk's head GEMM
twice (forward, then recomputed in backward) and the cross-entropy as eager passes over fp32
copies of the logits. But d loss / d z = softmax(z) - onehot(y) needs nothing that comes later, so
here the forward takes each chunk once: its logits, its loss terms, and at once its gradients
dh_c = dz W_v and dW_v += dz^T h_c (fp32 across chunks). Only dh and dW are kept for backward,
which scales them by the incoming gradient; no logits are kept or recomputed, and the peak is one
chunk's logits and their gradient. Without a gradient to compute (grad mode off, or no input
requiring one) the forward computes the loss only.

Under autocast the GEMMs take their operands in autocast's dtype, as ``F.linear`` would (bf16 GEMMs,
bf16 logits); autocast is off inside an autograd Function's backward and the dtypes are chosen here,
so the chunks run with it disabled. The elementwise part of a chunk (logits and labels to per-token
losses and the logits' gradient) is plain PyTorch (``chunk_loss``, ``chunk_loss_and_grad``): the
reference, run as is on the CPU; backend "compiled" runs it through ``torch.compile`` (once per
chunk shape), which fuses it into one or two kernels reading the bf16 logits (the upcast happens
inside the fused expressions, no fp32 copy of the chunk is written); backend "triton"
(``moe_lc_kernels.cross_entropy``) reads each row once for an online logsumexp and writes the
gradient over the chunk's logits, which nothing else reads ("auto" on CUDA).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from moe_lc.model.precision import upcast
from moe_lc.ops.backend_choice import triton_device_reason
from moe_lc_kernels.cross_entropy import cross_entropy_rows

__all__ = ["IGNORE_INDEX", "chunk_loss", "chunk_loss_and_grad", "linear_cross_entropy", "resolve_backend"]

IGNORE_INDEX = -100  # == moe_lc.model.transformer.IGNORE_INDEX
DEFAULT_CHUNK_TOKENS = 4096


def _loss_terms(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logits in at least fp32, which tokens have a label, the label or 0, logsumexp [n, 1], per-token loss)."""
    x = upcast(logits)
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = x.gather(-1, target.unsqueeze(-1))
    return x, valid, target, lse, torch.where(valid, (lse - picked).squeeze(-1), 0.0)


def chunk_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token cross-entropy [n] of logits [n, V], in at least fp32; 0 where the label is IGNORE_INDEX."""
    return _loss_terms(logits, labels)[-1]


def chunk_loss_and_grad(logits: Tensor, labels: Tensor, grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``chunk_loss`` and its gradient with respect to the logits summed over tokens: softmax - onehot
    (computed in at least fp32, returned in ``grad_dtype``), zero rows where the label is ignored."""
    x, valid, target, lse, loss = _loss_terms(logits, labels)
    onehot = torch.arange(x.shape[-1], device=x.device) == target.unsqueeze(-1)
    grad = torch.where(valid.unsqueeze(-1), torch.exp(x - lse) - onehot.to(x.dtype), 0.0)
    return loss, grad.to(grad_dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for fixed shapes, built on first use (building it imports the compiler)."""
    return torch.compile(fn, dynamic=False)


BACKENDS = ("auto", "torch", "compiled", "triton")


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """"torch" (the eager reference), "compiled" or "triton"; "auto" takes "triton" on CUDA (one H100,
    k3-small's [4096, 65536] chunks: the loss's forward and backward 22.51 against compiled's 22.60 ms,
    0.5 GiB less at the step's peak since the gradient overwrites the logits, no compile;
    docs/performance.md §12.20) and the reference elsewhere (Triton's CPU interpreter is for tests)."""
    if backend not in BACKENDS:
        raise ValueError(f"linear_cross_entropy: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_device_reason(device) is None else "torch"
    if backend == "triton":
        reason = triton_device_reason(device)
        if reason is not None:
            raise RuntimeError(f'linear_cross_entropy: backend "triton" unavailable: {reason}; '
                               'use backend="compiled", "torch" or "auto"')
    return backend


def _triton_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return cross_entropy_rows(logits, labels, IGNORE_INDEX)[0]


def _triton_loss_and_grad(logits: Tensor, labels: Tensor, grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``chunk_loss_and_grad`` on Triton; the gradient overwrites ``logits`` when it takes their dtype."""
    return cross_entropy_rows(logits, labels, IGNORE_INDEX, grad_dtype)


def _kernels(backend: str) -> tuple[Callable, Callable]:
    if backend == "compiled":
        return _compiled(chunk_loss), _compiled(chunk_loss_and_grad)
    if backend == "triton":
        return _triton_loss, _triton_loss_and_grad
    return chunk_loss, chunk_loss_and_grad


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's where it is on for this device (it casts a linear's fp32/bf16/fp16
    operands, never fp64 ones), else the operands' own, which must agree as ``F.linear``'s must."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"linear_cross_entropy: hidden is {hidden.dtype} and weight {weight.dtype} outside autocast; "
                        "give them one dtype (or run under autocast, which casts both)")
    return hidden.dtype


def _chunks(tokens: int, chunk_tokens: int) -> Iterator[slice]:
    for start in range(0, tokens, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, tokens))


def _loss_only(hidden: Tensor, head: Tensor, labels: Tensor, chunk_tokens: int, kernel: Callable) -> Tensor:
    total = hidden.new_zeros((), dtype=torch.promote_types(head.dtype, torch.float32))
    for rows in _chunks(hidden.shape[0], chunk_tokens):
        total = total + kernel(hidden[rows].to(head.dtype) @ head.t(), labels[rows]).sum()
    return total


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b: one GEMM into ``acc`` where the dtypes agree, or where CUDA's GEMM takes bf16/fp16
    operands and adds their product into an fp32 ``acc`` itself (``out_dtype``: the product is not
    rounded to bf16 first, and no [vocab, d] bf16 product is written and read back: 0.5 ms of each
    4K-token chunk at k3-small's 64K x 2048 head); else a GEMM in the operands' dtype added in
    ``acc``'s wider dtype."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed loss; forward computes the gradients too and keeps only them (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, vocab_size: int, chunk_tokens: int,
                dtype: torch.dtype, kernel: Callable) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[:2]
        head = weight[:vocab_size].to(dtype)
        total = hidden.new_zeros((), dtype=torch.promote_types(dtype, torch.float32))
        dh = torch.empty_like(hidden) if want_h else None
        dw = weight.new_zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32)) if want_w else None
        dw_head = dw[:vocab_size] if dw is not None else None  # the padding rows' gradient stays zero
        for rows in _chunks(hidden.shape[0], chunk_tokens):
            h_c = hidden[rows].to(dtype)
            loss_c, dz = kernel(h_c @ head.t(), labels[rows], dtype)
            total = total + loss_c.sum()
            if dh is not None:
                dh[rows] = dz @ head
            if dw_head is not None:
                _accumulate(dw_head, dz.t(), h_c)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        dh, dw = ctx.saved_tensors
        # Scaled out of place: a pipeline's split backward (zero-bubble schedules) runs this node twice,
        # once for the input's gradient and once for the weight's, so the kept buffers must stay as they are.
        grad_h = dh * grad_total if dh is not None else None
        grad_w = (dw * grad_total).to(ctx.weight_dtype) if dw is not None else None
        return grad_h, grad_w, None, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    vocab_size: Optional[int] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """Cross-entropy of the logits ``hidden @ weight[:vocab_size].T`` against ``labels``, without keeping them.

    ``hidden`` [..., d], ``labels`` [...] (IGNORE_INDEX: no target), ``weight`` [rows, d] with rows >=
    ``vocab_size`` (default: all rows). ``reduction``: "mean" over the tokens with a label (0, with a zero
    gradient, when there is none, where ``F.cross_entropy`` gives NaN) or "sum". The loss is in at least
    fp32. ``chunk_tokens``: tokens per chunk (the peak holds [chunk_tokens, vocab_size] logits).
    ``backend``: "torch", "compiled", "triton" or "auto" (see ``resolve_backend``).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 < vocab_size <= weight.shape[0] or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} does not fit hidden "
                         f"{tuple(hidden.shape)} with vocab_size {vocab_size}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must be hidden's {tuple(hidden.shape[:-1])}")
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    loss_kernel, grad_kernel = _kernels(resolve_backend(hidden.device, backend))
    dtype = _compute_dtype(hidden, weight)
    chunk_tokens = max(1, chunk_tokens)
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            total = _LinearCrossEntropy.apply(h, weight, y, vocab_size, chunk_tokens, dtype, grad_kernel)
        else:
            total = _loss_only(h, weight[:vocab_size].to(dtype), y, chunk_tokens, loss_kernel)
    if reduction == "sum":
        return total
    return total / (y != IGNORE_INDEX).sum().clamp_min(1)
