"""Expert load balancing for the routed experts (docs/design.md §6).

Selection is ``T_i = argtop_k(s_i + b)``. The bias ``b`` only decides *which* experts a
token visits, never how much they weigh, and it gets no gradient.

Quantile Balancing (QB) sets ``b`` in one shot per step instead of nudging it:

* Token i's cutoff ``alpha_i`` is its (k+1)-th biased score. Expert j wins the token iff
  ``s_ij + b_j > alpha_i``, i.e. iff ``b_j`` exceeds the token's *required bias*
  ``r_ij = alpha_i - s_ij`` (the negative of the margin ``s_ij - alpha_i``).
* The bias that hands expert j exactly its fair share ``q = m k / n`` of the step's m
  tokens is therefore the (k/n)-quantile of ``r_{:,j}``. This is docs/design.md §6.1's
  ``b_hat_j = -quantile_{1-k/n}(s_{:,j} - alpha)`` with the sign folded into r.
* ``b = b_hat - mean(b_hat)``: routing ignores a common shift; centring keeps b bounded.

Quantile convention. Sort ``r_{:,j}`` ascending, ``r_(1) <= ... <= r_(m)``, and let
``Q = ceil(m k / n)``. Every value in ``(r_(Q), r_(Q+1))`` has exactly Q required biases
below it; the exact path takes the midpoint of that gap (``r_(m)`` itself when Q = m).
The histogram path (``QuantileHistogram``) finds the bin holding ``r_(Q)`` (the first bin
whose cumulative count reaches Q) and interpolates linearly inside it, so it lands in
the same bin as ``r_(Q)``: within one bin width of it. Ties are real: every token whose
(k+1)-th choice is j has ``r_ij = b_j`` (up to rounding), so when the quantile falls on that
point mass the exact path keeps ``b_hat_j = b_j`` and the count is exact only within the tie.

Why one QB step is not exactly balanced: ``alpha_i`` is the right threshold for the
experts token i already takes, but for the others the bar is the k-th score, and moving
all biases at once moves every cutoff. Repeating the update converges quickly (a few
steps from a badly skewed start); at the fixed point every expert gets q tokens.

Baselines kept as options: the DeepSeek sign update, an auxiliary loss, or nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe_lc.model.precision import upcast

BALANCING_MODES = ("qb", "sign", "aux", "none")


# --------------------------------------------------------------------------- checks


def _check_top_k(num_experts: int, top_k: int) -> None:
    if not 1 <= top_k < num_experts:
        raise ValueError(
            f"top_k={top_k} must be in [1, num_experts-1={num_experts - 1}]: "
            "quantile balancing routes with top-(k+1), so k must leave one expert out"
        )


def _check_scores(scores: Tensor, bias: Optional[Tensor] = None) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(
            f"router scores must be a float tensor of shape [tokens, experts], got "
            f"{tuple(scores.shape)} {scores.dtype}; flatten batch and sequence dims first"
        )
    if bias is not None and bias.shape != (scores.shape[1],):
        raise ValueError(
            f"bias shape {tuple(bias.shape)} does not match the {scores.shape[1]} experts in the scores"
        )


# --------------------------------------------------------------------------- routing


def route_with_cutoff(scores: Tensor, bias: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Top-k experts of ``scores + bias`` and each token's cutoff, the (k+1)-th biased score.

    Returns ``(topk_idx [m, k] long, cutoff [m])``, computed in at least fp32 (fp64 scores stay fp64, so
    that a float64 run routes as finely as it computes). No gradient flows: the bias selects only.
    """
    _check_scores(scores, bias)
    _check_top_k(scores.shape[1], top_k)
    biased = upcast(scores.detach()) + upcast(bias.detach())
    values, idx = biased.topk(top_k + 1, dim=-1)
    return idx[:, :top_k], values[:, top_k]


def required_bias(scores: Tensor, cutoff: Tensor) -> Tensor:
    """r_ij = alpha_i - s_ij: the smallest bias with which expert j would beat token i's cutoff."""
    return upcast(cutoff.detach())[:, None] - upcast(scores.detach())


def target_rank(num_tokens: int | Tensor, top_k: int, num_experts: int) -> int | Tensor:
    """Q = ceil(m k / n), the number of tokens each expert should take (exact integer arithmetic; m
    may be an integer tensor on the device)."""
    return -(-num_tokens * top_k // num_experts)


def quantile_of_required_bias(required: Tensor, top_k: int) -> Tensor:
    """Uncentred b_hat [n] (fp64) from required biases [m, n]: exactly Q = ceil(m k/n) lie below it.

    Midpoint of r_(Q) and r_(Q+1) per expert (see the module docstring for the convention).
    """
    m, n = required.shape
    if m == 0:
        raise ValueError("no tokens to balance: route at least one token before computing a bias")
    _check_top_k(n, top_k)
    rank = target_rank(m, top_k, n)
    ordered = required.double().sort(dim=0).values
    lower = ordered[rank - 1]
    upper = ordered[rank] if rank < m else lower
    return 0.5 * (lower + upper)


def centred(bias: Tensor) -> Tensor:
    """b - mean(b): routing is shift-invariant, so keep the bias centred and bounded."""
    return bias - bias.mean()


def quantile_balance(scores: Tensor, bias: Tensor, top_k: int) -> Tensor:
    """The exact QB update (docs/design.md §6.1): new centred fp32 bias from one step's scores [m, n]."""
    _, cutoff = route_with_cutoff(scores, bias, top_k)
    b_hat = quantile_of_required_bias(required_bias(scores, cutoff), top_k)
    return centred(b_hat).float()


# --------------------------------------------------------------------------- baselines and statistics


def sign_update(bias: Tensor, loads: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3 loss-free balancing: b_j += rate * sign(mean_load - load_j) (not centred)."""
    loads = loads.double()
    step = torch.sign(loads.mean() - loads) * rate
    return (bias.double() + step).to(bias.dtype)


def aux_balance_loss(scores: Tensor, topk_idx: Tensor, num_experts: int, top_k: int) -> Tensor:
    """Batch-level auxiliary balance loss L = n/(k m) * sum_j f_j P_j over the m tokens given.

    f_j: tokens routed to expert j (a count, no gradient); P_j = mean_i s_ij / sum_l s_il, the
    mean normalised score. L = 1 when both are uniform; dL/dP_j is proportional to f_j, so
    descent lowers the scores of overloaded experts most (Switch / DeepSeek style).
    """
    _check_scores(scores)
    m = scores.shape[0]
    if m == 0:
        return scores.sum() * 0.0
    counts = expert_loads(topk_idx, num_experts).to(scores.dtype)
    probs = scores / scores.sum(dim=-1, keepdim=True)
    mean_prob = probs.mean(dim=0)
    return num_experts / (top_k * m) * (counts * mean_prob).sum()


def count_indices(index: Tensor, size: int) -> Tensor:
    """How often each of 0..size-1 occurs in ``index``: int64 [size], computed on the device.

    A scatter-add rather than ``torch.bincount``: on CUDA bincount reads the largest index back to
    the host to size its output, which waits for every queued kernel.
    """
    flat = index.reshape(-1).long()
    return torch.zeros(size, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_loads(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert: int64 counts [n]."""
    return count_indices(topk_idx, num_experts)


def max_violation(loads: Tensor) -> Tensor:
    """MaxVio = (max load - mean load) / mean load, 0 when nothing was routed: an fp64 scalar tensor on
    the loads' device (the trainer reads it back with the rest of the step's numbers)."""
    loads = loads.double()
    mean = loads.mean()
    return torch.where(mean > 0, (loads.max() - mean) / mean, torch.zeros_like(mean))


def _all_reduce_sum(tensor: Tensor, group: Optional[Any]) -> None:
    """In-place sum over ``group`` (world when None); a no-op when there is nothing to reduce."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) == 1:
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _world_size(group: Optional[Any]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


# --------------------------------------------------------------------------- histogram estimator


class QuantileHistogram(nn.Module):
    """Distributed QB estimator: integer counts of required biases per expert, one all-reduce per step.

    The bias is constant within a step, so every rank and micro-batch bins over the same range
    ``[b_min - 1, b_max + 1]``, which holds every r_ij because s lies in [0, 1]. Counts are
    integers, so the result does not depend on how tokens are split over ranks or micro-batches.
    Buffers are non-persistent; ``ExpertBalancer`` checkpoints them through its extra state.
    """

    def __init__(self, num_experts: int, bins: int = 1024) -> None:
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"num_experts={num_experts}: balancing needs at least 2 experts")
        if bins < 2:
            raise ValueError(f"bins={bins} is too few for a quantile read-out; use ~1000")
        self.num_experts = num_experts
        self.bins = bins
        self.register_buffer("counts", torch.zeros(num_experts, bins, dtype=torch.int64), persistent=False)
        self.register_buffer("value_range", torch.tensor([-1.0, 1.0], dtype=torch.float64), persistent=False)

    @staticmethod
    def range_for(bias: Tensor) -> Tensor:
        """[b_min - 1, b_max + 1] in fp64: where r = alpha - s can lie for this bias."""
        bias = bias.detach().double()
        return torch.stack([bias.min() - 1.0, bias.max() + 1.0])

    def reset(self) -> None:
        self.counts.zero_()

    def add(self, scores: Tensor, bias: Tensor, cutoff: Tensor) -> None:
        """Scatter-add the required biases r_ij = alpha_i - s_ij of one micro-batch into the counts."""
        _check_scores(scores, bias)
        if scores.shape[1] != self.num_experts:
            raise ValueError(f"scores have {scores.shape[1]} experts, the histogram {self.num_experts}")
        self.add_required(required_bias(scores, cutoff), bias)

    def add_required(self, required: Tensor, bias: Tensor) -> None:
        """Bin precomputed required biases [m, n]; ``bias`` (constant within the step) fixes the range."""
        value_range = self.range_for(bias)
        self.value_range.copy_(value_range)
        lo, hi = value_range[0], value_range[1]
        width = (hi - lo) / self.bins
        bin_idx = ((required.double() - lo) / width).floor().long().clamp_(0, self.bins - 1)
        flat = bin_idx + torch.arange(self.num_experts, device=bin_idx.device)[None, :] * self.bins
        self.counts += count_indices(flat, self.num_experts * self.bins).view_as(self.counts)

    def all_reduce(self, group: Optional[Any] = None) -> None:
        """Sum the counts over every rank holding tokens of the step (one integer all-reduce)."""
        _all_reduce_sum(self.counts, group)

    def num_tokens(self) -> int:
        """Tokens binned so far (every token adds one count to each expert's row)."""
        return int(self.counts[0].sum().item())

    def bin_width(self) -> float:
        lo, hi = self.value_range.tolist()
        return (hi - lo) / self.bins

    def read_quantile(self, num_tokens_total: Optional[int], top_k: int) -> Tensor:
        """Uncentred b_hat [n] (fp64): where the interpolated count of r_{:,j} reaches Q = ceil(m k/n)."""
        m = self.num_tokens()
        if num_tokens_total is not None and num_tokens_total != m:
            raise ValueError(
                f"num_tokens_total={num_tokens_total} but the histogram holds {m} tokens per expert; "
                "all-reduce the counts first, or pass None to use the counts"
            )
        if m == 0:
            raise ValueError("the histogram is empty: add the step's scores before reading a bias")
        return self.quantile(top_k)

    def quantile(self, top_k: int) -> Tensor:
        """``read_quantile`` without its checks and host reads: the global m is the counts' own, all
        on the device; NaN where the histogram is empty (the balancer then keeps its bias)."""
        _check_top_k(self.num_experts, top_k)
        rank = target_rank(self.counts[0].sum(), top_k, self.num_experts)
        cumulative = self.counts.cumsum(dim=1)
        first = (cumulative < rank).sum(dim=1, keepdim=True)  # first bin whose cumulative count reaches Q
        in_bin = self.counts.gather(1, first)
        below = cumulative.gather(1, first) - in_bin
        fraction = (rank - below).double() / in_bin.double()
        lo, hi = self.value_range[0], self.value_range[1]
        width = (hi - lo) / self.bins
        return (lo + (first.double() + fraction) * width).squeeze(1)

    def read_bias(self, num_tokens_total: Optional[int], top_k: int) -> Tensor:
        """Centred fp32 bias from the counts; ``num_tokens_total`` (global m) may be None to derive it."""
        return centred(self.read_quantile(num_tokens_total, top_k)).float()


# --------------------------------------------------------------------------- the module


class ExpertBalancer(nn.Module):
    """Selects experts with ``scores + bias`` and keeps that bias balanced (docs/design.md §6).

    ``select`` routes (and, in training, accumulates the step's statistics); ``update`` is
    called by the trainer once per optimizer step after every micro-batch: it all-reduces
    the statistics over ``group``, sets the bias used from the next step on, records
    ``last_loads``/``last_maxvio`` and clears the accumulators. In eval nothing accumulates.

    State: ``bias`` is a persistent fp32 buffer. The step accumulators (loads, histogram or
    the exact path's required biases) are non-persistent buffers saved through
    ``get_extra_state``, so a checkpoint taken mid-step resumes the step on the same layout.
    Checkpoints normally fall on step boundaries, where the accumulators are empty.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        mode: str = "qb",
        bins: int = 1024,
        exact: bool = False,
        ema: float = 0.0,
        sign_rate: float = 1e-3,
        aux_coef: float = 1e-3,
    ) -> None:
        super().__init__()
        if mode not in BALANCING_MODES:
            raise ValueError(f"balancing mode {mode!r} is unknown: use one of {', '.join(BALANCING_MODES)}")
        _check_top_k(num_experts, top_k)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema={ema} must be in [0, 1) (0 disables the EMA)")
        if sign_rate < 0 or aux_coef < 0:
            raise ValueError(f"sign_rate={sign_rate} and aux_coef={aux_coef} must be >= 0")
        self.num_experts = num_experts
        self.top_k = top_k
        self.mode = mode
        self.exact = exact
        self.ema = ema
        self.sign_rate = sign_rate
        self.aux_coef = aux_coef
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("step_loads", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.uses_histogram = mode == "qb" and not exact
        self.histogram = QuantileHistogram(num_experts, bins) if self.uses_histogram else None
        self._step_required: list[Tensor] = []  # exact QB: the step's required biases, per micro-batch
        self.last_loads = torch.zeros(num_experts, dtype=torch.int64)
        self.last_maxvio = max_violation(self.last_loads)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, mode={self.mode!r}, exact={self.exact}"

    # -- routing ----------------------------------------------------------------------

    @torch.no_grad()
    def select(self, scores: Tensor, accumulate: Optional[bool] = None) -> Tensor:
        """Top-k experts [m, k] of ``scores + bias``; accumulates step statistics when training.

        ``accumulate`` overrides the default (``self.training``), e.g. False while an
        activation-checkpointed layer recomputes its forward.
        """
        _check_scores(scores, self.bias)
        accumulate = self.training if accumulate is None else accumulate
        # The same selection whether or not statistics accumulate (ties included), so that a
        # recomputed forward routes exactly like the original.
        if self.mode == "qb":
            topk_idx, cutoff = route_with_cutoff(scores, self.bias, self.top_k)
            if accumulate:
                required = required_bias(scores, cutoff)
                if self.histogram is not None:
                    self.histogram.add_required(required, self.bias)
                else:
                    self._step_required.append(required)
        else:
            topk_idx = (upcast(scores.detach()) + self.bias).topk(self.top_k, dim=-1).indices
        if accumulate:
            self.step_loads += expert_loads(topk_idx, self.num_experts)
        return topk_idx

    def fused_statistics(self) -> bool:
        """Whether the fused router's kernel (``add_routed``) keeps this balancer's step statistics:
        the loads, and QB's histogram; not the exact quantile's required biases or the aux loss."""
        return self.mode in ("sign", "none") or self.uses_histogram

    def add_routed(self, logits: Tensor, topk_idx: Tensor, cutoff: Tensor) -> None:
        """``select``'s statistics for a micro-batch the fused router selected (``moe_lc.ops.routing``)
        from its logits, its choice and its cutoff, in one kernel; nothing outside training."""
        if not self.training:
            return
        from moe_lc.ops.routing import route_statistics  # the op module routes with this one's selection

        hist = self.histogram
        if hist is not None and logits.shape[0] == 0:  # no tokens to bin: the range still follows the bias
            with torch.no_grad():
                hist.value_range.copy_(hist.range_for(self.bias))
        route_statistics(logits, self.bias, topk_idx, cutoff, self.step_loads,
                         hist.counts if hist is not None else None, hist.value_range if hist is not None else None)

    def aux_loss(self, scores: Tensor, topk_idx: Tensor) -> Optional[Tensor]:
        """aux_coef * auxiliary balance loss in mode "aux"; None otherwise."""
        if self.mode != "aux":
            return None
        return self.aux_coef * aux_balance_loss(scores, topk_idx, self.num_experts, self.top_k)

    # -- per-step update --------------------------------------------------------------

    @torch.no_grad()
    def update(self, group: Optional[Any] = None) -> None:
        """All-reduce the step's statistics over ``group`` and set the bias for the next step.

        Device work only, no host read: the trainer queues a whole step without waiting for the
        GPU. A step that routed nothing keeps the bias.
        """
        loads = self._reduced_loads(group)
        self.last_loads = loads
        self.last_maxvio = max_violation(loads)
        self.bias.copy_(self._new_bias())
        self._reset_step()

    def _reduced_loads(self, group: Optional[Any]) -> Tensor:
        """Global loads; for the histogram path the counts travel in the same all-reduce."""
        if self.histogram is not None:
            packed = torch.cat([self.step_loads, self.histogram.counts.reshape(-1)])
            _all_reduce_sum(packed, group)
            self.histogram.counts.copy_(packed[self.num_experts :].view_as(self.histogram.counts))
            return packed[: self.num_experts].clone()
        if self.mode == "qb" and _world_size(group) > 1:
            raise ValueError(
                "exact quantile balancing needs all of the step's tokens in one process; "
                "use the histogram estimator (exact=False) when training on several ranks"
            )
        loads = self.step_loads.clone()
        _all_reduce_sum(loads, group)
        return loads

    def _new_bias(self) -> Tensor:
        if self.mode == "qb":
            if self.histogram is not None:
                new = centred(self.histogram.quantile(self.top_k)).float()
                routed = self.histogram.counts[0].sum() > 0
                return torch.where(routed, self.ema * self.bias + (1.0 - self.ema) * new, self.bias)
            if not any(r.shape[0] for r in self._step_required):
                return self.bias
            new = centred(quantile_of_required_bias(torch.cat(self._step_required), self.top_k)).float()
            return self.ema * self.bias + (1.0 - self.ema) * new
        if self.mode == "sign":  # zero loads leave the bias as it is (sign 0)
            return sign_update(self.bias, self.last_loads, self.sign_rate)
        return self.bias  # "aux" and "none" keep b = 0

    def _reset_step(self) -> None:
        self.step_loads.zero_()
        if self.histogram is not None:
            self.histogram.reset()
        self._step_required = []

    # -- checkpointing of a partially accumulated step ------------------------------

    def get_extra_state(self) -> dict[str, Tensor]:
        state = {"step_loads": self.step_loads.clone()}
        if self.histogram is not None:
            state["hist_counts"] = self.histogram.counts.clone()
            state["hist_range"] = self.histogram.value_range.clone()
        elif self.mode == "qb":
            empty = self.bias.new_zeros(0, self.num_experts)
            state["step_required"] = torch.cat(self._step_required) if self._step_required else empty
        return state

    def set_extra_state(self, state: dict[str, Tensor]) -> None:
        device = self.bias.device
        self.step_loads.copy_(state["step_loads"].to(device))
        if self.histogram is not None:
            if "hist_counts" not in state or state["hist_counts"].shape != self.histogram.counts.shape:
                raise ValueError(
                    "checkpointed balancer state has no histogram of this shape "
                    f"({self.num_experts} experts x {self.histogram.bins} bins); resume with the same mode and bins"
                )
            self.histogram.counts.copy_(state["hist_counts"].to(device))
            self.histogram.value_range.copy_(state["hist_range"].to(device))
        elif self.mode == "qb":
            required = state.get("step_required")
            if required is None:
                raise ValueError("checkpointed balancer state lacks the exact path's required biases; resume with exact=True")
            self._step_required = [required.to(device)] if required.shape[0] > 0 else []
