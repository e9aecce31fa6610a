"""A training step queues its work without waiting for the device and reads back once, at its
end; it reports the attention keys of its documents; a micro-batch without labels adds nothing.

Host reads: on a GPU the step runs under `torch.cuda.set_sync_debug_mode("error")`, which turns
every wait for the device into an error (the documented end-of-step read lifts it for itself).
On a CPU nothing waits, so the same structure counts the Python-level host reads
(`Tensor.item`, `tolist`, `__bool__`, `__float__`, `__int__`, `__index__`) that the step's own
code makes: the trainer's modules, the optimizer helpers, the parallel helpers and the expert
balancer. The model's forward and backward (moe_lc.model, moe_lc.ops) legitimately read host
tensors on a CPU and are left to the GPU test.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch

from moe_lc.data.packing import IGNORE_INDEX, Sample, collate
from moe_lc.optim import OptimConfig
from moe_lc.optim.groups import param_groups
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.presets import get_preset
from moe_lc.train.model_setup import build_model_state
from moe_lc.train.runtime import Runtime, compute_dtype
from moe_lc.train.step import train_step

STEP_CODE = ("moe_lc.train", "moe_lc.optim", "moe_lc.parallel", "moe_lc.model.balancing")
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
TOTAL_STEPS = 10


def _runtime(device: torch.device) -> Runtime:
    return Runtime(0, 1, 0, device, compute_dtype("auto", device), False)


def _state(runtime: Runtime, seed: int = 0):
    cfg = get_preset("tiny")
    return cfg, build_model_state(cfg, OptimConfig(lr=1e-3), ParallelLayout().resolve(1), runtime, seed)


def _batch(doc_lengths: list[int], vocab: int, seed: int, labelled: bool = True):
    """One packed micro-batch of documents with the given lengths (next-token labels inside each)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(doc_lengths)
    ids = torch.randint(0, vocab, (total,), generator=gen)
    labels = torch.full((total,), IGNORE_INDEX, dtype=torch.int64)
    cu = [0]
    for n in doc_lengths:
        start = cu[-1]
        if labelled:
            labels[start : start + n - 1] = ids[start + 1 : start + n]
        cu.append(start + n)
    return collate([Sample(ids, labels, torch.tensor(cu, dtype=torch.int32))])


def _micro_batches(vocab: int, seed: int = 1) -> list:
    return [_batch([40, 24, 64], vocab, seed), _batch([128], vocab, seed + 1)]


@pytest.mark.parametrize("fused", [True, False])
def test_the_step_reads_back_once_on_cpu(monkeypatch, fused):
    """With a fused AdamW (the GPU default) a step whose loss or gradient is not finite is skipped on
    the device; another optimizer reads that flag back first, a second read."""
    runtime = _runtime(torch.device("cpu"))
    cfg, state = _state(runtime)
    if fused:
        state.optimizer = torch.optim.AdamW(param_groups(state.model, 0.1), lr=1e-3, fused=True)
    micro = _micro_batches(cfg.vocab_size)
    reads: list[str] = []

    def counted(name: str, real):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(STEP_CODE):
                reads.append(f"{name} in {caller}")
            return real(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for step in range(2):  # the first step also creates the optimizer state
        reads.clear()
        result = train_step(state, micro, step, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
        skip_flag = [] if fused else ["__bool__ in moe_lc.train.bad_steps"]
        assert reads == [*skip_flag, "tolist in moe_lc.train.step"], reads
        assert math.isfinite(result.loss) and result.grad_norm > 0


def test_a_fused_adamw_clips_as_it_reads_the_gradients_as_clipping_first_would():
    """With a fused AdamW the step hands the clip to the optimizer (its grad_scale input) instead of
    scaling the gradients first: the moments after a clipped step must hold the clipped gradient,
    as the unfused AdamW's do (to fp32 rounding), and the logged norm is the unclipped one."""
    runtime = _runtime(torch.device("cpu"))
    optim = OptimConfig(lr=1e-3, grad_clip=0.05)
    runs = []
    for fused in (True, False):
        cfg, state = _state(runtime)
        state.optimizer = torch.optim.AdamW(param_groups(state.model, 0.1), lr=1e-3, fused=fused)
        result = train_step(state, _micro_batches(cfg.vocab_size), 0, TOTAL_STEPS, optim, runtime)
        runs.append((result, state))
    (fused_result, fused_state), (plain_result, plain_state) = runs
    assert fused_result.grad_norm == plain_result.grad_norm > 10 * optim.grad_clip  # clipping was active
    for p, q in zip(fused_state.model.parameters(), plain_state.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused_state.optimizer.state[p][key], plain_state.optimizer.state[q][key],
                                       rtol=1e-5, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_step_waits_for_the_gpu_only_at_its_end():
    runtime = _runtime(torch.device("cuda", torch.cuda.current_device()))
    cfg, state = _state(runtime)
    micro = [_pinned(b) for b in _micro_batches(cfg.vocab_size)]
    train_step(state, micro, 0, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)  # lazy set-up may wait: kernels, state
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = train_step(state, micro, 1, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(result.loss) and result.grad_norm > 0


def _pinned(batch):
    batch.input_ids, batch.labels = batch.input_ids.pin_memory(), batch.labels.pin_memory()
    return batch


def test_keys_per_token_counts_causal_attention_within_each_document():
    runtime = _runtime(torch.device("cpu"))
    cfg, state = _state(runtime)
    docs = [[40, 24, 64], [128]]
    micro = [_batch(d, cfg.vocab_size, seed=i) for i, d in enumerate(docs)]
    result = train_step(state, micro, 0, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
    lengths = [n for d in docs for n in d]
    attended = sum(n * (n + 1) // 2 for n in lengths)  # query t of a document sees its t + 1 first keys
    assert result.keys_per_token == pytest.approx(attended / sum(lengths), rel=1e-12)
    assert result.label_tokens == sum(n - 1 for n in lengths)


def test_a_micro_batch_without_labels_adds_nothing_to_the_update():
    runtime = _runtime(torch.device("cpu"))
    cfg, with_empty = _state(runtime)
    _, alone = _state(runtime)
    labelled = _batch([40, 24, 64], cfg.vocab_size, seed=1)
    empty = _batch([128], cfg.vocab_size, seed=2, labelled=False)
    got = train_step(with_empty, [labelled, empty], 0, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
    want = train_step(alone, [labelled], 0, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
    assert got.loss == want.loss and got.label_tokens == want.label_tokens
    assert got.grad_norm == want.grad_norm  # its gradient is zero, not NaN, although its loss is 0/0
    for (name, p), q in zip(with_empty.model.named_parameters(), alone.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.usefixtures("shared_corpus_cache")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_run_after_the_next_step_with_a_checkpoint(tmp_path, monkeypatch, capsys, signame):
    """SIGTERM (or Ctrl-C's SIGINT) during step 2: the request rides in step 3's end-of-step read; the
    run saves (also with checkpoint.at_end=false: a preempted run must resume) and stops with exit
    code 3, no traceback."""
    import json
    import os
    import signal

    import moe_lc.train.step as step_module
    from moe_lc.train.main import run_train_cli

    real_step = step_module.train_step

    def signalled_step(state, micro, step, *args, **kwargs):
        result = real_step(state, micro, step, *args, **kwargs)
        if step == 1:
            os.kill(os.getpid(), getattr(signal, signame))
        return result

    monkeypatch.setattr(step_module, "train_step", signalled_step)
    args = ["curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=6", "curriculum.stages.ctx256.global_batch_tokens=512",
            "curriculum.stages.ctx256.micro_batch=2", "eval.sequences=0", "eval.passkey_documents=0",
            "logging.progress=none", "logging.tensorboard=false", "report.at_end=false", "threads=1", f"run_dir={tmp_path}",
            "checkpoint.at_end=false"]
    assert run_train_cli(args) == 3  # stopped by a signal after saving: a launcher requeues
    out = capsys.readouterr()
    assert "stopped by signal: step 3/" in out.out and "Traceback" not in out.err
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003"]


@pytest.mark.usefixtures("shared_corpus_cache")
def test_a_launch_without_the_final_save_leaves_no_checkpoint(tmp_path):
    """checkpoint.at_end=false (with at_stage_end=false): a measurement that never resumes writes no
    checkpoint at max_steps (a k3-small one is 52 GB); the steps are logged as usual."""
    import json

    from moe_lc.train.main import run_train_cli

    args = ["curriculum.run=[ctx256]", "curriculum.stages.ctx256.steps=6", "curriculum.stages.ctx256.global_batch_tokens=512",
            "curriculum.stages.ctx256.micro_batch=2", "eval.sequences=0", "eval.passkey_documents=0",
            "logging.progress=none", "logging.tensorboard=false", "report.at_end=false", "threads=1", "max_steps=2",
            "checkpoint.at_stage_end=false"]
    assert run_train_cli([*args, f"run_dir={tmp_path / 'off'}", "checkpoint.at_end=false"]) == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert list((tmp_path / "off" / "checkpoints").glob("step_*")) == []
    assert run_train_cli([*args, f"run_dir={tmp_path / 'on'}"]) == 0  # the default saves at the end
    assert sorted(p.name for p in (tmp_path / "on" / "checkpoints").glob("step_*")) == ["step_00000002"]


def test_under_bf16_autocast_a_step_casts_each_weight_once_and_trains_as_when_casting_per_micro_batch(monkeypatch):
    """Runtime.step_weight_casts keeps autocast's bf16 copies of the weights over the step's micro-batches:
    a weight autocast casts for every micro-batch is cast once a step instead, and the step's result (the
    updated weights) is bitwise what casting per micro-batch gives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    runtime = Runtime(0, 1, 0, torch.device("cpu"), torch.bfloat16, False)

    class ParameterCasts(TorchDispatchMode):
        def __init__(self, model):
            super().__init__()
            self.names = {p.data_ptr(): name for name, p in model.named_parameters()}
            self.count: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = self.names.get(args[0].data_ptr()) if func is torch.ops.aten._to_copy.default else None
            if name is not None:
                self.count[name] = self.count.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def step(keep: bool):
        if not keep:
            monkeypatch.setattr(Runtime, "step_weight_casts", lambda self: contextlib.nullcontext())
        cfg, state = _state(runtime)
        micro = _micro_batches(cfg.vocab_size) * 2  # four micro-batches
        with ParameterCasts(state.model) as casts:
            train_step(state, micro, 0, TOTAL_STEPS, OptimConfig(lr=1e-3), runtime)
        monkeypatch.undo()
        return casts.count, [p.detach().clone() for p in state.model.parameters()]

    once, kept = step(True)
    every_micro_batch, fresh = step(False)
    # the LM head's weight is cast by the fused loss itself, outside autocast's cache
    by_autocast = [n for n, c in every_micro_batch.items() if c == 4 and n != "lm_head.weight"]
    assert len(by_autocast) >= 10 and all(once[n] == 1 for n in by_autocast), once
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))
