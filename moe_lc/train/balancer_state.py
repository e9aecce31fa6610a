"""Checkpoint each expert balancer's step accumulators as one flat tensor.

`ExpertBalancer.get_extra_state` returns a dict of tensors (step loads, histogram counts
and range, or the exact path's required biases). torch.distributed.checkpoint flattens
nested dicts into one entry per tensor when saving, while `CheckpointManager.load` matches
the model's unflattened keys against the saved ones, so the two never meet. Packing the
dict into a single float64 tensor (int64 counts below 2^53 are exact) gives one entry per
balancer that both sides agree on. The trainer applies this to every model it builds, for
saving and loading alike, so its checkpoints round-trip.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_lc.model.balancing import ExpertBalancer

_PACKED = "_moe_lc_packed_extra_state"
_ORDER = ("step_loads", "hist_counts", "hist_range", "step_required")


def _pack(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n_entries, (code, numel, values...) per entry] as float64."""
    parts = [torch.tensor([float(len(state))], dtype=torch.float64)]
    for key, value in state.items():
        flat = value.detach().reshape(-1).to("cpu", torch.float64)
        parts.append(torch.tensor([float(_ORDER.index(key)), float(flat.numel())], dtype=torch.float64))
        parts.append(flat)
    return torch.cat(parts)


def _unpack(packed: torch.Tensor, balancer: ExpertBalancer) -> dict[str, torch.Tensor]:
    data = packed.detach().to("cpu", torch.float64)
    n, pos, out = int(data[0]), 1, {}
    shapes = {
        "step_loads": (balancer.num_experts,),
        "hist_counts": (balancer.num_experts, -1),
        "hist_range": (2,),
        "step_required": (-1, balancer.num_experts),
    }
    dtypes = {"step_loads": torch.int64, "hist_counts": torch.int64, "hist_range": torch.float64,
              "step_required": torch.float32}
    for _ in range(n):
        key, numel = _ORDER[int(data[pos])], int(data[pos + 1])
        values = data[pos + 2 : pos + 2 + numel]
        out[key] = values.to(dtypes[key]).reshape(shapes[key])
        pos += 2 + numel
    return out


def pack_balancer_state(model: nn.Module) -> nn.Module:
    """Make every ExpertBalancer of `model` save/load its extra state as one tensor (idempotent)."""
    for module in model.modules():
        if not isinstance(module, ExpertBalancer) or getattr(module, _PACKED, False):
            continue
        get_dict, set_dict = module.get_extra_state, module.set_extra_state

        def get_extra_state(get_dict=get_dict, owner=module) -> torch.Tensor:
            return _pack(get_dict()).to(owner.bias.device)

        def set_extra_state(state, set_dict=set_dict, owner=module) -> None:
            set_dict(_unpack(state, owner) if isinstance(state, torch.Tensor) else state)

        module.get_extra_state = get_extra_state
        module.set_extra_state = set_extra_state
        setattr(module, _PACKED, True)
    return model
