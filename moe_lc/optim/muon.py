"""Muon for hidden matrices and AdamW for everything else, in one torch optimizer (docs/design.md §7.6).

Muon group (use_muon=True), per parameter W with gradient G:

    B <- mu B + G                                   (momentum buffer, state "momentum_buffer")
    U = G + mu B  (Nesterov)   or   U = B
    O = NS(U) per block * 0.2 sqrt(max(m, n))       (blocks: experts, and heads when head_dim > 0)
    W <- (1 - lr wd) W - lr O                       (decoupled weight decay)

AdamW group (use_muon=False): torch's AdamW update (decoupled decay), with the same state
names as `torch.optim.AdamW` ("step", "exp_avg", "exp_avg_sq"); fused on CUDA.

It is a plain `torch.optim.Optimizer`: param_groups carry the options, state is keyed by
parameter, so state_dict / load_state_dict and torch.distributed.checkpoint's
get_state_dict / set_state_dict work unchanged. Unlike torch's optimizers, a parameter
without a gradient still gets (zero) state at the first step, though no update: DCP's
strict load wants state for every trainable parameter, and some never see a gradient
(the AttnRes pseudo-query of the first sublayer mixes a single source).

Sharded parameters (DTensor, e.g. FSDP2 or TP): Newton-Schulz needs whole blocks. When every
shard holds whole blocks -- stacked experts [E, out, in] sharded on the expert dim (EP),
a replicated weight, or a per-head projection sharded along its head axis in whole heads
(TP) -- the local shard is orthogonalised where it is, with no communication. Otherwise the update is gathered with `full_tensor()` (an all-gather of the full matrix
on every rank of the mesh), orthogonalised redundantly on every rank, and each rank keeps
its own slice (`distribute_tensor(..., src_data_rank=None)`: no second communication).
Cost: one all-gather and the full NS compute (O(m n min(m, n)) per step) per sharded
matrix on every rank, plus a transient full copy in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim.adam import adam as adam_update

from moe_lc.optim.newton_schulz import check_head_split, orthogonalized_update

try:  # torch.distributed may be absent from some builds
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = None

ParamsT = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


def shard_holds_whole_blocks(u: "DTensor", head_dim: int, head_axis: int) -> bool:
    """True when each rank's shard is made of complete blocks, so NS can run on it locally.

    Allowed: Replicate; Shard of a batch (expert) dim; one even Shard of the head axis whose
    every piece is a whole number of heads. Anything else (Partial, FSDP's row shards of a
    plain matrix, strided shards) needs the full matrix.
    """
    batch_dims = u.ndim - 2
    head_dim_index = batch_dims + head_axis if head_dim else None
    head_shards = 0
    for mesh_dim, placement in enumerate(u.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            return False
        if placement.dim < batch_dims:
            continue
        if placement.dim != head_dim_index or u.shape[placement.dim] % (u.device_mesh.size(mesh_dim) * head_dim):
            return False
        head_shards += 1
    return head_shards <= 1


def muon_direction(u: torch.Tensor, head_dim: int, head_axis: int, steps: int) -> torch.Tensor:
    """Scaled, orthogonalised update for a plain tensor or a DTensor (same placements as u)."""
    if DTensor is None or not isinstance(u, DTensor):
        return orthogonalized_update(u, head_dim, head_axis, steps)
    if shard_holds_whole_blocks(u, head_dim, head_axis):
        local = orthogonalized_update(u.to_local(), head_dim, head_axis, steps)
        return DTensor.from_local(
            local, u.device_mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride()
        )
    full = orthogonalized_update(u.full_tensor(), head_dim, head_axis, steps)
    return distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)


def _all_on_cuda(groups: list[dict[str, Any]]) -> bool:
    params = [p for g in groups if not g["use_muon"] for p in g["params"]]
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


class Muon(torch.optim.Optimizer):
    """Muon on groups with use_muon=True (default), AdamW on groups with use_muon=False.

    Build the groups with `moe_lc.optim.muon_param_groups(model)`, which keeps embeddings,
    the LM head and vectors in AdamW groups and tags attention projections with their heads.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: Optional[bool] = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1 or ns_steps < 1:
            raise ValueError(
                f"Muon needs lr >= 0, weight_decay >= 0, momentum in [0, 1) and ns_steps >= 1; "
                f"got lr={lr}, weight_decay={weight_decay}, momentum={momentum}, ns_steps={ns_steps}"
            )
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            use_muon=True,
            head_dim=0,
            head_axis=0,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            betas=tuple(betas),
            eps=eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                self._check_muon_group(group)
        if fused is None:
            fused = _all_on_cuda(self.param_groups)
        elif fused and not _all_on_cuda(self.param_groups):
            raise ValueError("fused=True needs every AdamW-group parameter on CUDA; pass fused=None or False")
        self.fused = fused  # an attribute, not a group option: state dicts stay device-independent

    @staticmethod
    def _check_muon_group(group: dict[str, Any]) -> None:
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"Muon group holds a parameter of shape {tuple(p.shape)}; vectors and scalars belong in an "
                    "AdamW group (use_muon=False): build groups with moe_lc.optim.muon_param_groups(model)"
                )
            check_head_split(p.shape, group["head_dim"], group["head_axis"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if p.grad is None:
                continue
            g = p.grad
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            u = g.add(buf, alpha=mu) if group["nesterov"] else buf
            direction = muon_direction(u, group["head_dim"], group["head_axis"], group["ns_steps"])
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(direction.to(p.dtype), alpha=-lr)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self.fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif self.fused and state["step"].device != p.device:  # loaded from a CPU checkpoint
                state["step"] = state["step"].to(p.device)
            if p.grad is None:
                continue
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam_update(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=self.fused,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
