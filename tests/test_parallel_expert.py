"""Expert-parallel dispatch in isolation: skewed routing, an ep rank that receives no tokens.

Two ranks each route their own tokens through one LatentMoE whose experts are split 2 + 2;
the balancer bias forces every token onto rank 0's experts, so rank 1's experts get nothing
(this happens in early training). Output and every gradient must equal one process running
all tokens, and rank 1's idle experts must still take part in backward (zero gradients),
which FSDP's per-module reduction relies on.
"""

from __future__ import annotations

import pytest
import torch

from moe_lc.config import MoEConfig
from moe_lc.model.moe import LatentMoE
from parallel_harness import full_tensor, run_distributed

D, TOKENS = 16, 12
CFG = MoEConfig(num_routed=4, top_k=2, num_shared=1, latent_dim=8, expert_hidden=12)
FORCED_BIAS = torch.tensor([10.0, 10.0, -10.0, -10.0])  # experts 0 and 1 (rank 0) win every token


def build() -> tuple[LatentMoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = LatentMoE(D, CFG)
    for name, p in moe.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, 0.0, 0.3)
    moe.balancer.bias.copy_(FORCED_BIAS)
    x = torch.randn(1, TOKENS, D)
    return moe, x


def grads_of(moe: LatentMoE) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.grad) for n, p in moe.named_parameters()}


def expert_parallel_side() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moe_lc.parallel.comm import all_reduce_sum
    from moe_lc.parallel.expert_parallel import apply_expert_parallel
    from moe_lc.parallel.local_params import expose_all_local_parameters

    rank = dist.get_rank()
    moe, x = build()
    apply_expert_parallel(moe, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    expose_all_local_parameters(moe)
    mine = x[:, rank * TOKENS // 2 : (rank + 1) * TOKENS // 2].clone().requires_grad_(True)
    y = moe(mine)
    (y * torch.linspace(-1, 1, D)).sum().backward()
    joined = torch.tensor([float(all(p.grad is not None for p in moe.experts.parameters()))])
    dist.all_reduce(joined, op=dist.ReduceOp.MIN)
    if joined.item() == 0:  # some rank's experts never saw backward: report instead of hanging
        return dict(joined=moe.experts.w_gate.grad is not None)
    received = moe.experts.w_gate.grad.to_local().abs().sum().item()
    grads = grads_of(moe)
    for name, p in moe.named_parameters():  # replicated weights saw this rank's tokens only
        if "experts" not in name:
            all_reduce_sum(grads[name], None if dist.get_world_size() == 1 else dist.group.WORLD)
    return dict(joined=True, y=y.detach(), x_grad=mine.grad, grads=grads, expert_grad_abs=received)


@pytest.mark.timeout(120)
def test_dispatch_with_an_idle_expert_rank():
    moe, x = build()
    x = x.requires_grad_(True)
    y = moe(x)
    (y * torch.linspace(-1, 1, D)).sum().backward()
    ref = grads_of(moe)

    ranks = run_distributed(expert_parallel_side, 2, timeout=80)
    assert [r["joined"] for r in ranks] == [True, True], "an idle rank's experts must still run backward"
    y_par = torch.cat([r["y"] for r in ranks], dim=1)
    x_grad = torch.cat([r["x_grad"] for r in ranks], dim=1)
    assert torch.allclose(y_par, y.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(x_grad, x.grad, rtol=1e-5, atol=1e-6)
    for name, g in ref.items():
        assert torch.allclose(ranks[0]["grads"][name], g, rtol=1e-5, atol=1e-6), name
    assert ranks[0]["expert_grad_abs"] > 0
    assert ranks[1]["expert_grad_abs"] == 0.0  # rank 1's experts got no tokens, yet joined backward
