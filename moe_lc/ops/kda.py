r"""Kimi Delta Attention (KDA): gate, token-by-token reference and chunkwise form (docs/design.md §2.5-§2.6).

Per head the state S (K x V) evolves as

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,     o_t = scale * S_t^T q_t

with a per-key-channel log-decay g_t <= 0 and b_t = beta_t in (0, 1). q and k are used as given
(the layer L2-normalises them).

How the chunk form follows from the recurrence
----------------------------------------------
Take one chunk of C tokens, entered with state S. Write G_i for the cumulative log-decay from the
chunk start through token i (a vector over key channels) and Gamma_i = exp(G_i). Expanding one step,

    S_i = D_i S_{i-1} + k_i d_i^T,      d_i = b_i (v_i - (D_i S_{i-1})^T k_i),     D_i = Diag(exp(g_i)),

so the state is the entering state decayed, plus every earlier rank-one write decayed since it
was made:

    S_i = Diag(Gamma_i) S + sum_{j <= i} Diag(Gamma_i / Gamma_j) k_j d_j^T.

Putting this (for S_{i-1}) into d_i gives a triangular system for the "deltas" d:

    d_i + b_i sum_{j < i} (k_i^T Diag(Gamma_i / Gamma_j) k_j) d_j = b_i (v_i - S^T (Gamma_i * k_i)),

i.e. (I + L) Delta = Diag(b) (V - (Gamma*K) S) with L = StrictTril(Diag(b) (Gamma*K)(K/Gamma)^T).
With M = (I + L)^{-1} Diag(b) (the WY/UT transform), W = M (Gamma*K) and U = M V:

    Delta = U - W S                                   (W, U do not depend on S)
    O     = scale * [(Gamma*Q) S + Tril((Gamma*Q)(K/Gamma)^T) Delta]
    S'    = Diag(Gamma_C) S + (Gamma_C / Gamma * K)^T Delta.

All chunks' L, W, U and the causal score matrix are computed at once; only the last three lines
run in a loop over chunks. Decay ratios Gamma_i / Gamma_j are evaluated as exponentials of
same-sign partial sums of g, never as a product with 1/Gamma (see ``_kda_chunk``).

Packed documents (``docs``: :class:`moe_lc.ops.documents.DocumentBounds`, or a plain ``cu_seqlens``
tensor in the FlashAttention convention) are independent sequences: the state restarts from the
document's initial state (or zero) at every boundary.

Backends: :func:`chunk_kda` dispatches on ``backend``; ``"torch"`` is the reference here,
``"triton"`` (moe_lc_kernels) and ``"fla"`` (flash-linear-attention) run on CUDA when installed,
and ``"auto"`` picks the first of triton, fla, torch that supports the inputs (triton measured
faster than fla at every benchmark shape on an H200, docs/performance.md).
Fast kernels plug in with :func:`register_kda_backend`. A layer that has the raw projections
calls :func:`moe_lc.ops.kda_projections.chunk_kda_from_projections` instead, which fuses the
L2 norm, the gate and beta's sigmoid into the kernels.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_lc.ops._kda_chunk import chunk_kda_torch
from moe_lc.ops.documents import DocumentBounds, as_document_bounds

__all__ = [
    "kda_gate",
    "recurrent_kda",
    "chunk_kda",
    "register_kda_backend",
    "available_kda_backends",
]


# ----------------------------------------------------------------------------- gate
def kda_gate(
    z: Tensor,
    A_log: Tensor,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = -5.0,
) -> Tensor:
    """Per-channel log-decay g from the decay logit z (``[..., H, K]``), computed in fp32.

    Bounded (default): ``g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias))``, kept strictly
    inside ``(lower_bound, 0)`` even where the sigmoid saturates, so per-tile decay spans stay
    finite. ``lower_bound=None``: the softplus gate ``g = -exp(A_log) * softplus(z + dt_bias)``.
    ``A_log`` is ``[H]``; ``dt_bias`` is ``[H*K]``, ``[H, K]`` or None. fp64 z stays fp64.
    """
    if z.dim() < 2:
        raise ValueError(f"kda_gate: z must be [..., H, K], got shape {tuple(z.shape)}")
    heads, key_dim = z.shape[-2:]
    if A_log.shape != (heads,):
        raise ValueError(f"kda_gate: A_log must have shape [H]=[{heads}], got {tuple(A_log.shape)}")
    compute = torch.float64 if z.dtype == torch.float64 else torch.float32
    x = z.to(compute)
    if dt_bias is not None:
        if dt_bias.numel() != heads * key_dim or dt_bias.shape not in ((heads * key_dim,), (heads, key_dim)):
            raise ValueError(
                f"kda_gate: dt_bias must have shape [H*K]=[{heads * key_dim}] or [H, K]=[{heads}, {key_dim}], "
                f"got {tuple(dt_bias.shape)}"
            )
        x = x + dt_bias.to(compute).reshape(heads, key_dim)
    rate = A_log.to(compute).exp()[:, None]
    if lower_bound is None:
        return -rate * F.softplus(x)
    if not lower_bound < 0:
        raise ValueError(f"kda_gate: lower_bound must be negative (e.g. -5.0) or None, got {lower_bound}")
    finfo = torch.finfo(compute)
    # Largest value below 1 and smallest normal: sigmoid saturates to exactly 0 or 1 otherwise.
    fraction = torch.sigmoid(rate * x).clamp(min=finfo.tiny, max=1.0 - finfo.eps / 2)
    return lower_bound * fraction


# ----------------------------------------------------------------------------- validation
def _validate(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    docs: DocumentBounds | None,
) -> int:
    """Check shapes and return the number of sequences N (the leading dim of the states)."""
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch, seq_len, heads, key_dim = q.shape
    for label, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name}: {label} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] = [{batch}, {seq_len}, {heads}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"{name}: beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    for label, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise TypeError(f"{name}: {label} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: {label} is on {t.device} but q is on {q.device}; move them to one device")
    if seq_len == 0:
        raise ValueError(f"{name}: sequences must have at least one token (T=0)")

    num_seqs = batch
    if docs is not None:  # DocumentBounds checked the boundaries themselves
        if batch != 1:
            raise ValueError(f"{name}: with packed documents (docs) the documents are packed in one row, so B must "
                             f"be 1 (got B={batch}); flatten the batch into [1, B*T, ...]")
        if docs.total != seq_len:
            raise ValueError(f"{name}: the documents (docs) end at {docs.total} but T={seq_len}; the last "
                             "boundary must be the row length")
        num_seqs = docs.num_docs

    if initial_state is not None:
        expected = (num_seqs, heads, key_dim, v.shape[-1])
        if initial_state.shape != expected:
            what = "documents" if docs is not None else "sequences"
            raise ValueError(
                f"{name}: initial_state must be [N, H, K, V] = {expected} (N = number of {what}), "
                f"got {tuple(initial_state.shape)}"
            )
    return num_seqs


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- recurrence
def _recurrence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The defining token loop for one batch of independent sequences ([B, T, H, *])."""
    outputs = []
    for t in range(q.shape[1]):
        k_t = k[:, t]
        state = g[:, t].exp()[..., None] * state
        prediction = torch.einsum("bhk,bhkv->bhv", k_t, state)
        correction = beta[:, t, :, None] * (v[:, t] - prediction)
        state = state + k_t[..., :, None] * correction[..., None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    docs: DocumentBounds | Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA by its definition, one token at a time (the reference; slow, use for checks only).

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; states ``[N, H, K, V]``
    with N = B, or N documents when ``docs`` (DocumentBounds, or a ``cu_seqlens`` tensor ``[N+1]``
    read once; B must be 1) packs them in one row.
    Returns ``(o [B, T, H, V] in q's dtype, final_state or None)``; computes in fp32 (fp64 for
    fp64 q); the final state is returned in the compute dtype.
    """
    docs = as_document_bounds(docs)
    if docs is not None and docs.shard is not None:
        raise ValueError("recurrent_kda: the reference runs one whole row in one process, not a context-parallel "
                         "shard; pass the unsharded documents and the full row")
    num_seqs = _validate("recurrent_kda", q, k, v, g, beta, initial_state, docs)
    heads, key_dim, value_dim = q.shape[2], q.shape[3], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    compute = _compute_dtype(q)
    qc, kc, vc, gc, bc = (t.to(compute) for t in (q, k, v, g, beta))
    if initial_state is None:
        states = qc.new_zeros(num_seqs, heads, key_dim, value_dim)
    else:
        states = initial_state.to(compute)

    if docs is None:
        out, final = _recurrence(qc, kc, vc, gc, bc, scale, states)
    else:
        pieces, finals = [], []
        for n, (start, end) in enumerate(zip(docs.host, docs.host[1:])):
            doc = [t[:, start:end] for t in (qc, kc, vc, gc, bc)]
            o_doc, s_doc = _recurrence(*doc, scale, states[n : n + 1])
            pieces.append(o_doc)
            finals.append(s_doc)
        out, final = torch.cat(pieces, dim=1), torch.cat(finals, dim=0)
    return out.to(q.dtype), (final if output_final_state else None)


# ----------------------------------------------------------------------------- backends
class KDABackend(Protocol):
    """A chunk_kda implementation; receives validated inputs, a resolved float ``scale``, the packed
    documents as DocumentBounds (or None) and the caller's lower bound on ``g`` (or None: unknown)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        initial_state: Tensor | None,
        output_final_state: bool,
        docs: DocumentBounds | None,
        gate_lower_bound: float | None,
    ) -> tuple[Tensor, Tensor | None]: ...


_BACKENDS: dict[str, tuple[KDABackend, Callable[[Tensor], bool]]] = {}
# Backends registered below only when their package imports (triton: moe_lc_kernels; fla: fla-core).
_OPTIONAL_BACKENDS = {"triton": "triton", "fla": "fla-core"}
# Triton first: measured on one H200 (docs/performance.md §3, same run), the Triton kernels
# beat fla 0.6.0 forward+backward at every benchmark shape: 1.02x at B=8,T=4K and at B=2,T=8K,H=64,
# 1.03x at B=2,T=16K, 1.10x on 24 packed documents, 1.25x / 1.30x at B=1,T=64K / 256K. Inputs the
# kernels cannot take (see _triton_backend) go to fla when it is installed.
_AUTO_ORDER = ("triton", "fla", "torch")


def register_kda_backend(name: str, fn: KDABackend, supports: Callable[[Tensor], bool] | None = None) -> None:
    """Make ``fn`` available as ``chunk_kda(..., backend=name)``.

    ``supports(q)`` tells ``"auto"`` whether the backend can take these inputs (e.g. CUDA only);
    backends named in the auto order ("triton", "fla", "torch") are preferred in that order.
    """
    if name == "auto":
        raise ValueError('register_kda_backend: "auto" is reserved for automatic selection')
    _BACKENDS[name] = (fn, supports if supports is not None else (lambda q: True))


def available_kda_backends() -> tuple[str, ...]:
    """Names accepted by ``chunk_kda(backend=...)`` right now (besides "auto")."""
    return tuple(_BACKENDS)


def _resolve_backend(name: str, q: Tensor) -> KDABackend:
    if name == "auto":
        candidates = [n for n in _AUTO_ORDER if n in _BACKENDS] + [n for n in _BACKENDS if n not in _AUTO_ORDER]
        for candidate in candidates:
            fn, supports = _BACKENDS[candidate]
            if supports(q):
                return fn
        raise RuntimeError(f"chunk_kda: no registered backend supports these inputs ({q.device}, {q.dtype})")
    if name in _BACKENDS:
        fn, supports = _BACKENDS[name]
        if not supports(q):
            raise NotImplementedError(
                f'chunk_kda: backend "{name}" is not available for these inputs ({q.device}, {q.dtype}; it needs '
                f'CUDA and its package installed); use backend="torch" (or "auto")'
            )
        return fn
    if name in _OPTIONAL_BACKENDS:
        raise NotImplementedError(
            f'chunk_kda: backend "{name}" is not installed here (pip install {_OPTIONAL_BACKENDS[name]}); '
            'use backend="torch" (or "auto")'
        )
    raise ValueError(f'chunk_kda: unknown backend "{name}"; choose one of {["auto", *_BACKENDS]}')


register_kda_backend("torch", chunk_kda_torch)


# ----------------------------------------------------------------------------- GPU kernels (lazy)
def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _kernel_takes(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _triton_backend(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
    """moe_lc_kernels' Triton kernels. Inputs they cannot take (unbounded gates, head dims that are
    not powers of two in [16, 128], the largest run on a GPU) go to fla when it is installed, else
    to the torch reference. Without ``gate_lower_bound`` the gate check reads ``g.min()``."""
    from moe_lc_kernels.kda import chunk_kda_triton, gate_is_bounded, training_dims_ok

    if not (gate_is_bounded(g, gate_lower_bound) and training_dims_ok(q.shape[-1], v.shape[-1])):
        fla = _BACKENDS.get("fla")
        fallback = fla[0] if fla is not None and fla[1](q) else chunk_kda_torch
        return fallback(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound)
    return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                            seq_bounds=None if docs is None else docs.host, gate_lower_bound=gate_lower_bound)


def _fla_backend(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound):
    """flash-linear-attention's chunk_kda (``pip install fla-core``), the public baseline."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as exc:
        raise RuntimeError('chunk_kda: backend "fla" needs flash-linear-attention (pip install fla-core)') from exc
    from moe_lc_kernels.kda import gate_is_bounded

    return fla_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, safe_gate=gate_is_bounded(g, gate_lower_bound),
                         cu_seqlens=None if docs is None else docs.cu_seqlens.long())


register_kda_backend("triton", _triton_backend,
                     lambda q: _kernel_takes(q) and _installed("triton") and _installed("moe_lc_kernels"))
register_kda_backend("fla", _fla_backend, lambda q: _kernel_takes(q) and _installed("fla"))


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    docs: DocumentBounds | Tensor | None = None,
    gate_lower_bound: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """KDA in chunkwise form (chunk 64); same arguments and results as :func:`recurrent_kda`.

    ``g`` must be <= 0 (use :func:`kda_gate`). Any T works (padded internally); packed documents
    of any lengths are chunked separately. Differentiable by autograd. ``backend`` selects the
    implementation ("auto", "torch"; fast kernels register themselves).
    ``gate_lower_bound``: a floor the caller guarantees for every element of ``g`` (e.g. the
    ``lower_bound`` given to :func:`kda_gate`; not checked). The Triton kernels need a bounded
    gate; without a floor the triton backend reads ``g.min()`` to find out, which on a GPU waits
    for all queued work.
    When ``docs`` carries a context-parallel shard (``docs.shard``), the inputs are this rank's
    local row and the result is the row's output at its tokens
    (:mod:`moe_lc.parallel.context_kda`; no final states).
    """
    docs = as_document_bounds(docs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if docs is not None and docs.shard is not None:
        # imported here: moe_lc.parallel imports the model, which imports this op
        from moe_lc.parallel.context_kda import context_chunk_kda

        return context_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound,
                                 backend)
    _validate("chunk_kda", q, k, v, g, beta, initial_state, docs)
    impl = _resolve_backend(backend, q)
    out, final_state = impl(q, k, v, g, beta, scale, initial_state, output_final_state, docs, gate_lower_bound)
    return out.to(q.dtype), final_state
