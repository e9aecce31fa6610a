"""Segment state and transition of KDA: what context parallelism exchanges between ranks.

KDA is linear in its state: over a segment, S_end = M S_start + S~, where S~ is the segment's
final state from a zero start and M (K x K) the product of the per-token transitions
(I - b k k^T) Diag(exp(g)). A rank holding one segment computes (S~, M) without knowing its
predecessors; a prefix scan S_{j+1} = M_j S_j + S~_j then gives every segment its true start state
(the same algebra the Triton kernels' segmented path uses inside one device).

M is the final state of KDA run with zero values from the identity (an input-independent
observation: the recurrence with v = 0 maps S_0 = I to the transition itself), so both come from
any :func:`moe_lc.ops.kda.chunk_kda` backend and are differentiable through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds, as_document_bounds
from moe_lc.ops.kda import chunk_kda


def segment_transition(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    docs: DocumentBounds | Tensor | None = None,
    gate_lower_bound: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(S~ [N, H, K, V], M [N, H, K, K])`` for each sequence (or packed document).

    Shapes and conventions (``docs``, ``gate_lower_bound``) as :func:`moe_lc.ops.kda.chunk_kda`;
    states in the compute dtype. Once the true start state S is known,
    ``chunk_kda(..., initial_state=S)`` gives the outputs.
    """
    docs = as_document_bounds(docs)  # read a plain cu_seqlens tensor once, not per call below
    common = dict(scale=scale, output_final_state=True, docs=docs, gate_lower_bound=gate_lower_bound, backend=backend)
    _, s_tilde = chunk_kda(q, k, v, g, beta, **common)
    num_seqs = s_tilde.shape[0]
    heads, key_dim = q.shape[2], q.shape[3]
    eye = torch.eye(key_dim, dtype=s_tilde.dtype, device=q.device).expand(num_seqs, heads, key_dim, key_dim)
    zeros = torch.zeros(*q.shape[:3], key_dim, dtype=v.dtype, device=v.device)
    _, transition = chunk_kda(q, k, zeros, g, beta, initial_state=eye.contiguous(), **common)
    return s_tilde, transition
