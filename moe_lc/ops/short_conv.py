"""The KDA short convolution: causal depthwise conv over [B, T, C] (+ SiLU), one dispatch point.

``causal_depthwise_conv`` is the definition (plain PyTorch, any dtype and device); ``short_conv``
picks it or the fused Triton kernels (moe_lc_kernels.short_conv: one pass forward, two backward,
where the reference makes a dozen elementwise passes each way). Packed rows hold several documents
(``docs``: DocumentBounds, or a ``cu_seqlens`` tensor in the FlashAttention convention); the
convolution restarts at each one, exactly as if every document were run alone. Only the device
boundaries are used, so nothing is read back to the host. When ``docs`` carries a context-parallel
shard (``docs.shard``), x is this rank's local row and the convolution takes the halo it needs from
the neighbouring chunks (``moe_lc.parallel.context_conv``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops.backend_choice import choose_backend, triton_device_reason
from moe_lc.ops.documents import DocumentBounds

__all__ = ["position_in_document", "causal_depthwise_conv", "short_conv", "short_conv_pieces", "convolve_at_positions",
           "resolve_backend", "triton_unsupported_reason"]

ACTIVATIONS = (None, "silu")
BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_MAX_WIDTH = 8  # the kernels unroll the taps (moe_lc_kernels.short_conv.MAX_WIDTH)


def position_in_document(seq_len: int, cu_seqlens: Optional[Tensor], device: torch.device) -> Tensor:
    """[T] offset of each token from the start of its document (FlashAttention cu_seqlens convention).

    Computed on ``device`` (searchsorted), so it never waits for the GPU."""
    t = torch.arange(seq_len, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu_seqlens[1:].to(device=device, dtype=torch.long), t, right=True)
    return t - starts[doc]


def causal_depthwise_conv(
    x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor] = None, positions: Optional[Tensor] = None
) -> Tensor:
    """y[t, c] = sum_j weight[c, W-1-j] * x[t-j, c] over taps j that stay inside t's document.

    x: [B, T, C]; weight: [C, W] (last tap multiplies the current token). The reference. The
    documents come from ``cu_seqlens`` or, when given, ``positions`` ([T]: each token's offset
    from its document's start; tap j is used where it is at least j).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    pos = positions if positions is not None else position_in_document(T, cu_seqlens, x.device)
    y = x * weight[:, W - 1]
    for j in range(1, W):
        if j >= T:
            break
        shifted = F.pad(x[:, : T - j], (0, 0, j, 0))
        valid = (pos >= j).to(x.dtype).view(1, T, 1)
        y = y + shifted * valid * weight[:, W - 1 - j]
    return y


def _check(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation, backend) -> None:
    """Shape/argument errors that say what is wrong and how to fix it (no device sync)."""
    if backend not in BACKENDS:
        raise ValueError(f"short_conv: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"short_conv: unknown activation {activation!r}; use 'silu' or None (no activation)")
    if x.dim() != 3:
        raise ValueError(f"short_conv: x must be [B, T, C], got shape {tuple(x.shape)}; "
                         "reshape it to [batch, seq_len, channels]")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"short_conv: weight must be [C, W] with C = x.shape[-1] = {x.shape[-1]} channels and "
                         f"W >= 1 taps, got shape {tuple(weight.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"short_conv: cu_seqlens must be 1-D [N+1] document boundaries (0, ..., T), got "
                             f"shape {tuple(cu_seqlens.shape)}")
        if x.shape[0] != 1:
            raise ValueError(f"short_conv: packed documents (cu_seqlens) need B == 1, got B = {x.shape[0]}; pack "
                             "the rows into one (x.reshape(1, B * T, C)) with boundaries for every document")


def triton_unsupported_reason(x: Tensor, weight: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot take these inputs here, or None when they can."""
    reason = triton_device_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype not in _TRITON_DTYPES or weight.dtype not in _TRITON_DTYPES:
        return f"the kernels take fp32/bf16/fp16 x and weight, got {x.dtype} and {weight.dtype}"
    if weight.shape[1] > _TRITON_MAX_WIDTH:
        return f"the kernels take at most {_TRITON_MAX_WIDTH} taps, got W = {weight.shape[1]}"
    if weight.device != x.device:
        return f"weight is on {weight.device}, x on {x.device}"
    return None


def resolve_backend(x: Tensor, weight: Tensor, backend: str = "auto") -> str:
    """The backend ``short_conv`` runs: "auto" takes Triton only on CUDA (never the slow CPU
    interpreter); an explicit "triton" that cannot run here is an error, not a silent fallback."""
    if backend == "torch":
        return "torch"
    return choose_backend("short_conv", backend, "triton", triton_unsupported_reason(x, weight),
                          auto_takes_fast=x.is_cuda)


def short_conv(
    x: Tensor,
    weight: Tensor,
    docs: DocumentBounds | Tensor | None = None,
    activation: Optional[str] = "silu",
    backend: str = "auto",
) -> Tensor:
    """act(causal_depthwise_conv(x, weight, cu_seqlens)), differentiable in x and weight.

    x: [B, T, C]; weight: [C, W]; docs: DocumentBounds or a cu_seqlens tensor [N+1] (packed
    documents, only with B == 1); activation: "silu" or None. Backends: "torch" (the reference, in
    the dtype torch promotes x and weight to), "triton" (fused kernels, fp32 accumulation, output
    in x's dtype), "auto" (triton for CUDA fp32/bf16/fp16 inputs when installed, torch otherwise).
    """
    if isinstance(docs, DocumentBounds) and docs.shard is not None:
        # imported here: moe_lc.parallel imports the model, which imports this op
        from moe_lc.parallel.context_conv import context_short_conv

        return context_short_conv(x, weight, docs, activation=activation, backend=backend)
    return convolve_at_positions(x, weight, _checked_positions(x, weight, docs, activation, backend), activation,
                                 backend)


def _checked_positions(x: Tensor, weight: Tensor, docs: DocumentBounds | Tensor | None, activation: Optional[str],
                       backend: str) -> Optional[Tensor]:
    """The inputs checked (one local row: no context-parallel shard), and each token's position in its
    document from ``docs`` (None without documents)."""
    cu_seqlens = docs.cu_seqlens if isinstance(docs, DocumentBounds) else docs
    _check(x, weight, cu_seqlens, activation, backend)
    if isinstance(docs, DocumentBounds) and docs.total != x.shape[1]:
        raise ValueError(f"short_conv: the documents (docs) end at {docs.total} but x has T = {x.shape[1]} tokens; "
                         "the last boundary must be the row length")
    return None if cu_seqlens is None else position_in_document(x.shape[1], cu_seqlens, x.device)


def short_conv_pieces(
    x: Tensor,
    weight: Tensor,
    pieces: int,
    docs: DocumentBounds | Tensor | None = None,
    activation: Optional[str] = "silu",
    backend: str = "auto",
) -> tuple[Tensor, ...]:
    """``short_conv(x, weight, docs, activation, backend).chunk(pieces, -1)``: one convolution over
    channels stacked from ``pieces`` equal groups (the KDA layer's q, k, v), handed back per group.

    On the Triton kernels each group is written as its own contiguous tensor and its gradient read
    from there, so the kernels downstream (which take contiguous inputs) copy nothing and no
    concatenation of the groups' gradients runs backward; elsewhere the groups are views of one
    output, as ``chunk`` makes them.
    """
    if isinstance(docs, DocumentBounds) and docs.shard is not None:
        return short_conv(x, weight, docs, activation=activation, backend=backend).chunk(pieces, dim=-1)
    pos = _checked_positions(x, weight, docs, activation, backend)
    if x.shape[-1] % pieces or resolve_backend(x, weight, backend) != "triton":
        return convolve_at_positions(x, weight, pos, activation, backend).chunk(pieces, dim=-1)
    from moe_lc_kernels.short_conv import short_conv_triton_pieces

    return short_conv_triton_pieces(x, weight, pieces, None if pos is None else pos.to(torch.int32),
                                    silu=activation == "silu")


def convolve_at_positions(
    x: Tensor, weight: Tensor, positions: Optional[Tensor], activation: Optional[str], backend: str
) -> Tensor:
    """act(conv(x)) with tap j used where ``positions`` ([T] offsets from each token's document
    start; None: plain causal) is at least j, on the backend :func:`resolve_backend` picks
    (the context-parallel convolution runs its halo windows through it)."""
    _check(x, weight, None, activation, backend)
    if resolve_backend(x, weight, backend) == "torch":
        y = causal_depthwise_conv(x, weight, positions=positions)
        return F.silu(y) if activation == "silu" else y
    from moe_lc_kernels.short_conv import short_conv_triton

    pos = None if positions is None else positions.to(torch.int32)
    return short_conv_triton(x, weight, pos, silu=activation == "silu")
