"""The GLU activations of every expert, shared expert and dense FFN, one dispatch point.

SiTU(a, c) = [b1 tanh(a/b1) * sigmoid(a)] * [b2 tanh(c/b2)] with a = W_gate x, c = W_in x: SwiGLU
to first order near 0 (b tanh(x/b) = x + O(x^3)), but bounded by b1*b2 so that a single outlier
token cannot blow up a layer's output. ``situ_glu_reference`` is the definition (plain PyTorch, any
dtype and device); ``situ_glu`` picks it or the fused Triton kernels (moe_lc_kernels.situ_glu: one
pass forward, one backward, where the reference makes about ten elementwise passes each way).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc_kernels.situ_glu import situ_glu_stacked_backward_triton, situ_glu_stacked_triton, situ_glu_triton

__all__ = ["situ_glu_reference", "situ_glu", "swiglu", "glu_activation", "glu_activation_stacked",
           "glu_activation_stacked_backward",
           "resolve_backend", "triton_unsupported_reason"]

ACTIVATIONS = ("situ", "swiglu")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def situ_glu_reference(a: Tensor, c: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    """Bounded gated activation; a = W_gate x, c = W_in x. The reference."""
    return (beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)) * (beta2 * torch.tanh(c / beta2))


def swiglu(a: Tensor, c: Tensor) -> Tensor:
    return F.silu(a) * c


def triton_unsupported_reason(a: Tensor, c: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs here, or None when they can."""
    reason = triton_device_reason(a.device)
    if reason is not None:
        return reason
    if a.shape != c.shape:
        return f"the kernels take a and c of one shape (no broadcasting), got {tuple(a.shape)} and {tuple(c.shape)}"
    if a.dtype != c.dtype or a.dtype not in _TRITON_DTYPES:
        return f"the kernels take a and c of one dtype among fp32/bf16/fp16, got {a.dtype} and {c.dtype}"
    if a.device != c.device:
        return f"c is on {c.device}, a on {a.device}"
    return None


def resolve_backend(a: Tensor, c: Tensor, backend: str = "auto") -> str:
    """The backend ``situ_glu`` runs: "auto" takes Triton only on CUDA (never the slow CPU interpreter)."""
    return choose_backend("situ_glu", backend, "triton", triton_unsupported_reason(a, c), auto_takes_fast=a.is_cuda)


def situ_glu(a: Tensor, c: Tensor, beta1: float = 4.0, beta2: float = 25.0, backend: str = "auto") -> Tensor:
    """SiTU(a, c), differentiable in a and c.

    Backends: "torch" (the reference, in the dtype torch promotes a and c to), "triton" (fused
    kernels, fp32 math, output in a's dtype; a and c of one shape and dtype), "auto" (triton for
    CUDA fp32/bf16/fp16 inputs when installed, torch otherwise).
    """
    if resolve_backend(a, c, backend) == "torch":
        return situ_glu_reference(a, c, beta1, beta2)
    return situ_glu_triton(a, c, beta1, beta2)


def glu_activation(a: Tensor, c: Tensor, kind: str, beta1: float, beta2: float, backend: str = "auto") -> Tensor:
    """act(a, c) for ``kind`` "situ" (through ``situ_glu`` with ``backend``) or "swiglu"."""
    if kind == "situ":
        return situ_glu(a, c, beta1, beta2, backend)
    if kind == "swiglu":
        return swiglu(a, c)
    raise ValueError(f"unknown GLU activation {kind!r}; use one of {list(ACTIVATIONS)}")


def glu_activation_stacked(y: Tensor, kind: str, beta1: float, beta2: float, backend: str = "auto") -> Tensor:
    """act(a, c) for a, c the first and second halves of y's last dim (one GEMM's output over the
    gate and input weights stacked): the same math as ``glu_activation``; the fused SiTU kernel reads
    both halves in place and writes their gradients into one tensor like y."""
    a, c = y.chunk(2, dim=-1)
    if _stacked_kernel_runs(a, c, kind, backend):
        return situ_glu_stacked_triton(y, beta1, beta2)
    return glu_activation(a, c, kind, beta1, beta2, backend)


def _stacked_kernel_runs(a: Tensor, c: Tensor, kind: str, backend: str) -> bool:
    """Whether the stacked activation runs the fused SiTU kernel: one decision for its forward and
    the backward of a caller that keeps y (``glu_activation_stacked_backward``)."""
    return kind == "situ" and resolve_backend(a, c, backend) == "triton"


def glu_activation_stacked_backward(y: Tensor, dh: Tensor, kind: str, beta1: float, beta2: float,
                                    backend: str = "auto") -> Tensor:
    """dy of ``glu_activation_stacked(y, ...)`` for its output gradient dh, for a caller that keeps y
    and runs its own backward: the fused SiTU backward kernel where the forward ran it, else the
    vector-Jacobian product of the same path."""
    if _stacked_kernel_runs(*y.chunk(2, dim=-1), kind, backend):
        return situ_glu_stacked_backward_triton(y, dh, beta1, beta2)
    # torch.func's vjp, not autograd: it also differentiates inside a custom op's implementation, which
    # runs below autograd
    _, vjp = torch.func.vjp(lambda t: glu_activation_stacked(t, kind, beta1, beta2, backend), y)
    dy, = vjp(dh)
    return dy.contiguous()
