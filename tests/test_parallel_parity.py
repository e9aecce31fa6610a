"""One training step under each parallel layout equals the single-process step.

For every layout: same init seed, same global batch (each data-parallel rank packs its
contiguous share of the samples), loss = global mean over label tokens. The parallel step
(forward, backward, gradient reduction, AdamW, QB update) must give the single-process loss,
gradients and updated parameters within fp32 tolerance, and the same QB biases on every rank.

Layouts are grouped per spawned job (process start-up dominates on CPU). Tolerances: rel
< 1e-5 in fp32 and < 1e-10 in fp64. A few gradients are cancellation-dominated (the AttnRes
pseudo-queries, KDA's A_log: one fp32 process is ~5e-6 away from fp64 on its own), so the
"wide" model, whose margins in fp32 are thin, runs in fp64, where any real error stands out
by many orders of magnitude. AdamW's first step is lr * g / (|g| + eps), which magnifies the
rounding of gradients near eps; eps=1e-4 keeps the parameter comparison well conditioned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from moe_lc.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, AttnResConfig
from moe_lc.model.init import build_model
from moe_lc.presets import get_preset
from parallel_harness import biases, full_state, make_samples, pack, rank_micro_batches, run_distributed, train_step

SEQ_LEN = 16
NUM_SAMPLES = 4
LR, EPS, WD = 1e-3, 1e-4, 0.1
REL_TOL = 1e-5


def model_config(name: str) -> ModelConfig:
    if name == "tiny":
        return get_preset("tiny")
    # several heads per rank even at tp=4, with the MTP layer on
    return ModelConfig(
        name="wide",
        d_model=64,
        num_layers=5,
        vocab_size=512,
        vocab_multiple=64,
        layer_pattern="KKKMM",
        kda=KDAConfig(num_heads=8, head_dim=8),
        mla=MLAConfig(num_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=4, v_dim=8),
        attn_res=AttnResConfig(mode="block", block_size=2),
        moe=MoEConfig(num_routed=8, top_k=2, num_shared=1, latent_dim=32, expert_hidden=32, dense_hidden=64),
        mtp=True,
    ).validate()


def step_samples(step: int) -> list:
    return make_samples(NUM_SAMPLES, SEQ_LEN, 512, seed=100 + step)


@dataclass(frozen=True)
class Job:
    model: str  # "tiny" or "wide"
    layout: dict
    steps: int = 1
    micro: int = 1  # micro-batches per rank and step (gradient accumulation)
    dtype: torch.dtype = torch.float32
    checkpointing: Optional[dict] = None  # ActivationCheckpointing fields (None: keep everything)

    def __str__(self) -> str:
        ac = f" checkpointing={self.checkpointing}" if self.checkpointing else ""
        return f"{self.model} {self.layout} steps={self.steps} micro={self.micro} {self.dtype}{ac}"


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def run_layouts(jobs: list[Job]) -> list[dict]:
    """Worker: train each job's model under its layout and report the global state."""
    from moe_lc.parallel import (
        ActivationCheckpointing,
        ParallelLayout,
        build_mesh,
        build_optimizer,
        data_parallel_info,
        parallelize,
    )

    reports = []
    for job in jobs:
        layout = ParallelLayout(**job.layout)
        mesh = build_mesh(layout)
        checkpointing = ActivationCheckpointing(**job.checkpointing) if job.checkpointing else None
        model = build_model(model_config(job.model), "cpu", seed=0, dtype=job.dtype)
        model = parallelize(model, layout, mesh, checkpointing)
        optimizer = build_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=WD)
        dp_rank, dp_size = data_parallel_info(mesh)
        losses, grads = [], {}
        for step in range(job.steps):
            batches = rank_micro_batches(step_samples(step), dp_rank, dp_size, job.micro)
            losses.append(train_step(model, optimizer, batches, mesh, grads if step == job.steps - 1 else None))
        reports.append(dict(losses=losses, grads=grads, params=full_state(model), biases=biases(model)))
    return reports


def reference(model_name: str, steps: int, dtype: torch.dtype) -> dict:
    model = build_model(model_config(model_name), "cpu", seed=0, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses, grads = [], {}
    for step in range(steps):
        batch = [pack(step_samples(step))]
        losses.append(train_step(model, optimizer, batch, None, grads if step == steps - 1 else None))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, biases=biases(model))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def assert_same_training(job: Job, got: dict, ref: dict, compare_params: bool = True) -> None:
    tol = TOLERANCE[job.dtype]
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) / abs(b) < tol, f"{job}: loss at step {step} {a} vs single process {b}"
    assert torch.allclose(got["biases"], ref["biases"], rtol=0, atol=1e-6), (
        f"{job}: QB biases differ from one process by {(got['biases'] - ref['biases']).abs().max():.2e}"
    )
    if not compare_params:
        return
    assert set(got["params"]) == set(ref["params"]), f"{job}: parameter names differ"
    errors = []
    for name, p in ref["params"].items():
        g_ref, g = ref["grads"][name], got["grads"][name]
        assert (g is None) == (g_ref is None), f"{job}: gradient presence differs for {name}"
        if g_ref is not None:
            errors.append((rel(g, g_ref), f"grad {name}"))
        errors.append((rel(got["params"][name], p), f"param {name}"))
    worst, where = max(errors)
    assert worst < tol, f"{job}: {where} differs from one process by rel {worst:.2e}"


def check_jobs(world_size: int, jobs: list[Job], compare_params: bool = True, timeout: float = 100.0) -> None:
    per_rank = run_distributed(run_layouts, world_size, jobs, timeout=timeout)
    refs: dict = {}
    for i, job in enumerate(jobs):
        key = (job.model, job.steps, job.dtype)
        if key not in refs:
            refs[key] = reference(*key)
        assert_same_training(job, per_rank[0][i], refs[key], compare_params)
        for rank in range(1, world_size):  # QB biases are identical on every rank, bit for bit
            assert torch.equal(per_rank[rank][i]["biases"], per_rank[0][i]["biases"]), f"{job}: rank {rank} biases"


F64 = torch.float64


@pytest.mark.timeout(150)
def test_tensor_parallel_two_ranks():
    check_jobs(
        2,
        [
            Job("tiny", dict(tp=2)),
            Job("tiny", dict(tp=2, ep=2)),  # the expert group is the tp group
            Job("wide", dict(tp=2), dtype=F64),  # 4 KDA/MLA heads per rank, MTP layer
        ],
    )


@pytest.mark.timeout(150)
def test_data_and_expert_parallel_two_ranks():
    check_jobs(
        2,
        [
            Job("tiny", dict(dp_shard=2), micro=2),  # accumulation over two micro-batches per rank
            Job("tiny", dict(dp_shard=2, fsdp_reduce_every_micro_batch=True), micro=2),  # reduce-scatter each
            Job("tiny", dict(dp_replicate=2)),
            Job("tiny", dict(dp_shard=2, ep=2)),
            Job("tiny", dict(dp_shard=2, dp_mode="zero1")),
            Job("tiny", dict(dp_shard=2, ep=2, dp_mode="zero1")),
        ],
    )


@pytest.mark.timeout(200)
def test_activation_checkpointing_composes_with_every_parallelism_two_ranks():
    """Recomputed layers rerun their TP collectives, EP all-to-alls and FSDP unshards in backward;
    the step still equals one process without checkpointing."""
    check_jobs(
        2,
        [
            Job("tiny", dict(tp=2), checkpointing=dict(mode="selective")),
            Job("tiny", dict(tp=2, ep=2), checkpointing=dict(mode="full", every=2)),
            Job("tiny", dict(dp_shard=2), micro=2, checkpointing=dict(mode="full")),  # FSDP, accumulation
            Job("tiny", dict(dp_shard=2, ep=2), checkpointing=dict(mode="selective", offload=True)),
            Job("tiny", dict(dp_shard=2, dp_mode="zero1"), checkpointing=dict(mode="selective", every=2)),
            Job("wide", dict(tp=2), dtype=F64, checkpointing=dict(mode="selective")),  # MTP layer
        ],
    )


@pytest.mark.timeout(150)
def test_tensor_parallel_four_ranks():
    check_jobs(
        4,
        [
            Job("wide", dict(tp=4), dtype=F64),
            Job("tiny", dict(dp_shard=2, tp=2)),
            Job("tiny", dict(dp_shard=2, tp=2, dp_mode="zero1")),
        ],
    )


@pytest.mark.timeout(150)
def test_expert_parallel_four_ranks():
    check_jobs(4, [Job("tiny", dict(dp_shard=4, ep=4)), Job("tiny", dict(dp_replicate=2, dp_shard=2, ep=2))])


@pytest.mark.timeout(150)
def test_quantile_balancing_biases_over_several_steps():
    """Three fp32 steps with experts folded over tp and dp: every rank's biases equal one process's.

    The per-rank histograms are all-reduced over dp x tp before the quantile is read, so each
    bias is computed from the same integer counts as in one process.
    """
    check_jobs(4, [Job("tiny", dict(dp_shard=2, tp=2, ep=4), steps=3)], compare_params=False)


def _grads_after_a_micro_batch_without_sync(every: bool) -> bool:
    """Worker: whether the parameters hold (sharded) gradients after one micro-batch with the sync off."""
    from moe_lc.parallel import ParallelLayout, build_mesh, parallelize, set_gradient_sync
    from moe_lc.ops.documents import DocumentBounds

    layout = ParallelLayout(dp_shard=2, fsdp_reduce_every_micro_batch=every)
    model = parallelize(build_model(get_preset("tiny"), "cpu", seed=0), layout, build_mesh(layout))
    mb = pack(step_samples(0)[:1])
    set_gradient_sync(model, False)  # not the step's last micro-batch
    out = model(mb.input_ids, labels=mb.labels, docs=DocumentBounds.from_host(mb.cu_seqlens, "cpu"))
    out.lm_loss.backward()
    return all(p.grad is not None for p in model.parameters())


@pytest.mark.timeout(100)
def test_fsdp_reduce_every_micro_batch_reduce_scatters_before_the_last_one():
    """Without the option FSDP keeps the unsharded gradients to itself until the last micro-batch; with it
    every micro-batch's backward reduce-scatters into the parameters' sharded gradients."""
    assert run_distributed(_grads_after_a_micro_batch_without_sync, 2, True) == [True, True]
    assert run_distributed(_grads_after_a_micro_batch_without_sync, 2, False) == [False, False]
