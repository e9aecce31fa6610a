"""Pipeline parallelism: the schedules, the stage split, what crosses a boundary, and training steps of
pipelined layouts against one process.

The parallel runs go through the trainer's own step (`moe_lc.train.step.train_step`: the schedule,
the n_i / N weights, gradient sync, the clip norm over stages, AdamW, the QB update) in float64 on
CPU (gloo), so that layouts that differ only in summation order agree to ~1e-15 and a bound of 1e-10
leaves five orders of magnitude while any real error (a source missing from a boundary, a gradient
counted twice or not at all) is far above it. The model has Attention Residuals in blocks of three
layers, so stage edges fall both inside blocks and on block boundaries, and MTP (its embedding copy
on the last stage). The reference is one process taking the same global batch, through the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import configs
from moe_lc.config import ConfigError
from moe_lc.data.packing import IGNORE_INDEX, Sample, collate
from moe_lc.model.accounting import head_training_flops, layer_training_flops, mtp_training_flops
from moe_lc.optim import OptimConfig
from moe_lc.parallel.layout import ParallelLayout
from moe_lc.parallel.pipeline_schedule import predicted_bubble, rank_actions, simulate, stage_ranks
from moe_lc.parallel.pipeline_split import balanced_split, part_costs, pipeline_split, stage_ranges
from moe_lc.parallel.pipeline_stage import boundary_bytes_per_token, boundary_plans, sources_before
from moe_lc.presets import get_preset
from parallel_harness import run_distributed

SEQ_LEN = 32
SAMPLES = 4  # per step: the global batch
TOTAL_STEPS = 10
REL = 1e-10


def model_config():
    """8 layers (KKKMKKMM), AttnRes blocks of 3, MTP: stage edges at 2, 4 fall inside blocks, 3 and 6 on their ends."""
    return configs.tiny(**{"num_layers": 8, "layer_pattern": "KKKMKKMM", "attn_res.block_size": 3, "mtp": True})


OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, eps=1e-4, grad_clip=1.0)


# ----------------------------------------------------------------------------- data


def step_samples(step: int) -> list[Sample]:
    """The global batch of one step: samples of two documents each, some labels ignored."""
    g = torch.Generator().manual_seed(1000 + step)
    samples = []
    for _ in range(SAMPLES):
        ids = torch.randint(0, 512, (SEQ_LEN,), generator=g)
        cut = int(torch.randint(4, SEQ_LEN - 4, (1,), generator=g))
        labels = torch.full((SEQ_LEN,), IGNORE_INDEX, dtype=torch.int64)
        labels[: cut - 1], labels[cut : SEQ_LEN - 1] = ids[1:cut], ids[cut + 1 :]
        labels[torch.rand(SEQ_LEN, generator=g) < 0.2] = IGNORE_INDEX
        samples.append(Sample(ids, labels, torch.tensor([0, cut, SEQ_LEN], dtype=torch.int32)))
    return samples


def rank_batches(step: int, dp_rank: int, dp_size: int) -> list:
    """This data-parallel rank's contiguous share of the step's samples, one sample per micro-batch."""
    samples = step_samples(step)
    share = len(samples) // dp_size
    return [collate([s]) for s in samples[dp_rank * share : (dp_rank + 1) * share]]


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Job:
    layout: dict
    steps: int = 2
    checkpointing: Optional[dict] = None

    def __str__(self) -> str:
        return f"{self.layout}{' ' + str(self.checkpointing) if self.checkpointing else ''}"


@dataclass
class Report:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict = field(default_factory=dict)  # of the last step, after clipping, before the update
    params: dict = field(default_factory=dict)  # after the last step
    biases: dict = field(default_factory=dict)


def train(job: Job, world: int) -> Report:
    """Train ``job`` on this rank (world 1: the reference) and report the global state (rank 0's copy of
    every tensor, gathered where it is sharded)."""
    import torch.distributed as dist

    from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing
    from moe_lc.train.model_setup import build_model_state
    from moe_lc.train.runtime import Runtime
    from moe_lc.train.step import train_step
    from parallel_harness import full_tensor

    distributed = world > 1
    runtime = Runtime(dist.get_rank() if distributed else 0, world, 0, torch.device("cpu"), torch.float64, False)
    layout = ParallelLayout(**job.layout).resolve(world)
    checkpointing = ActivationCheckpointing(**job.checkpointing) if job.checkpointing else None
    state = build_model_state(model_config(), OPTIM, layout, runtime, seed=0, checkpointing=checkpointing,
                              seq_len=SEQ_LEN)
    report = Report()
    grads: dict = {}
    state.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.update({n: p.grad for n, p in state.model.named_parameters()}))
    for step in range(job.steps):
        result = train_step(state, rank_batches(step, state.dp_rank, state.dp_size), step, TOTAL_STEPS, OPTIM, runtime)
        report.losses.append(result.loss)
        report.grad_norms.append(result.grad_norm)
    named = dict(state.model.named_parameters())
    report.grads = {n: full_tensor(g) for n, g in grads.items()}  # collective for DTensors: all ranks, same order
    report.params = {n: full_tensor(p) for n, p in named.items()}
    report.biases = {n: b.detach().clone() for n, b in state.model.named_buffers() if n.endswith("balancer.bias")}
    return report


def train_jobs(jobs: list[Job]) -> list[Report]:
    import torch.distributed as dist

    world = dist.get_world_size()
    return [train(job, world) for job in jobs]


def merged(reports: list[Report]) -> Report:
    """One report from every rank's (each pipeline rank holds its stages' parameters)."""
    out = Report(reports[0].losses, reports[0].grad_norms)
    for r in reports:
        for name in r.params:
            out.params.setdefault(name, r.params[name])
            out.grads.setdefault(name, r.grads[name])
        out.biases.update(r.biases)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_same_training(job: Job, got: Report, ref: Report) -> None:
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert a == pytest.approx(b, rel=REL), f"{job}: loss at step {step + 1}: {a} vs one process {b}"
    for step, (a, b) in enumerate(zip(got.grad_norms, ref.grad_norms)):
        assert a == pytest.approx(b, rel=REL), f"{job}: gradient norm at step {step + 1}: {a} vs one process {b}"
    assert max(ref.grad_norms) > OPTIM.grad_clip  # clipping is active: the norm over stages scales every gradient
    assert set(got.params) == set(ref.params), f"{job}: parameters {set(ref.params) ^ set(got.params)} differ"
    errors = [(rel(got.grads[n], ref.grads[n]), f"gradient of {n}") for n in ref.params]
    errors += [(rel(got.params[n], ref.params[n]), f"{n} after the step") for n in ref.params]
    worst, where = max(errors)
    assert worst < REL, f"{job}: {where} differs from one process by rel {worst:.2e}"
    assert set(got.biases) == set(ref.biases)
    for n, b in ref.biases.items():  # QB reduces within each stage: the same biases as one process
        assert torch.allclose(got.biases[n], b, rtol=0, atol=1e-12), f"{job}: QB bias {n}"


_REFERENCE: dict[int, Report] = {}


def reference(steps: int) -> Report:
    if steps not in _REFERENCE:
        _REFERENCE[steps] = train(Job(dict(world_size=1, dp_shard=1), steps), 1)
    return _REFERENCE[steps]


def check_jobs(world: int, jobs: list[Job], timeout: float) -> None:
    per_rank = run_distributed(train_jobs, world, jobs, timeout=timeout)
    for i, job in enumerate(jobs):
        assert_same_training(job, merged([r[i] for r in per_rank]), reference(job.steps))


# ----------------------------------------------------------------------------- what crosses a boundary


@pytest.mark.parametrize("mode, block", [("block", 3), ("block", 1), ("full", 3), ("none", 3)])
def test_sources_before_each_layer_are_the_streams(mode, block):
    """The count the boundaries are planned from is what the model's stream holds between its layers."""
    from moe_lc.model.init import build_model

    cfg = configs.tiny(**{"num_layers": 7, "layer_pattern": "KKKMKKM", "attn_res.mode": mode,
                          "attn_res.block_size": block})
    model = build_model(cfg, seed=0, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    stream = model.start_stream(ids)
    for i in range(cfg.num_layers + 1):
        assert sources_before(cfg, i) == (len(stream.sources), stream.partial is not None), (mode, i)
        if i < cfg.num_layers:
            stream = model.run_layers(stream, [model.layers[i]], None)


def _sources_read(cfg, layers: range) -> set[int]:
    """Every source a stage's mixers read: all those completed before its last layer, its own included."""
    return set(range(sources_before(cfg, layers.stop - 1)[0]))


@pytest.mark.parametrize("schedule, pp", [("one_f_one_b", 16), ("interleaved_1f1b", 8), ("zbv", 8), ("dualpipev", 4)])
def test_every_rank_receives_each_source_once_per_micro_batch(schedule, pp):
    """Over a micro-batch, the sources that reach a rank (across its stages) are disjoint, and with those
    its stages compute they are everything its stages read; later stages of a rank receive only newer
    sources."""
    cfg = get_preset("k3")
    layout = ParallelLayout(pp=pp, pp_schedule=schedule, dp_shard=1).resolve(pp)
    layers = pipeline_split(cfg, layout, 8192)
    ranks = stage_ranks(layout.pp_schedule, pp, layout.stages_per_rank)
    plans = boundary_plans(cfg, layers, ranks)
    for rank in range(pp):
        mine = [p for p in plans if p.rank == rank]
        received = [s for p in mine for s in p.sent]
        assert len(received) == len(set(received)), (rank, received)
        computed = {s for p in mine for s in range(sources_before(cfg, p.layers.start)[0],
                                                   sources_before(cfg, p.layers.stop)[0])}
        if mine[0].stage == 0:
            computed.add(0)  # the embedding
        read = set().union(*(_sources_read(cfg, p.layers) for p in mine))
        assert read <= set(received) | computed, (rank, sorted(read - set(received) - computed))
        for earlier, later in zip(mine, mine[1:]):  # virtual stages: only what is newer than the earlier one
            assert later.held == sources_before(cfg, earlier.layers.stop)[0]
            assert min(later.sent, default=later.held) >= later.held


def test_boundary_bytes_per_token():
    """d x (sources sent + the partial sum) x bytes: k3 (d = 7168, blocks of 12) in bf16, 1F1B over 16
    stages of 6 layers: before layer 48 (a block boundary) 1 + 4 sources and no partial sum; before layer
    54, 5 sources and the partial sum."""
    cfg = get_preset("k3")
    layers = stage_ranges([6] * 15 + [3])
    plans = boundary_plans(cfg, layers, list(range(16)))
    assert (plans[8].sources, plans[8].partial, plans[8].held) == (5, False, 0)
    assert boundary_bytes_per_token(cfg, plans[8], 2) == 7168 * 5 * 2
    assert boundary_bytes_per_token(cfg, plans[9], 2) == 7168 * 6 * 2
    # interleaved over 8 ranks: stage 9 (layers 54-59) is rank 1's second; it had sources 0..1 from stage 1
    v = boundary_plans(cfg, layers, [k % 8 for k in range(16)])
    assert (v[9].held, list(v[9].sent), v[9].tensors()) == (2, [2, 3, 4], 4)
    assert boundary_bytes_per_token(cfg, v[9], 2) == 7168 * 4 * 2
    assert boundary_bytes_per_token(cfg, plans[0], 2) == 0
    # ZBV over 8 ranks: stage 8 follows stage 7 on rank 7 (the V's turn), nothing crosses ranks there
    zbv = boundary_plans(cfg, layers, stage_ranks("zbv", 8, 2))
    assert zbv[8].local and zbv[8].tensors() == 0 and not zbv[9].local


# ----------------------------------------------------------------------------- the split


def _brute_force_split(costs, stages: int, in_flight: list[int]) -> list[int]:
    """Every composition of the layers into ``stages`` parts: the least slowest stage, then the least memory."""
    import itertools

    L = costs.num_layers
    best = None
    for cuts in itertools.combinations(range(1, L), stages - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
        ranges = stage_ranges(counts)
        time = max(costs.stage_flops(r) for r in ranges)
        memory = max(f * costs.stage_bytes(r) for f, r in zip(in_flight, ranges))
        key = (time, memory)
        if best is None or key[0] < best[0][0] * (1 - 1e-9) or (key[0] <= best[0][0] * (1 + 1e-9)
                                                                 and key[1] < best[0][1]):
            best = (key, counts)
    return best[1]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balanced_split_is_the_best_split(stages):
    """The dynamic programme finds what trying every split finds (tiny, 8 layers, MTP, selective)."""
    from moe_lc.parallel.activation_checkpointing import ActivationCheckpointing

    cfg = model_config()
    costs = part_costs(cfg, 256, ActivationCheckpointing(mode="selective"))
    in_flight = list(range(stages, 0, -1))
    got = balanced_split(costs, stages, in_flight)
    want = _brute_force_split(costs, stages, in_flight)
    time = lambda counts: max(costs.stage_flops(r) for r in stage_ranges(counts))  # noqa: E731
    memory = lambda counts: max(f * costs.stage_bytes(r) for f, r in zip(in_flight, stage_ranges(counts)))  # noqa: E731
    assert time(got) == pytest.approx(time(want), rel=1e-9) and memory(got) == pytest.approx(memory(want), rel=1e-9)


@pytest.mark.parametrize("pp", [4, 8, 16])
def test_k3_split_over_pp_stages(pp):
    """93 layers over 4, 8, 16 stages: each stage within one layer's cost of the even share; the last
    stage, which also runs the LM head + loss and MTP, holds fewer layers."""
    cfg = get_preset("k3")
    layout = ParallelLayout(pp=pp, tp=8, dp_shard=1).resolve(8 * pp)
    ranges = pipeline_split(cfg, layout, 8192)
    assert len(ranges) == pp and ranges[0].start == 0 and ranges[-1].stop == 93
    assert all(len(r) >= 1 and a.stop == b.start for r, a, b in zip(ranges, ranges, ranges[1:]))
    costs = part_costs(cfg, 8192)
    total = sum(costs.layer_flops) + costs.last_flops
    heaviest = max(costs.layer_flops)
    assert max(costs.stage_flops(r) for r in ranges) <= total / pp + heaviest
    assert len(ranges[-1]) < 93 / pp
    head = head_training_flops(cfg) + mtp_training_flops(cfg, 8192)
    assert costs.last_flops == head and head > 2 * layer_training_flops(cfg, 1, 8192)  # worth about 3 layers


def test_split_override_and_the_flop_accounting_it_uses():
    cfg = model_config()
    layout = ParallelLayout(pp=2, pp_stage_layers=[3, 5], dp_shard=1).resolve(2)
    assert pipeline_split(cfg, layout) == [range(0, 3), range(3, 8)]
    from moe_lc.model.accounting import training_flops_per_token

    for preset in ("tiny", "k3"):  # the per-layer split adds up to the model's count
        c = get_preset(preset)
        parts = sum(layer_training_flops(c, i, 4096) for i in range(c.num_layers)) + head_training_flops(c)
        assert parts == pytest.approx(training_flops_per_token(c, 4096), rel=1e-12)


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_simulated_bubbles_follow_the_formulas(pp, m):
    """With forward : backward = 1 : 2 per stage and free communication, the orders' idle share is
    (p - 1) / (m + p - 1) for 1F1B and (p - 1) / (v m + p - 1) for interleaved 1F1B (v = 2); the
    zero-bubble schedules (backward split in halves) leave less than interleaved 1F1B."""
    one = simulate("one_f_one_b", pp, 1, m).bubble_fraction
    assert one == pytest.approx(predicted_bubble("one_f_one_b", pp, 1, m), rel=1e-12)
    assert one == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    inter = simulate("interleaved_1f1b", pp, 2, m).bubble_fraction
    assert inter == pytest.approx((pp - 1) / (2 * m + pp - 1), rel=1e-12)
    for zero_bubble in ("interleaved_zero_bubble", "zbv", "dualpipev"):
        assert simulate(zero_bubble, pp, 2, m).bubble_fraction < inter


@pytest.mark.parametrize("schedule, v", [("one_f_one_b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                         ("interleaved_zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)])
def test_orders_run_every_micro_batch_once_and_match_sends_to_receives(schedule, v):
    pp, m = 4, 8
    ranks = stage_ranks(schedule, pp, v)
    stages = pp * v
    sends, receives = [], []
    for rank in range(pp):
        actions = rank_actions(schedule, pp, v, m, rank)
        assert all(ranks[a.stage] == rank for a in actions)
        for kind in ("F",):
            done = sorted((a.stage, a.micro) for a in actions if a.kind == kind)
            assert done == sorted((k, i) for k in range(stages) if ranks[k] == rank for i in range(m))
        backward = [(a.stage, a.micro) for a in actions if a.kind in ("B", "I")]
        weights = [(a.stage, a.micro) for a in actions if a.kind == "W"]
        assert sorted(backward) == sorted((k, i) for k in range(stages) if ranks[k] == rank for i in range(m))
        assert set(weights) <= set(backward)
        sends += [("F", a.stage + 1, a.micro) for a in actions if a.kind == "SEND_F"]
        sends += [("B", a.stage - 1, a.micro) for a in actions if a.kind == "SEND_B"]
        receives += [("F", a.stage, a.micro) for a in actions if a.kind == "RECV_F"]
        receives += [("B", a.stage, a.micro) for a in actions if a.kind == "RECV_B"]
    remote = [("F", k, i) for k in range(1, stages) if ranks[k] != ranks[k - 1] for i in range(m)]
    remote += [("B", k, i) for k in range(stages - 1) if ranks[k] != ranks[k + 1] for i in range(m)]
    assert sorted(sends) == sorted(receives) == sorted(remote)


def test_schedules_that_cannot_order_the_micro_batches_say_how_to_fix_it():
    from moe_lc.train.curriculum import plan_curriculum
    from moe_lc.train.recipes import compose_recipe

    # DualPipe-V needs at least as many micro-batches as stages: 6 for pp=4 x 2 are too few
    cfg = compose_recipe("smoke", ["layout.pp=4", "layout.dp_shard=1", "layout.world_size=4",
                                   "layout.pp_schedule=dualpipev", "model.num_layers=8",
                                   "model.layer_pattern=KKKMKKMM", "curriculum.stages.ctx256.global_batch_tokens=1536",
                                   "curriculum.stages.ctx256.micro_batch=1", "curriculum.run=[ctx256]"])
    with pytest.raises(ConfigError) as err:
        plan_curriculum(cfg, 4)
    message = str(err.value)
    assert "curriculum.stages.ctx256 (6 micro-batches per rank and step)" in message
    assert "DualPipeV requires at least as many microbatches as stages" in message
    assert "micro_batch or global_batch_tokens" in message


# ----------------------------------------------------------------------------- training against one process

FOUR_STAGES = [2, 2, 2, 2]  # edges at layers 2 and 4 (inside blocks of 3) and 6 (a block's end)


@pytest.mark.timeout(300)
def test_two_ranks_every_schedule_trains_like_one_process():
    """pp=2: 1F1B over 2 stages (the edge at layer 3 ends a block), interleaved 1F1B, interleaved zero
    bubble, ZBV and DualPipe-V over 4 stages (two per rank; ZBV's middle boundary stays on rank 1, and
    rank 0 holds the first and the last stage, MTP's embedding included); split backwards (ZeRO-1, with
    full activation checkpointing too) and whole ones (FSDP; selective checkpointing), one split
    balanced by cost."""
    check_jobs(2, [
        Job(dict(pp=2, pp_stage_layers=[3, 5])),
        Job(dict(pp=2, pp_schedule="interleaved_1f1b", pp_stage_layers=FOUR_STAGES, dp_mode="zero1")),
        Job(dict(pp=2, pp_schedule="interleaved_zero_bubble", pp_stage_layers=FOUR_STAGES, dp_mode="zero1")),
        Job(dict(pp=2, pp_schedule="zbv", pp_stage_layers=FOUR_STAGES, dp_mode="zero1"),
            checkpointing=dict(mode="full")),
        Job(dict(pp=2, pp_schedule="dualpipev", dp_mode="zero1"), checkpointing=dict(mode="selective")),
    ], timeout=280)


@pytest.mark.timeout(400)
def test_four_ranks_pipeline_composes_with_tensor_data_and_expert_parallelism():
    """pp=4 (1F1B over 4 stages, 4 micro-batches), pp=2 x tp=2 (sequence-parallel stream shards cross
    the boundary; zero-bubble split with tensor-parallel weight gradients) and pp=2 x dp_shard=2 with
    ep=2 (FSDP inside each stage, experts folded over its two ranks, QB reduced per stage), and pp=2 x
    cp=2 (the stream crosses as each rank's zigzag shard; MTP's targets and the loss weights per shard)."""
    check_jobs(4, [
        Job(dict(pp=4, pp_stage_layers=FOUR_STAGES)),
        Job(dict(pp=2, tp=2, pp_schedule="interleaved_zero_bubble", pp_stage_layers=FOUR_STAGES, dp_mode="zero1")),
        Job(dict(pp=2, dp_shard=2, ep=2, pp_stage_layers=[3, 5])),
        Job(dict(pp=2, cp=2, dp_shard=1, pp_stage_layers=[3, 5])),  # each stage runs its shard of the rows
        Job(dict(pp=2, dp_shard=2, pp_stage_layers=[3, 5], fsdp_reduce_every_micro_batch=True)),
    ], timeout=380)


# ----------------------------------------------------------------------------- checkpoints through the trainer

TRAIN = ["device=cpu", "precision=fp64", "model.mtp=true", "curriculum.run=[ctx256]",
         "curriculum.stages.ctx256.steps=3", "curriculum.stages.ctx256.global_batch_tokens=1024",
         "curriculum.stages.ctx256.micro_batch=1",
         "eval.sequences=0", "eval.passkey_documents=0", "checkpoint.every=2", "checkpoint.keep_last=10",
         "logging.progress=none", "logging.tensorboard=false", "report.at_end=false", "threads=1"]
PP2 = ["layout.pp=2", "layout.dp_shard=1", "layout.world_size=2"]


def launches(runs: list[list[str]]) -> list[int]:
    from moe_lc.train.main import run_train_cli

    return [run_train_cli(args) for args in runs]


def _metrics(run_dir, key: str = "loss") -> dict[int, float]:
    import json

    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _checkpoint_keys(path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.mark.timeout(300)
def test_checkpoints_move_between_one_process_and_a_pipeline(tmp_path, monkeypatch):
    """The tiny recipe (MTP on) trains 3 steps on one process and on pp=2 with the same losses and
    gradient norms; a pp=2 checkpoint resumes on one process and a one-process checkpoint on pp=2, each
    continuing with the same step-3 loss. The pp=2 checkpoint holds the model's names, the embedding
    (kept on both end stages) once."""
    import json

    from moe_lc.train.main import run_train_cli

    monkeypatch.setenv("MOE_LC_CACHE", str(tmp_path / "cache"))
    single, piped, into_pp, out_of_pp = (tmp_path / n for n in ("single", "pp2", "into_pp", "out_of_pp"))
    assert run_train_cli([*TRAIN, f"run_dir={single}"]) == 0
    evaluated = ["eval.sequences=2", "eval.passkey_documents=1"]  # the stage end evaluates through the pipeline
    runs = [[*TRAIN, *PP2, *evaluated, f"run_dir={piped}"],
            [*TRAIN, *PP2, f"run_dir={into_pp}", f"resume={single / 'checkpoints' / 'step_00000002'}"]]
    assert run_distributed(launches, 2, runs, timeout=280) == [[0, 0], [0, 0]]
    ref, ref_norms = _metrics(single), _metrics(single, "grad_norm")
    assert sorted(_metrics(piped)) == [1, 2, 3] and max(ref_norms.values()) > 1.0  # clipped
    for step in ref:
        assert _metrics(piped)[step] == pytest.approx(ref[step], rel=REL)
        assert _metrics(piped, "grad_norm")[step] == pytest.approx(ref_norms[step], rel=REL)
    assert _metrics(into_pp) == {3: pytest.approx(ref[3], rel=REL)}
    (result,) = [json.loads(line) for line in (piped / "eval.jsonl").read_text().splitlines()]
    assert result["stage"] == "ctx256" and result["loss"] > 0 and 0 <= result["passkey_accuracy"] <= 1
    step2 = piped / "checkpoints" / "step_00000002"
    assert _checkpoint_keys(step2) == _checkpoint_keys(single / "checkpoints" / "step_00000002")
    assert run_train_cli([*TRAIN, f"run_dir={out_of_pp}", f"resume={step2}"]) == 0
    assert _metrics(out_of_pp) == {3: pytest.approx(ref[3], rel=REL)}
