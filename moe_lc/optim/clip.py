"""Global gradient-norm clipping that also works on sharded (DTensor) gradients."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from moe_lc.model.precision import upcast

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, foreach: bool = True) -> torch.Tensor:
    """Scale all gradients so that their global L2 norm is at most max_norm; return the pre-clip norm.

    Gradients are reduced per device mesh (experts and dense weights may be sharded over
    different meshes, which one `clip_grad_norm_` call cannot combine), then the squared
    norms are summed. max_norm <= 0 or inf only measures. Returns a scalar tensor in at least fp32
    (fp64 for fp64 gradients, so that float64 runs clip as exactly as they compute).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        mesh = g.device_mesh if DTensor is not None and isinstance(g, DTensor) else None
        by_mesh.setdefault(mesh, []).append(g)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=foreach)
        if DTensor is not None and isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(upcast(norm).square())
    device = squares[0].device
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
    total = torch.stack([s.to(device, dtype) for s in squares]).sum().sqrt()
    if 0 < max_norm < math.inf:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        # every shard scales by the same global factor; local tensors keep DTensor dispatch out of the way
        same_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            local = _local(g)
            same_kind.setdefault((local.device, local.dtype), []).append(local)
        for (dev, dtype), tensors in same_kind.items():
            if foreach:
                torch._foreach_mul_(tensors, coef.to(dev, dtype))
            else:
                for t in tensors:
                    t.mul_(coef.to(dev, dtype))
    return total
