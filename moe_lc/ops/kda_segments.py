"""Segment state and transition of KDA: what context parallelism exchanges between ranks.

KDA is linear in its state: over a segment, S_end = M S_start + S~, where S~ is the segment's
final state from a zero start and M (K x K) the product of the per-token transitions
(I - b k k^T) Diag(exp(g)). A rank holding one segment computes (S~, M) without knowing its
predecessors; a prefix scan S_{j+1} = M_j S_j + S~_j then gives every segment its true start state
(the same algebra the Triton kernels' segmented path uses inside one device).

M is the final state of KDA run with zero values from the identity (an input-independent
observation: the recurrence with v = 0 maps S_0 = I to the transition itself), so both come from
any KDA implementation that returns final states (:func:`transition_of`), and are differentiable
through it; :func:`segment_transition` is that for :func:`moe_lc.ops.kda.chunk_kda`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from moe_lc.ops.documents import DocumentBounds, as_document_bounds
from moe_lc.ops.kda import chunk_kda

# final_state(values [B, T, H, V'], initial_state [N, H, K, V'] or None) -> final states [N, H, K, V']
FinalState = Callable[[Tensor, Optional[Tensor]], Tensor]


def transition_of(final_state: FinalState, values: Tensor, key_dim: int) -> tuple[Tensor, Tensor]:
    """``(S~, M)`` of the segments that ``final_state`` runs KDA over: S~ from ``values`` and a
    zero start, M from zero values (K columns) and the identity."""
    s_tilde = final_state(values, None)
    num_seqs, heads = s_tilde.shape[:2]
    eye = torch.eye(key_dim, dtype=s_tilde.dtype, device=s_tilde.device).expand(num_seqs, heads, key_dim, key_dim)
    zeros = values.new_zeros(*values.shape[:3], key_dim)
    return s_tilde, final_state(zeros, eye.contiguous())


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

    def final_state(values: Tensor, initial_state: Optional[Tensor]) -> Tensor:
        return chunk_kda(q, k, values, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                         docs=docs, gate_lower_bound=gate_lower_bound, backend=backend)[1]

    return transition_of(final_state, v, q.shape[-1])
