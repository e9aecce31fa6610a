"""Which parameter gets which update rule and weight decay.

The rule, by module type (so it follows wrapped / sharded modules, whose classes subclass
the originals), and for the model's `embed` and `lm_head` by name (tensor parallelism replaces
those two modules with vocabulary-parallel ones of its own):

* Hidden matrices -- `nn.Linear` weights other than the LM head, and the stacked routed-expert
  weights [E, out, in] -- are Muon's (when Muon is used) and get weight decay.
* The token embedding and the LM head are matrices too, but their rows are per-token
  vectors, not a map between hidden spaces: AdamW, with weight decay (standard).
* Everything else gets AdamW without weight decay: norm weights, biases, AttnRes
  pseudo-queries (`DepthMixer.query`, initialised to zero, so decay would pull the
  mixing back towards uniform for no reason), KDA `A_log` and `dt_bias` (they set the
  decay time scales; decay would drift them towards e^0 and a fixed retention), and
  the KDA short-conv taps `ShortConv.weight` [C, 4]: a per-channel 4-tap filter is
  a per-channel vector in disguise, like a norm weight, not a matrix.
  A parameter of a module type this file does not know also lands here: decay and
  Muon are opt-in.

Per-head Muon (docs/design.md §7.6): attention projections are tagged with the size of one head's
block (`head_dim`) and the axis that holds the heads (0: output rows [H * head_dim],
1: input columns). A block size, not a head count: it stays right for a tensor-parallel
shard holding H/tp heads and for checkpoints loaded under another layout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_lc.model.kda import KDAttention
from moe_lc.model.mla import GatedMLA
from moe_lc.model.moe import RoutedExperts

ROWS, COLUMNS = 0, 1


@dataclass(frozen=True)
class ParamRole:
    name: str
    muon: bool  # a hidden matrix that Muon may orthogonalise
    decay: bool
    head_dim: int = 0  # rows/columns per head block for per-head Muon; 0 = the whole matrix
    head_axis: int = ROWS


def _head_layout(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(weight) -> (head block size, axis) for every attention projection with per-head structure."""
    layout: dict[int, tuple[int, int]] = {}

    def tag(linear: nn.Linear | None, head_dim: int, axis: int) -> None:
        if linear is not None:
            layout[id(linear.weight)] = (head_dim, axis)

    for module in model.modules():
        if isinstance(module, KDAttention):
            k = module.cfg.head_dim
            for proj in (module.q_proj, module.k_proj, module.v_proj, module.decay_up, module.gate_proj[-1]):
                tag(proj, k, ROWS)
            tag(module.o_proj, k, COLUMNS)
        elif isinstance(module, GatedMLA):
            c = module.cfg
            # q rows [H * (nope + shared)]; kv_up rows [H * (nope + v)]; gate rows and o_proj columns [H * v]
            tag(module.q_up if hasattr(module, "q_up") else module.q_proj, c.qk_dim, ROWS)
            tag(module.kv_up, c.qk_nope_dim + c.v_dim, ROWS)
            tag(module.gate_proj, c.v_dim, ROWS)
            tag(module.o_proj, c.v_dim, COLUMNS)
    return layout


def parameter_roles(model: nn.Module, per_head: bool = True) -> list[tuple[ParamRole, nn.Parameter]]:
    """Every trainable parameter once (shared ones by their first name), with its role."""
    heads_of = _head_layout(model) if per_head else {}
    seen: set[int] = set()
    roles = []
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            name = f"{module_name}.{param_name}" if module_name else param_name
            leaf = module_name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Embedding) or leaf in ("embed", "lm_head"):
                role = ParamRole(name, muon=False, decay=param_name == "weight")
            elif isinstance(module, nn.Linear) and param_name == "weight":
                head_dim, axis = heads_of.get(id(p), (0, ROWS))
                role = ParamRole(name, muon=True, decay=True, head_dim=head_dim, head_axis=axis)
            elif isinstance(module, RoutedExperts):
                role = ParamRole(name, muon=True, decay=True)
            else:
                role = ParamRole(name, muon=False, decay=False)
            roles.append((role, p))
    return roles


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """AdamW groups: decayed matrices and embeddings, then the no-decay rest (empty groups dropped)."""
    decay, no_decay = [], []
    for role, p in parameter_roles(model, per_head=False):
        (decay if role.decay else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "role": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "role": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def muon_param_groups(model: nn.Module, per_head: bool = True, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Groups for `Muon`: one Muon group per (head_dim, head_axis) layout, then AdamW decay / no-decay groups.

    Group options: use_muon (bool), head_dim (int, 0 = whole matrix), head_axis (0 rows / 1 columns),
    weight_decay, role (a label for logs).
    """
    muon: "OrderedDict[tuple[int, int], list[torch.Tensor]]" = OrderedDict()
    decay, no_decay = [], []
    for role, p in parameter_roles(model, per_head=per_head):
        if role.muon:
            muon.setdefault((role.head_dim, role.head_axis), []).append(p)
        else:
            (decay if role.decay else no_decay).append(p)
    groups: list[dict[str, Any]] = [
        {
            "params": params,
            "use_muon": True,
            "head_dim": head_dim,
            "head_axis": axis,
            "weight_decay": weight_decay,
            "role": f"muon_head{head_dim}_{'rows' if axis == ROWS else 'columns'}" if head_dim else "muon",
        }
        for (head_dim, axis), params in muon.items()
    ]
    groups += [
        {"params": decay, "use_muon": False, "weight_decay": weight_decay, "role": "adamw_decay"},
        {"params": no_decay, "use_muon": False, "weight_decay": 0.0, "role": "adamw_no_decay"},
    ]
    return [g for g in groups if g["params"]]
