"""How the tests hand packed-document boundaries to a layer or the model: the one place to change
when that interface changes (``layer(x, **packed(cu))``, ``model(ids, labels, **packed(cu))``)."""

from __future__ import annotations

from typing import Optional

import torch

from moe_lc.ops.documents import DocumentBounds


def packed(cu_seqlens: Optional[torch.Tensor]) -> dict:
    """Keyword arguments that tell a layer or the model where the documents of a packed row start
    (``cu_seqlens``: [N+1] int boundaries 0, ..., T, FlashAttention convention); none for one document."""
    if cu_seqlens is None:
        return {}
    return {"docs": DocumentBounds.of(cu_seqlens)}
