"""Bad steps change nothing and bad state is never saved.

- The skip itself: a fused AdamW told "not finite" on the device, and any other optimizer
  told on the host, leave parameters, moments and step counts bitwise as they were.
- Two ranks (gloo, ZeRO-1: every rank holds the whole model): a NaN gradient injected on one
  rank skips the step on both; their parameters stay bitwise equal, and equal to a run that
  leaves that step out by construction.
- The trainer: a NaN loss is logged `skipped: true` and training goes on; too many in a row
  stop the run with one line (exit code 1); a state that is not finite is not checkpointed;
  `optim.lr=1e38` is one line (exit code 2); a loss spike rolls back to the stage's newest
  checkpoint and trains on without the spiking batch.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.distributed as dist

import moe_lc.train.step as step_module
from moe_lc.data.packing import IGNORE_INDEX, Sample, collate
from moe_lc.model.transformer import MoELCModel
from moe_lc.optim import OptimConfig, clip_divisor, clip_grad_norm
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.presets import get_preset
from moe_lc.train.bad_steps import SpikeDetector, step_if_finite
from moe_lc.train.main import run_train_cli
from moe_lc.train.model_setup import build_model_state
from moe_lc.train.runtime import Runtime
from moe_lc.train.step import train_step
from parallel_harness import run_distributed

FOUR_STEPS = [
    "curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=4", "curriculum.stages.ctx256.global_batch_tokens=512",
    "curriculum.stages.ctx256.micro_batch=2", "eval.sequences=0", "eval.passkey_documents=0", "logging.progress=none",
    "logging.tensorboard=false", "report.at_end=false", "threads=1",
]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the skip


def _adam_state(opt: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    return [t.clone() for p in params for t in (p.detach(), *opt.state[p].values())]


@pytest.mark.parametrize("fused", [True, False])
def test_a_skipped_update_leaves_parameters_moments_and_step_counts_bitwise(fused):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
    for p in params:
        p.grad = torch.randn_like(p)
    step_if_finite(opt, torch.tensor(True))  # creates the state
    before = _adam_state(opt, params)
    for p in params:
        p.grad = torch.full_like(p, math.nan)
    step_if_finite(opt, torch.tensor(False))
    after = _adam_state(opt, params)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # and a finite flag is a plain step
    twin = [torch.nn.Parameter(t.detach().clone()) for t in params]
    plain = torch.optim.AdamW(twin, lr=1e-2, fused=fused)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would alias the moments
    for p, q in zip(params, twin):
        p.grad = q.grad = torch.randn_like(p)
    step_if_finite(opt, torch.tensor(True))
    plain.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    assert not hasattr(opt, "found_inf")


def test_clipping_folded_into_the_fused_update_equals_clipping_first():
    """The trainer's fused AdamW divides the gradients by ``clip_divisor`` as it reads them instead
    of a separate clipping pass: the moments and parameters must be those of clipping first (to
    fp32 rounding: a division where the clip multiplies), and a norm under the limit divides by 1."""
    torch.manual_seed(0)
    shapes = [(5, 3), (7,)]
    start = [torch.randn(s) for s in shapes]
    first = [torch.nn.Parameter(t.clone()) for t in start]
    folded = [torch.nn.Parameter(t.clone()) for t in start]
    opt_first = torch.optim.AdamW(first, lr=1e-2, fused=True)
    opt_folded = torch.optim.AdamW(folded, lr=1e-2, fused=True)
    for scale in (5.0, 0.01, 3.0):  # over, under, over the limit of 1.0
        grads = [torch.randn(s) * scale for s in shapes]
        for p, q, g in zip(first, folded, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm_first = clip_grad_norm(first, 1.0)
        norm = clip_grad_norm(folded, 1.0, scale_grads=False)
        assert all(torch.equal(q.grad, g) for q, g in zip(folded, grads))  # measured, not scaled
        assert torch.equal(norm, norm_first)
        opt_first.step()
        step_if_finite(opt_folded, torch.tensor(True), clip_divisor(norm, 1.0))
        for p, q in zip(first, folded):
            for key in ("exp_avg", "exp_avg_sq"):  # the moments hold the clipped gradient itself
                torch.testing.assert_close(opt_folded.state[q][key], opt_first.state[p][key], rtol=1e-6, atol=0)
            torch.testing.assert_close(q, p, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="fused"):
        step_if_finite(torch.optim.SGD(folded, lr=0.1), torch.tensor(True), torch.tensor(2.0))


# ----------------------------------------------------------------------------- two ranks


def _micro_batches(step: int, rank: int, vocab: int) -> list:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (96,), generator=gen)
    labels = torch.full((96,), IGNORE_INDEX, dtype=torch.int64)
    labels[:-1] = ids[1:]
    return [collate([Sample(ids, labels, torch.tensor([0, 40, 96], dtype=torch.int32))])]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _three_steps(leave_out_step_1: bool) -> dict:
    """Steps 0..2 on 2 ZeRO-1 ranks; step 1 gets a NaN gradient on rank 1, or is left out."""
    rank = dist.get_rank()
    runtime = Runtime(rank, 2, rank, torch.device("cpu"), torch.float32, False, 60.0)
    cfg, optim = get_preset("tiny"), OptimConfig(lr=1e-3)
    layout = ParallelLayout(dp_shard=2, dp_mode="zero1", world_size=2).resolve(2)
    state = build_model_state(cfg, optim, layout, runtime, seed=0)
    real_clip = state.clip_grad_norm
    skipped = []
    for step in range(3):
        if step == 1 and leave_out_step_1:
            continue
        if step == 1 and rank == 1:
            def poisoned(max_norm: float, **options) -> torch.Tensor:
                grad = next(p.grad for p in state.model.parameters() if p.grad is not None)
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.nan  # in place
                return real_clip(max_norm, **options)
            state.clip_grad_norm = poisoned
        result = train_step(state, _micro_batches(step, rank, cfg.vocab_size), step, 10, optim, runtime)
        state.clip_grad_norm = real_clip
        skipped.append(result.skipped)
    params = {n: _local(p) for n, p in state.model.named_parameters()}
    biases = [_local(m.balancer.bias) for m in state.model.moe_layers()]
    return {"skipped": skipped, "params": params, "biases": biases}


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank():
    guarded = run_distributed(_three_steps, 2, False, timeout=200)
    reference = run_distributed(_three_steps, 2, True, timeout=200)
    assert [r["skipped"] for r in guarded] == [[False, True, False]] * 2
    assert [r["skipped"] for r in reference] == [[False, False]] * 2
    for got in guarded[1:]:  # the ranks hold the same model (ZeRO-1 replicates parameters)
        assert all(torch.equal(got["params"][n], guarded[0]["params"][n]) for n in got["params"])
    for got, want in zip(guarded, reference):  # and the same as leaving step 1 out
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
        assert all(torch.equal(a, b) for a, b in zip(got["biases"], want["biases"]))


# ----------------------------------------------------------------------------- the trainer


@pytest.fixture
def nan_loss_at(monkeypatch):
    """Make the LM loss NaN in the forward passes of the given (1-based) steps (one micro-batch per step)."""
    real_forward, calls = MoELCModel.forward, []

    def install(steps: set[int]) -> None:
        def forward(self, *args, **kwargs):
            out = real_forward(self, *args, **kwargs)
            if self.training:
                calls.append(1)
                if len(calls) in steps:
                    out.loss = out.loss * math.nan
                    out.lm_loss = out.lm_loss * math.nan
            return out

        monkeypatch.setattr(MoELCModel, "forward", forward)

    return install


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_nan_loss_is_skipped_logged_and_training_goes_on(tmp_path, nan_loss_at):
    nan_loss_at({2})
    assert run_train_cli([*FOUR_STEPS, f"run_dir={tmp_path}"]) == 0
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in records] == [False, True, False, False]
    assert math.isnan(records[1]["loss"]) and all(math.isfinite(r["loss"]) for r in records[2:])
    assert "warning: step 2 skipped" in (tmp_path / "train.log").read_text()


@pytest.mark.usefixtures("shared_corpus_cache")
def test_too_many_skipped_steps_in_a_row_stop_the_run_with_one_line(tmp_path, capsys, nan_loss_at):
    nan_loss_at({2, 3})
    assert run_train_cli([*FOUR_STEPS, f"run_dir={tmp_path}", "bad_steps.max_consecutive_skips=2",
                          "checkpoint.every=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "step 3 had loss nan" in err and "2 in a row (bad_steps.max_consecutive_skips)" in err
    # the steps it skipped changed nothing, so their checkpoint (step 2) holds step 1's state
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_state_that_is_not_finite_is_never_checkpointed(tmp_path, capsys, monkeypatch):
    real_step = step_module.train_step

    def poisoning_step(state, micro, step, *args, **kwargs):
        result = real_step(state, micro, step, *args, **kwargs)
        if step == 1:  # a moment overflowed in step 2's update (its weights are still finite)
            moments = next(iter(state.optimizer.state.values()))
            moments["exp_avg_sq"].view(-1)[0] = math.inf
        return result

    monkeypatch.setattr(step_module, "train_step", poisoning_step)
    assert run_train_cli([*FOUR_STEPS, f"run_dir={tmp_path}", "checkpoint.every=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the state at step 2 is not finite (optimizer exp_avg_sq of" in err and "not checkpointed" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001"]


@pytest.mark.usefixtures("shared_corpus_cache")
def test_an_absurd_learning_rate_is_one_line(tmp_path, capsys):
    assert run_train_cli([*FOUR_STEPS, f"run_dir={tmp_path}", "optim.lr=1e38"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: optim.lr=1e+38: the optimizer update of step 1 overflows float32")


@pytest.mark.usefixtures("shared_corpus_cache")
def test_an_absurd_learning_rate_is_one_line_where_the_optimizer_does_not_raise(tmp_path, capsys, monkeypatch):
    """CUDA's fused AdamW computes its step size on the device and writes inf weights without an
    error (CPU AdamW raises): the trainer checks the step size itself, before the update."""
    def silent_step(optimizer, finite):
        raise AssertionError("the update ran with a step size beyond float32")

    monkeypatch.setattr(step_module, "step_if_finite", silent_step)
    assert run_train_cli([*FOUR_STEPS, f"run_dir={tmp_path}", "optim.lr=1e38"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: optim.lr=1e+38: the optimizer update of step 1 overflows float32"), err
    # the bound itself: lr / (1 - beta1^t) against float32's largest value, t = step + 1
    assert step_module.adam_step_overflows(3.5e37, 0.9, 0) and not step_module.adam_step_overflows(3.3e37, 0.9, 0)
    assert not step_module.adam_step_overflows(3.3e38, 0.9, 200) and step_module.adam_step_overflows(3.5e38, 0.9, 200)


def test_a_spike_is_a_loss_above_mean_plus_k_std_of_a_full_window():
    spikes = SpikeDetector(window=3, sigmas=2.0)
    assert [spikes.observe(s, v) for s, v in enumerate([5.0, 4.0, 100.0])] == [None] * 3  # window not full yet
    spike = spikes.observe(3, 200.0)
    values = [5.0, 4.0, 100.0]
    mean = sum(values) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    assert spike is not None and spike.mean == pytest.approx(mean) and spike.std == pytest.approx(std)
    assert spikes.observe(4, mean + 2.0 * std - 1e-9) is None  # just below the bar
    spikes.rewind(1)  # steps 2.. are redone after a rollback: the window holds step 1's loss only
    assert spikes.observe(2, 1e9) is None and spikes.observe(3, 1e9) is None  # filling again
    assert spikes.observe(4, 1e12) is not None
    assert SpikeDetector(window=3, sigmas=0.0).observe(0, math.inf) is None  # off


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_loss_spike_rolls_back_and_skips_the_spiking_batch(tmp_path, monkeypatch):
    real_step, seen = step_module.train_step, []

    def spiking_step(state, micro, step, *args, **kwargs):
        result = real_step(state, micro, step, *args, **kwargs)
        seen.append(step)
        if step == 5 and seen.count(5) == 1:  # the first time step 6 runs
            result.loss *= 10
        return result

    monkeypatch.setattr(step_module, "train_step", spiking_step)
    args = [*FOUR_STEPS, "curriculum.stages.ctx256.steps=8", f"run_dir={tmp_path}", "checkpoint.every=2",
            "checkpoint.keep_last=10", "bad_steps.spike_window=4", "bad_steps.spike_sigmas=6",
            "bad_steps.spike_rollback=true"]
    assert run_train_cli(args) == 0
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # 5 and 6 redone after the rollback
    assert records[5]["spike"]["rolled_back_to"] == 4 and "spike" not in records[7]
    assert records[6]["loss"] == records[4]["loss"]  # step 5 again, from the step-4 checkpoint: bitwise
    assert records[7]["loss"] != records[5]["loss"] / 10  # step 6 trained on the batch after the spiking one
    trainer = json.loads((tmp_path / "checkpoints" / "step_00000008" / "trainer.json").read_text())
    assert trainer["consumed"]["ctx256"] == 9 * 2  # one batch of 2 sequences more than 8 steps take
    log = (tmp_path / "train.log").read_text()
    assert "loss spike at step 6" in log and "rolling back to step 4" in log
