"""Expert load balancing (docs/design.md §6): exact and histogram Quantile Balancing, baselines, statistics."""

from __future__ import annotations

import datetime
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_lc.model.balancing import (
    ExpertBalancer,
    QuantileHistogram,
    aux_balance_loss,
    centred,
    expert_loads,
    max_violation,
    quantile_balance,
    quantile_of_required_bias,
    required_bias,
    route_with_cutoff,
    sign_update,
    target_rank,
)

M, N, K = 16384, 64, 4  # tokens, routed experts, top-k: q = 1024 tokens per expert


class SkewedRouter:
    """Router scores with fixed per-expert logit offsets (std 2) and fresh per-token noise per batch."""

    def __init__(self, num_experts: int = N, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.randn(num_experts, generator=self.gen) * 2.0

    def batch(self, num_tokens: int = M) -> torch.Tensor:
        noise = torch.randn(num_tokens, self.offsets.numel(), generator=self.gen)
        return torch.sigmoid(self.offsets + noise)


def routed_maxvio(scores: torch.Tensor, bias: torch.Tensor, top_k: int = K) -> float:
    idx, _ = route_with_cutoff(scores, bias, top_k)
    return max_violation(expert_loads(idx, scores.shape[1]))


def balanced_bias(router: SkewedRouter, steps: int = 3) -> torch.Tensor:
    """A non-trivial bias (a few exact QB steps) so cutoffs mix biased scores of many experts."""
    bias = torch.zeros(router.offsets.numel())
    for _ in range(steps):
        bias = quantile_balance(router.batch(4096), bias, K)
    return bias


# --------------------------------------------------------------------------- exact QB


def test_exact_qb_balances_a_fixed_skewed_batch_within_ten_updates():
    scores = SkewedRouter().batch()
    bias = torch.zeros(N)
    start = routed_maxvio(scores, bias)
    assert start > 10.0, f"the test batch should start badly skewed, MaxVio={start}"
    history = []
    for _ in range(10):
        bias = quantile_balance(scores, bias, K)
        history.append(routed_maxvio(scores, bias))
    assert history[-1] < 0.05, history
    assert history[0] < start / 5, history  # one step already removes most of the skew


def test_qb_on_fresh_batches_beats_the_sign_update():
    """Each batch is routed with the bias computed from the batches before it (never from itself)."""
    router = SkewedRouter()
    exact = ExpertBalancer(N, K, mode="qb", exact=True)
    binned = ExpertBalancer(N, K, mode="qb", bins=1024)
    sign = ExpertBalancer(N, K, mode="sign", sign_rate=1e-3)
    balancers = {"exact": exact, "histogram": binned, "sign": sign}
    maxvio = {}
    for _ in range(6):  # MaxVio of the 6th batch = after 5 updates
        scores = router.batch()
        for name, balancer in balancers.items():
            balancer.select(scores)
            balancer.update()
            maxvio[name] = balancer.last_maxvio
    assert maxvio["exact"] < 0.3 and maxvio["histogram"] < 0.3, maxvio
    assert maxvio["sign"] > 1.0, maxvio


def test_exact_update_gives_every_expert_exactly_q_tokens_above_the_step_cutoffs():
    """After one update, exactly Q = ceil(mk/n) tokens per expert beat the cutoff they were routed with.

    Ties: a token whose (k+1)-th choice is expert j has r_ij = alpha_i - s_ij = b_j (up to
    rounding), so r has a point mass at the old bias. When the quantile falls on it, the count
    is exact only within that tie. (Re-routing with the new bias is not exactly balanced in
    one step, because moving all biases moves the cutoffs too; see the first test.)
    """
    router = SkewedRouter(seed=1)
    bias = balanced_bias(router)
    scores = router.batch(5001)  # m k / n = 312.56: exercises the ceiling
    rank = target_rank(5001, K, N)
    assert rank == 313
    _, cutoff = route_with_cutoff(scores, bias, K)
    r = required_bias(scores, cutoff).double()  # r_ij = alpha_i - s_ij = -(margin s_ij - alpha_i)
    b_hat = quantile_of_required_bias(r, K)
    beat = (-r > -b_hat).sum(dim=0)  # margins above the new threshold -b_hat_j
    beat_or_tie = (-r >= -b_hat).sum(dim=0)
    assert torch.all(beat <= rank) and torch.all(rank <= beat_or_tie)
    # Independent order statistics: b_hat lies between the Q-th and (Q+1)-th required bias.
    q_th, next_th = r.kthvalue(rank, dim=0).values, r.kthvalue(rank + 1, dim=0).values
    untied = q_th < next_th
    assert untied.sum() >= N // 2, "the check below needs experts without a tie at the quantile"
    assert torch.equal(beat[untied], torch.full_like(beat[untied], rank))
    assert torch.all((q_th < b_hat)[untied] & (b_hat < next_th)[untied])
    assert torch.allclose(b_hat[~untied], bias.double()[~untied], rtol=0, atol=1e-6)
    new_bias = quantile_balance(scores, bias, K)
    torch.testing.assert_close(new_bias.double(), b_hat - b_hat.mean(), rtol=0, atol=1e-6)
    assert new_bias.dtype == torch.float32 and abs(new_bias.double().mean().item()) < 1e-6


def test_route_with_cutoff_takes_top_k_and_the_next_biased_score():
    gen = torch.Generator().manual_seed(3)
    scores, bias = torch.rand(50, 8, generator=gen), torch.randn(8, generator=gen) * 0.1
    idx, cutoff = route_with_cutoff(scores, bias, 3)
    biased = (scores + bias).numpy()
    for i in range(50):
        order = np.argsort(-biased[i])
        assert set(idx[i].tolist()) == set(order[:3].tolist())
        assert cutoff[i].item() == pytest.approx(biased[i, order[3]], abs=1e-7)
    assert idx.dtype == torch.long and idx.shape == (50, 3)


# --------------------------------------------------------------------------- histogram estimator


def filled_histogram(scores, bias, parts: int = 1, bins: int = 1024) -> QuantileHistogram:
    histogram = QuantileHistogram(N, bins)
    for chunk in scores.tensor_split(parts):
        _, cutoff = route_with_cutoff(chunk, bias, K)
        histogram.add(chunk, bias, cutoff)
    return histogram


def test_histogram_reads_the_exact_quantile_within_one_bin():
    router = SkewedRouter(seed=2)
    bias = balanced_bias(router)
    scores = router.batch()
    histogram = filled_histogram(scores, bias)
    width = histogram.bin_width()
    assert width == pytest.approx((bias.max() - bias.min() + 2).item() / 1024)
    _, cutoff = route_with_cutoff(scores, bias, K)
    r = required_bias(scores, cutoff).double()
    order_stat = r.kthvalue(M * K // N, dim=0).values  # r_(Q): the histogram reads its bin
    estimate = histogram.read_quantile(None, K)
    assert (estimate - order_stat).abs().max().item() <= width * (1 + 1e-9)
    exact = quantile_of_required_bias(r, K)
    assert (estimate - exact).abs().max().item() <= width
    # Centred: each side moves by its mean, so the two differ by at most two bin widths.
    read = histogram.read_bias(M, K)
    assert (read.double() - quantile_balance(scores, bias, K).double()).abs().max().item() <= 2 * width
    assert (read.double() - centred(estimate)).abs().max().item() < 1e-6


def test_histogram_counts_match_independent_binning():
    router = SkewedRouter(seed=4)
    bias = balanced_bias(router)
    scores = router.batch(3000)
    histogram = filled_histogram(scores, bias, bins=100)
    _, cutoff = route_with_cutoff(scores, bias, K)
    r = (cutoff.double()[:, None] - scores.double()).numpy()
    lo, hi = bias.min().item() - 1.0, bias.max().item() + 1.0
    reference = np.stack([np.histogram(r[:, j], bins=100, range=(lo, hi))[0] for j in range(N)])
    assert histogram.num_tokens() == 3000
    assert np.abs(histogram.counts.numpy() - reference).sum() <= 4  # fp32 vs fp64 r at bin edges


def test_histogram_is_invariant_to_the_micro_batch_split():
    router = SkewedRouter(seed=5)
    bias = balanced_bias(router)
    scores = router.batch(7000)
    histograms = [filled_histogram(scores, bias, parts) for parts in (1, 3, 7)]
    for other in histograms[1:]:
        assert torch.equal(other.counts, histograms[0].counts)
        assert torch.equal(other.read_bias(None, K), histograms[0].read_bias(None, K))


def test_histogram_rejects_a_wrong_token_count_and_an_empty_read():
    histogram = QuantileHistogram(N, 64)
    with pytest.raises(ValueError, match="empty"):
        histogram.read_bias(None, K)
    scores = SkewedRouter().batch(100)
    _, cutoff = route_with_cutoff(scores, torch.zeros(N), K)
    histogram.add(scores, torch.zeros(N), cutoff)
    with pytest.raises(ValueError, match="all-reduce"):
        histogram.read_bias(200, K)


# --------------------------------------------------------------------------- the module


def test_balancer_routes_with_the_previous_bias_and_updates_after_the_step():
    router = SkewedRouter(seed=6)
    balancer = ExpertBalancer(N, K, mode="qb", exact=True)
    scores = router.batch(4000)
    old_bias = balanced_bias(router)
    balancer.bias.copy_(old_bias)
    micro = scores.tensor_split(3)
    picked = torch.cat([balancer.select(chunk) for chunk in micro])
    assert torch.equal(balancer.bias, old_bias)  # selection never moves the bias
    expected_idx, _ = route_with_cutoff(scores, old_bias, K)
    assert torch.equal(picked, expected_idx)
    balancer.update()
    torch.testing.assert_close(balancer.bias, quantile_balance(scores, old_bias, K), rtol=0, atol=1e-6)
    assert torch.equal(balancer.last_loads, expert_loads(expected_idx, N))
    assert balancer.last_maxvio == pytest.approx(max_violation(expert_loads(expected_idx, N)))
    assert balancer.step_loads.sum().item() == 0  # accumulators were reset


def test_histogram_balancer_agrees_with_exact_balancer_within_two_bins():
    router = SkewedRouter(seed=7)
    start = balanced_bias(router)
    exact, binned = ExpertBalancer(N, K, exact=True), ExpertBalancer(N, K, bins=1024)
    for balancer in (exact, binned):
        balancer.bias.copy_(start)
    scores = router.batch(8000)
    for chunk in scores.tensor_split(4):
        exact.select(chunk)
        binned.select(chunk)
    width = binned.histogram.bin_width()
    exact.update()
    binned.update()
    assert (exact.bias - binned.bias).abs().max().item() <= 2 * width


def test_eval_mode_freezes_the_bias_and_accumulates_nothing():
    router = SkewedRouter(seed=8)
    balancer = ExpertBalancer(N, K, bins=256)
    balancer.bias.copy_(balanced_bias(router))
    frozen = balancer.bias.clone()
    balancer.eval()
    balancer.select(router.batch(1000))
    assert balancer.step_loads.sum().item() == 0 and balancer.histogram.counts.sum().item() == 0
    balancer.update()
    assert torch.equal(balancer.bias, frozen)


def test_mode_none_keeps_zero_bias_but_reports_loads():
    scores = SkewedRouter(seed=9).batch(2000)
    balancer = ExpertBalancer(N, K, mode="none")
    idx = balancer.select(scores)
    balancer.update()
    assert torch.equal(balancer.bias, torch.zeros(N))
    assert torch.equal(idx, scores.topk(K, dim=-1).indices)
    assert torch.equal(balancer.last_loads, expert_loads(idx, N))
    assert balancer.last_maxvio > 10.0


def test_ema_blends_the_old_and_the_new_bias():
    router = SkewedRouter(seed=10)
    old = balanced_bias(router)
    scores = router.batch(3000)
    balancer = ExpertBalancer(N, K, exact=True, ema=0.75)
    balancer.bias.copy_(old)
    balancer.select(scores)
    balancer.update()
    expected = 0.75 * old + 0.25 * quantile_balance(scores, old, K)
    torch.testing.assert_close(balancer.bias, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("exact", [False, True])
def test_a_mid_step_checkpoint_resumes_the_step(exact):
    router = SkewedRouter(seed=11)
    start = balanced_bias(router)
    first, second = router.batch(2000), router.batch(2000)
    original = ExpertBalancer(N, K, exact=exact, bins=512)
    original.bias.copy_(start)
    original.select(first)
    state = original.state_dict()
    assert "bias" in state and torch.equal(state["bias"], start)
    resumed = ExpertBalancer(N, K, exact=exact, bins=512)
    resumed.load_state_dict(state)
    for balancer in (original, resumed):
        balancer.select(second)
        balancer.update()
    assert torch.equal(resumed.bias, original.bias)
    assert not torch.equal(original.bias, start)


def test_sign_update_moves_each_bias_by_the_rate_towards_the_mean_load():
    loads = torch.tensor([10, 30, 20, 20, 5, 35])  # mean 20
    bias = torch.tensor([0.5, -0.5, 0.0, 0.1, 0.0, 0.0])
    new = sign_update(bias, loads, rate=0.01)
    expected = bias + 0.01 * torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0])
    torch.testing.assert_close(new, expected)
    balancer = ExpertBalancer(6, 2, mode="sign", sign_rate=0.01)
    idx = torch.tensor([[0, 1], [1, 2], [1, 3], [1, 0]])  # loads [2, 4, 1, 1, 0, 0], mean 4/3
    balancer.select(torch.nn.functional.one_hot(idx, 6).sum(1).float() + 0.01 * torch.arange(6.0))
    balancer.update()
    torch.testing.assert_close(balancer.bias, 0.01 * torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0]))


def aux_loss_reference(scores: torch.Tensor, topk_idx: torch.Tensor, n: int, k: int) -> float:
    """n/(k m) sum_j f_j P_j written out with python loops in float64."""
    s, idx = scores.double().tolist(), topk_idx.tolist()
    m = len(s)
    f = [sum(row.count(j) for row in idx) for j in range(n)]
    p = [sum(s[i][j] / sum(s[i]) for i in range(m)) / m for j in range(n)]
    return n / (k * m) * sum(fj * pj for fj, pj in zip(f, p))


def test_aux_loss_value_and_its_gradient_push_overloaded_experts_down():
    gen = torch.Generator().manual_seed(12)
    n, k = 8, 2
    logits = (torch.randn(n, generator=gen) * 2 + torch.randn(300, n, generator=gen)).requires_grad_()
    scores = torch.sigmoid(logits)
    idx, _ = route_with_cutoff(scores, torch.zeros(n), k)
    loss = aux_balance_loss(scores, idx, n, k)
    assert loss.item() == pytest.approx(aux_loss_reference(scores, idx, n, k), rel=1e-6)
    loss.backward()
    loads = expert_loads(idx, n)
    grad_per_expert = logits.grad.sum(dim=0)
    assert grad_per_expert[loads.argmax()] > 0  # descent lowers the most loaded expert's scores
    assert grad_per_expert[loads.argmin()] < 0  # and raises the least loaded one's
    uniform = aux_balance_loss(torch.full((4, 4), 0.3), torch.tensor([[0], [1], [2], [3]]), 4, 1)
    assert uniform.item() == pytest.approx(1.0)
    balancer = ExpertBalancer(n, k, mode="aux", aux_coef=0.01)
    assert balancer.aux_loss(scores, idx).item() == pytest.approx(0.01 * loss.item())
    assert ExpertBalancer(n, k, mode="qb").aux_loss(scores, idx) is None


def test_max_violation_and_loads_on_known_values():
    assert max_violation(torch.tensor([2, 4, 6, 8])) == pytest.approx(0.6)  # (8 - 5) / 5
    assert max_violation(torch.tensor([3, 3, 3])) == 0.0
    assert max_violation(torch.zeros(4, dtype=torch.int64)) == 0.0
    idx = torch.tensor([[0, 2], [2, 3], [2, 0]])
    assert expert_loads(idx, 5).tolist() == [2, 0, 3, 1, 0]


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="mode"):
        ExpertBalancer(8, 2, mode="loss-free")
    with pytest.raises(ValueError, match="top_k"):
        ExpertBalancer(8, 8)
    with pytest.raises(ValueError, match="ema"):
        ExpertBalancer(8, 2, ema=1.0)
    with pytest.raises(ValueError, match="tokens, experts"):
        ExpertBalancer(8, 2).select(torch.rand(2, 3, 8))
    with pytest.raises(ValueError, match="bias shape"):
        route_with_cutoff(torch.rand(4, 8), torch.zeros(7), 2)
    with pytest.raises(ValueError, match="no tokens"):
        quantile_of_required_bias(torch.zeros(0, 8), 2)


# --------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_steps(balancer: ExpertBalancer, batches: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """Each rank routes its share of every batch in two micro-batches; returns the bias after each step."""
    biases = []
    for scores in batches:
        for chunk in scores.tensor_split(world)[rank].tensor_split(2):
            balancer.select(chunk)
        balancer.update()
        biases.append(balancer.bias.clone())
    return biases


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        router = SkewedRouter(seed=13)
        batches = [router.batch(6000), router.batch(6000)]
        result = {}
        for mode in ("qb", "sign"):
            balancer = ExpertBalancer(N, K, mode=mode, bins=512)
            result[mode] = _two_steps(balancer, batches, rank, world)
            result[mode + "_loads"] = balancer.last_loads
        exact = ExpertBalancer(N, K, exact=True)
        exact.select(batches[0][:10])
        try:
            exact.update()
            result["exact_error"] = ""
        except ValueError as error:
            result["exact_error"] = str(error)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_distributed_update_equals_a_single_process_update(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    router = SkewedRouter(seed=13)
    batches = [router.batch(6000), router.batch(6000)]
    for mode in ("qb", "sign"):
        single = ExpertBalancer(N, K, mode=mode, bins=512)
        reference = _two_steps(single, batches, rank=0, world=1)
        for result in ranks:
            for got, want in zip(result[mode], reference):
                assert torch.equal(got, want), mode
            assert torch.equal(result[mode + "_loads"], single.last_loads)
        assert not torch.equal(reference[0], reference[1])
    for result in ranks:
        assert "exact=False" in result["exact_error"]
