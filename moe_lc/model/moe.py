"""Stable LatentMoE (docs/design.md §5).

    s = sigmoid(W_r x)                    T = argtop_k(s + b)   (b selects only: no gradient, no weight)
    p_j = scale * s_j / sum_{r in T} s_r
    z = W_down x                          u = sum_{j in T} p_j E_j(z)      (experts in latent width l)
    y = sum_s E_s^shared(x) + W_up RMSNorm(u)

Dropless: every token reaches its k experts. Tokens are sorted by expert on the device and
gathered into expert order (`moe_lc.ops.token_permutation`), every expert runs once on its
contiguous slice through one dispatch (`moe_lc.ops.grouped_experts.grouped_glu`: a grouped GEMM
on GPUs, the per-expert loop as the reference), and `token_permutation.combine` forms the weighted
sum. Expert parallelism replaces only the dispatch around the experts' call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from moe_lc.config import MoEConfig
from moe_lc.model.balancing import ExpertBalancer
from moe_lc.model.ffn import GatedFFN
from moe_lc.model.norm import RMSNorm
from moe_lc.model.precision import upcast
from moe_lc.ops.accumulate import accumulate_
from moe_lc.ops.grouped_experts import grouped_glu, grouped_glu_stacked, resolve_backend, resolve_wgrad_backend
from moe_lc.ops.routing import resolve_backend as resolve_router_backend
from moe_lc.ops.routing import route_topk, routing_weights
from moe_lc.ops.stacked_linear import stackable, stacked_linear
from moe_lc.ops.token_permutation import combine, expert_order, gather_by_expert


class RoutedExperts(nn.Module):
    """The n routed experts' weights, stacked so that they can be sharded along dim 0 (EP).

    ``backend`` goes to ``grouped_glu`` ("auto": grouped GEMM on CUDA bf16/fp32, the loop elsewhere),
    ``activation_backend`` to the GLU activation ("auto": the fused SiTU kernel on GPUs).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        activation: str,
        beta1: float,
        beta2: float,
        backend: str = "auto",
        activation_backend: str = "auto",
        wgrad_backend: str = "auto",
    ):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_in = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w_out = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.activation, self.beta1, self.beta2 = activation, beta1, beta2
        self.backend, self.activation_backend = backend, activation_backend
        # "triton": the stacked step copies' weight gradients summed into .grad by their GEMM (MoEConfig)
        self.wgrad_backend = wgrad_backend
        self.step_casts: Optional[dict] = None  # autocast copies of the weights for one step (reuse_weight_casts)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        stacked = self.stacked_step_weights(x_sorted)
        if stacked is not None and x_sorted.shape[0]:
            targets = (((self.w_gate, self.w_in), (self.w_out,))
                       if resolve_wgrad_backend(x_sorted.device, self.wgrad_backend) == "triton" else None)
            return grouped_glu_stacked(x_sorted.to(stacked[0].dtype), tokens_per_expert, *stacked, self.activation,
                                       self.beta1, self.beta2, activation_backend=self.activation_backend,
                                       grad_targets=targets)
        return self.unstacked(x_sorted, tokens_per_expert)

    def unstacked(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on their three weights as ``compute_weights`` gives them (no step copies to stack:
        evaluation, fp32 or float8 runs, the CPU reference)."""
        return grouped_glu(
            x_sorted, tokens_per_expert, *self.compute_weights(x_sorted), self.activation, self.beta1,
            self.beta2, backend=self.backend, activation_backend=self.activation_backend,
        )

    def compute_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three weights as the GEMMs take them: within ``reuse_weight_casts``, under autocast and
        with grad on, autocast's copies made once and reused by every micro-batch (their backward
        still accumulates into the fp32 weights' gradients); the weights themselves otherwise."""
        dtype = self._step_cast_dtype(x)
        if dtype is None:
            return self.w_gate, self.w_in, self.w_out
        if dtype not in self.step_casts:
            self.step_casts[dtype] = tuple(_CastAccumulatingInFp32.apply(w, dtype)
                                           for w in (self.w_gate, self.w_in, self.w_out))
        return self.step_casts[dtype]

    def stacked_step_weights(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(W_gate and W_in stacked [E, 2h, l], W_out) in autocast's dtype, made once a step, where the
        step's casts are reused (``compute_weights``) and the grouped GEMM runs them; else None. The
        cast writes both halves of one tensor, so stacking costs no copy of its own."""
        dtype = self._step_cast_dtype(x)
        if dtype is None or self.backend not in ("auto", "grouped"):
            return None
        key = ("stacked", dtype)
        if key not in self.step_casts:
            w_out = _CastAccumulatingInFp32.apply(self.w_out, dtype)
            stacked = _StackedCastAccumulatingInFp32.apply(self.w_gate, self.w_in, dtype)
            hidden = self.w_gate.shape[1]
            grouped = resolve_backend(x.to(dtype), stacked[:, :hidden], stacked[:, hidden:], w_out,
                                      self.backend) == "grouped"
            self.step_casts[key] = (stacked, w_out) if grouped else None  # None: not again this step
        return self.step_casts[key]

    def prepare_step_weights(self, x: torch.Tensor) -> None:
        """Make this step's stacked copies now, if the step reuses them (``stacked_step_weights``): what a
        compiled MoE layer calls before entering its graph, which then only looks them up."""
        self.stacked_step_weights(x)

    def _step_cast_dtype(self, x: torch.Tensor) -> Optional[torch.dtype]:
        """Autocast's dtype where this step's weight copies are reused (``reuse_weight_casts``, grad and
        autocast on, plain fp32 parameters, not float8), else None."""
        device_type = x.device.type
        if (self.step_casts is None or self.backend == "float8" or not torch.is_grad_enabled()
                or not torch.is_autocast_enabled(device_type)):
            return None
        dtype = torch.get_autocast_dtype(device_type)
        weights = (self.w_gate, self.w_in, self.w_out)
        if any(type(w) is not nn.Parameter or not w.is_floating_point() or w.dtype == dtype for w in weights):
            return None  # sharded (DTensor) or already in the compute dtype: nothing to reuse
        return dtype


def _add_into_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """``weight.grad += grad`` in the weight's dtype, the first gradient of a step stored contiguous:
    what the per-step copies' backward does instead of autograd's cast and AccumulateGrad's add."""
    if weight.grad is None:
        weight.grad = grad.to(weight.dtype, memory_format=torch.contiguous_format)
    else:
        accumulate_(weight.grad, grad)


class _CastAccumulatingInFp32(torch.autograd.Function):
    """``weight.to(dtype)`` whose backward adds the incoming gradient straight into ``weight.grad``
    (one mixed-dtype add: 10 bytes a parameter) instead of autograd's cast of it to the weight's
    dtype and AccumulateGrad's add (18 bytes; the stacked experts are 3.4B parameters of k3-small,
    accumulated over 8 micro-batches a step). The sums are bitwise the same: both upcast the bf16
    gradient exactly and add in fp32. For plain parameters only (``compute_weights``): nothing
    else (FSDP, a DDP hook) is waiting for their AccumulateGrad."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _add_into_grad(ctx.weight, grad)
        return None, None


class _StackedCastAccumulatingInFp32(torch.autograd.Function):
    """``torch.cat([w_gate, w_in], 1).to(dtype)`` written by the cast itself, whose backward adds each
    half of the incoming gradient into its weight's fp32 ``.grad`` (as ``_CastAccumulatingInFp32``)."""

    @staticmethod
    def forward(ctx, w_gate: torch.Tensor, w_in: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weights = (w_gate, w_in)
        hidden = w_gate.shape[1]
        out = w_gate.new_empty(w_gate.shape[0], 2 * hidden, w_gate.shape[2], dtype=dtype)
        out[:, :hidden].copy_(w_gate)
        out[:, hidden:].copy_(w_in)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden = ctx.weights[0].shape[1]
        for weight, part in zip(ctx.weights, (grad[:, :hidden], grad[:, hidden:])):
            _add_into_grad(weight, part)
        return None, None, None


@contextlib.contextmanager
def reuse_weight_casts(model: nn.Module) -> Iterator[None]:
    """Cast the routed experts' fp32 weights to autocast's dtype once for the enclosed forward and
    backward passes (one training step's micro-batches) instead of once per micro-batch.

    The weights must not change inside (the optimizer steps after it): the copies are dropped on exit.
    Measured on one H200 (k3-small, 8K), these casts were ~9 ms of each micro-batch's ~585 ms.
    Like autocast's own cache of its casts, the copies' backward is shared by every micro-batch; it
    adds each micro-batch's gradient into the fp32 ``.grad`` directly (``_CastAccumulatingInFp32``).
    """
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in experts:
        m.step_casts = {}
    try:
        yield
    finally:
        for m in experts:
            m.step_casts = None


class LatentMoE(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.num_routed, bias=False)
        self.balancer = ExpertBalancer(
            cfg.num_routed,
            cfg.top_k,
            mode=cfg.balancing,
            bins=cfg.qb_bins,
            exact=cfg.qb_exact,
            ema=cfg.qb_ema,
            sign_rate=cfg.sign_rate,
            aux_coef=cfg.aux_loss_coef,
        )
        expert_dim = cfg.latent_dim if cfg.latent_dim is not None else d_model
        if cfg.latent_dim is not None:
            self.latent_down = nn.Linear(d_model, cfg.latent_dim, bias=False)
            self.latent_norm = RMSNorm(cfg.latent_dim, norm_eps)
            self.latent_up = nn.Linear(cfg.latent_dim, d_model, bias=False)
        self.experts = RoutedExperts(
            cfg.num_routed, expert_dim, cfg.expert_hidden, cfg.activation, cfg.situ_beta1, cfg.situ_beta2,
            wgrad_backend=cfg.wgrad_backend,
        )
        # N_s shared experts of hidden h summed == one GLU of hidden N_s*h (same parameters, one matmul).
        self.shared = (
            GatedFFN(d_model, cfg.num_shared * cfg.expert_hidden, cfg.activation, cfg.situ_beta1, cfg.situ_beta2)
            if cfg.num_shared > 0
            else None
        )
        self.aux_loss: Optional[torch.Tensor] = None

    def input_projections(
        self, x_flat: torch.Tensor
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """What the layer computes from x first: the router's logits, z = W_down x (None without a
        latent space) and the shared experts' stacked gate and input projection (None where they
        run on their own: no shared experts, or weights that cannot be stacked).

        With ``fused_projections`` and plain weights (``stackable``) these are one GEMM over the
        stacked weights, split by columns: x is cast to autocast's dtype and kept for backward once
        instead of three times, and dx is one GEMM instead of three and their sum; the router's
        narrow GEMM (64 columns) runs inside a wide one."""
        linears = [self.router] + ([self.latent_down] if self.cfg.latent_dim is not None else [])
        shared = self.shared is not None and self.shared.stackable()
        if not (self.cfg.fused_projections and all(stackable(m) for m in linears)):
            return self.router(x_flat), (self.latent_down(x_flat) if len(linears) > 1 else None), None
        weights = [m.weight for m in linears] + (self.shared.stacked_weights() if shared else [])
        widths = [m.out_features for m in linears] + ([sum(w.shape[0] for w in weights[len(linears):])] if shared else [])
        pieces = list(stacked_linear(x_flat, weights).split(widths, dim=-1))
        logits = pieces.pop(0)
        z = pieces.pop(0) if len(linears) > 1 else None
        return logits, z, (pieces.pop(0) if shared else None)

    def route(self, logits: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Router scores (fp32) from the router's logits, selected experts and their normalised weights.

        With ``router_backend`` on the fused kernels (``moe_lc.ops.routing``) the scores are never
        materialised (None): one kernel selects and weighs, one adds the balancer's statistics."""
        if self.fused_router(logits):
            topk_idx, weights, cutoff = route_topk(logits, self.balancer.bias, self.cfg.top_k,
                                                   self.cfg.routing_scale, backend=self.cfg.router_backend)
            self.balancer.add_routed(logits, topk_idx, cutoff)
            self.aux_loss = None
            return None, topk_idx, weights
        scores = torch.sigmoid(upcast(logits))
        topk_idx = self.balancer.select(scores.detach())
        weights = routing_weights(scores, topk_idx, self.cfg.routing_scale)
        self.aux_loss = self.balancer.aux_loss(scores, topk_idx) if self.training else None
        return scores, topk_idx, weights

    def fused_router(self, logits: torch.Tensor) -> bool:
        """Whether ``route`` runs the fused router: asked for (``router_backend``), a balancer whose
        statistics its kernel keeps (not the exact quantile, not the auxiliary loss), and inputs it takes."""
        return (self.cfg.router_backend != "torch" and self.balancer.fused_statistics()
                and resolve_router_backend(logits, self.cfg.top_k, self.cfg.router_backend,
                                           self.balancer.bias) == "triton")

    def routed(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """u = sum_{j in T} p_j E_j(z) on one process: sort by expert, the experts, combine (no host read)."""
        order, token_of_row, counts, rows = expert_order(topk_idx, self.cfg.num_routed, self.cfg.router_backend)
        backend = self.cfg.dispatch_backend
        out_sorted = self.experts(gather_by_expert(z, token_of_row, rows, backend), counts)
        return combine(out_sorted, order, rows, weights, z.dtype, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_flat = x.reshape(-1, shape[-1])
        logits, z, shared_gate_in = self.input_projections(x_flat)
        _, topk_idx, weights = self.route(logits)
        if z is not None:
            y = self.latent_up(self.latent_norm(self.routed(z, topk_idx, weights)))
        else:
            y = self.routed(x_flat, topk_idx, weights)
        if shared_gate_in is not None:
            y = y + self.shared.from_gate_in(shared_gate_in)
        elif self.shared is not None:
            y = y + self.shared(x_flat)
        return y.view(shape)
