"""KDA from a layer's raw projections: L2 norm of q and k, the bounded gate and beta's sigmoid
fused into the kernels where the backend can, instead of a dozen elementwise passes in PyTorch.

    o = KDA(l2norm(q), l2norm(k), v, kda_gate(z, A_log, dt_bias, lower_bound), sigmoid(beta_logits))

with ``l2norm(x) = x / sqrt(sum x^2 + 1e-6)`` (per head, in fp32). The torch backend computes
exactly this composition (the definition); ``triton`` is :func:`moe_lc_kernels.chunk_kda_fused`
and ``fla`` flash-linear-attention's ``chunk_kda`` with its in-kernel norm, gate and sigmoid.
``auto`` tries triton, fla, torch, like :func:`moe_lc.ops.kda.chunk_kda`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds, as_document_bounds
from moe_lc.ops.kda import _installed, _kernel_takes, available_kda_backends, chunk_kda, kda_gate

L2NORM_EPS = 1e-6


def l2_normalize(x: Tensor) -> Tensor:
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dim, computed in at least fp32, returned in x's dtype."""
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return (wide * torch.rsqrt((wide * wide).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _composed(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state,
              docs, kda_backend: str = "torch"):
    """The definition: norm, gate and sigmoid in PyTorch, then :func:`chunk_kda` on ``kda_backend``
    (told the gate's floor, so that a kernel needing a bounded gate does not read g back)."""
    wide = beta_logits if beta_logits.dtype in (torch.float32, torch.float64) else beta_logits.float()
    g = kda_gate(z, A_log, dt_bias, lower_bound=lower_bound)
    return chunk_kda(l2_normalize(q), l2_normalize(k), v, g, torch.sigmoid(wide), scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state, docs=docs,
                     gate_lower_bound=lower_bound, backend=kda_backend)


_torch = _composed


def _triton(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state,
            docs, keep_states: bool = False, keep_prep: bool = False):
    from moe_lc_kernels.kda import GATE_SPAN_LIMIT, chunk_kda_fused, training_dims_ok

    if (lower_bound is None or not -GATE_SPAN_LIMIT <= lower_bound < 0
            or not training_dims_ok(q.shape[-1], v.shape[-1])):
        fallback = _fla if _fla_available(q) and lower_bound is not None else _torch
        return fallback(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state,
                        output_final_state, docs)
    return chunk_kda_fused(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
                           initial_state=initial_state, output_final_state=output_final_state,
                           seq_bounds=None if docs is None else docs.host, keep_states=keep_states,
                           keep_prep=keep_prep)


def _fla(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state,
         docs):
    if lower_bound is None:  # fla's in-kernel gate is the bounded one
        return _torch(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state,
                      output_final_state, docs)
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(q, k, v, z, beta_logits, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                         cu_seqlens=None if docs is None else docs.cu_seqlens.long())


def _triton_available(q: Tensor) -> bool:
    return _kernel_takes(q) and _installed("triton") and _installed("moe_lc_kernels")


def _fla_available(q: Tensor) -> bool:
    return _kernel_takes(q) and _installed("fla")


_BACKENDS = {"triton": (_triton, _triton_available), "fla": (_fla, _fla_available), "torch": (_torch, lambda q: True)}

KERNEL_PACKAGES = {"triton": ("triton", "moe_lc_kernels"), "fla": ("fla",)}


def kernels_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why the ``backend`` kernels ("triton", "fla") cannot run on ``device`` here, or None (the other
    backends run anywhere): what a run that asks for them checks before it builds the model."""
    if backend not in KERNEL_PACKAGES:
        return None
    missing = [pkg for pkg in KERNEL_PACKAGES[backend] if not _installed(pkg)]
    if device.type == "cuda" and not missing:
        return None
    packages = KERNEL_PACKAGES[backend]
    needs = " and ".join(packages) + (" packages" if len(packages) > 1 else " package")
    here = f"{device}" + (f", without {', '.join(missing)}" if missing else "")
    return f"the {backend} KDA kernels need a CUDA device and the {needs} (here: {here})"


def chunk_kda_from_projections(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    z: Tensor,
    beta_logits: Tensor,
    A_log: Tensor,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = -5.0,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    docs: DocumentBounds | Tensor | None = None,
    backend: str = "auto",
    keep_states: bool = False,
    keep_prep: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KDA on raw q, k (normalised here), v, the decay logit z [B, T, H, K] (gate as in
    :func:`kda_gate`: bounded with ``lower_bound``, softplus with None) and beta logits [B, T, H].
    ``docs``: packed documents as in :func:`chunk_kda`. Returns ``(o, final_state or None)`` like
    :func:`chunk_kda`; differentiable in every tensor. With a context-parallel shard on ``docs``
    the inputs are this rank's local row, as in :func:`chunk_kda`. ``keep_states``: the fused Triton
    kernels keep their per-chunk states for the backward instead of recomputing them (a memory
    trade, ``activation_checkpointing.kda_states``; the other backends keep what they keep);
    ``keep_prep`` likewise keeps every output of their prep (``activation_checkpointing.kda_prep``)."""
    docs = as_document_bounds(docs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if docs is not None and docs.shard is not None:
        # imported here: moe_lc.parallel imports the model, which imports this op
        from moe_lc.parallel.context_kda import context_kda_from_projections

        return context_kda_from_projections(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state,
                                            output_final_state, docs, backend)
    if backend == "auto":
        impl = next(fn for fn, supports in _BACKENDS.values() if supports(q))
    elif backend in _BACKENDS:
        impl, supports = _BACKENDS[backend]
        if not supports(q):
            raise NotImplementedError(f'chunk_kda_from_projections: backend "{backend}" is not available for these '
                                      f'inputs ({q.device}, {q.dtype}; it needs CUDA and its package); use "torch" or '
                                      f'"auto"')
    elif backend in available_kda_backends():  # a kernel registered with register_kda_backend
        impl = partial(_composed, kda_backend=backend)
    else:
        raise ValueError(f'chunk_kda_from_projections: unknown backend "{backend}"; choose one of '
                         f'{["auto", *dict.fromkeys([*_BACKENDS, *available_kda_backends()])]}')
    if impl is _triton:
        impl = partial(_triton, keep_states=keep_states, keep_prep=keep_prep)
    out, final = impl(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, scale, initial_state, output_final_state,
                      docs)
    return out.to(v.dtype), final
