"""Context parallelism of MLA and of the whole model, against one process on the whole rows.

MLA: the Gated MLA layer in float64 at cp = 2 and 4, on rows whose documents cross chunk edges and
ranks, start exactly at chunk edges, or span the row: outputs and x's gradient at each rank's
tokens, and the parameters' gradients summed over the ranks, equal one process's (rel < 1e-10);
the flex backend's forward (no CPU backward) likewise.

The whole tiny model (AttnRes blocks, MTP on, quantile balancing) in float64 trains three AdamW
steps under cp = 2 (FSDP and ZeRO-1), cp = 2 x dp_shard = 2 with ep = 2, cp = 2 x dp_replicate = 2
(HSDP) and cp = 2 x tp = 2: losses, last-step
gradients and parameters equal one process's to rel < 1e-10 (float64, where any real error stands
out by many orders of magnitude; summation orders differ only by rounding), and the QB biases are
bit-identical on every rank and within 1e-12 of one process's. Each step's objective is the mean
LM loss over the global batch's label tokens plus 0.1 x the mean MTP loss over its MTP targets,
each weighted by its own global token count, so that it is the same number for any split of the
rows over ranks.

Two spawns (2 and 4 ranks) run every case; the references run in this process. The HSDP mesh
over dp_replicate x (dp_shard x cp) is checked on a fake 8-rank world.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from host_reads import forbid_host_reads, guarded
from parallel_harness import biases, full_state, full_tensor, run_distributed
from moe_lc.config import MLAConfig
from moe_lc.model.init import build_model
from moe_lc.model.mla import GatedMLA
from moe_lc.model.transformer import IGNORE_INDEX, mtp_labels
from moe_lc.ops.attention import document_mask
from moe_lc.ops.documents import DocumentBounds
from moe_lc.parallel.context import ContextShard, shard_documents, shard_model_inputs, shard_row
from moe_lc.parallel.parallelize import _fsdp_mesh
from moe_lc.presets import get_preset

F64 = torch.float64
TOL = 1e-10
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

# ----------------------------------------------------------------------------- MLA layer
SEQ_LEN, D_MODEL = 64, 16  # chunks of 16 (cp = 2) or 8 (cp = 4) tokens
LAYOUTS = {
    "one_document": [0, 64],
    "crossing": [0, 5, 29, 30, 61, 64],  # [30, 61) runs from rank 1's chunk 2 into rank 0's chunk 3 at cp = 2
    "at_chunk_edges": [0, 16, 32, 40, 64],
}


def mla_and_inputs(seed: int = 3):
    torch.manual_seed(seed)
    cfg = MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_dim=4, qk_rope_dim=4, v_dim=4)
    layer = GatedMLA(D_MODEL, cfg).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, SEQ_LEN, D_MODEL, dtype=F64, generator=gen)
    return layer, x, torch.randn(1, SEQ_LEN, D_MODEL, dtype=F64, generator=gen)


def mla_run(docs: DocumentBounds, to_local):
    """Output and gradients of the layer on the row (to_local: the identity) or this rank's shard."""
    layer, x, dout = mla_and_inputs()
    x = to_local(x).requires_grad_()
    y = layer(x, docs)
    (y * to_local(dout)).sum().backward()
    return y.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


def mla_cases(context: ContextShard) -> dict:
    local = lambda t: shard_row(t, context)  # noqa: E731
    results = {}
    for name, bounds in LAYOUTS.items():
        docs = shard_documents(DocumentBounds.from_host(bounds, "cpu"), context)
        results["mla", name] = mla_run(docs, local)
        results["flex", name] = flex_forward(docs, local)
    return results


def flex_forward(docs: DocumentBounds, to_local) -> torch.Tensor:
    """The layer's forward with its attention mask built for the flex backend (forward only on CPU)."""
    queries = None if docs.shard is None else docs.shard.context.ranges
    # the layer takes docs.attention_mask, a cached property: fill its slot with a flex mask
    docs.__dict__["attention_mask"] = document_mask(docs.total, seq_bounds=docs.host, backend="flex",
                                                    query_ranges=queries)
    layer, x, _ = mla_and_inputs()
    with torch.no_grad():
        return layer(to_local(x), docs)


# ----------------------------------------------------------------------------- whole model
ROW = 64  # tokens per packed row; chunks of 16 at cp = 2 (8 per tp rank under tp = 2)
ROWS = 2  # rows per step: one per dp rank at dp = 2, two micro-batches of one rank otherwise
STEPS = 3
LR, EPS, WD = 1e-3, 1e-4, 0.1
MTP_WEIGHT = 0.1


def model_config():
    return dataclasses.replace(get_preset("tiny"), mtp=True).validate()


def step_rows(step: int) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """The global batch of a step: rows of documents of random lengths (crossing chunk edges and
    ranks, some starting at edges), labels shifted within documents, a fifth of them ignored."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = []
    for _ in range(ROWS):
        cuts = sorted(torch.randperm(ROW - 1, generator=gen)[:4].add(1).tolist() + [16 * (1 + step % 3)])
        bounds = sorted({0, *cuts, ROW})
        ids = torch.randint(0, 512, (ROW,), generator=gen)
        labels = torch.full((ROW,), IGNORE_INDEX, dtype=torch.long)
        for a, b in zip(bounds, bounds[1:]):
            labels[a:b - 1] = ids[a + 1:b]
        labels[torch.rand(ROW, generator=gen) < 0.2] = IGNORE_INDEX
        rows.append((ids.unsqueeze(0), labels.unsqueeze(0), bounds))
    return rows


def objective_step(model, optimizer, rows, mesh=None, context=None) -> float:
    """One optimizer step on this rank's rows (its shards of them under cp); returns the global
    objective. Each micro-batch's LM and MTP mean losses are weighted by their token counts over
    the global count, so the gradient is the global objective's."""
    from moe_lc.parallel import balance_group, data_parallel_group, finish_gradient_sync, set_gradient_sync

    group = data_parallel_group(mesh) if mesh is not None else None
    inputs = []
    for ids, labels, bounds in rows:
        docs = DocumentBounds.from_host(bounds, "cpu")
        if context is None:
            inputs.append(dict(input_ids=ids, labels=labels, docs=docs, mtp_targets=mtp_labels(labels, docs)))
        else:
            inputs.append(shard_model_inputs(ids, labels, docs, context))
    counts = torch.tensor([[(x[key] != IGNORE_INDEX).sum() for key in ("labels", "mtp_targets")] for x in inputs],
                          dtype=F64)
    totals = counts.sum(0)
    if group is not None:
        dist.all_reduce(totals, group=group)
    objective = torch.zeros((), dtype=F64)
    for i, (x, (n_lm, n_mtp)) in enumerate(zip(inputs, counts)):
        set_gradient_sync(model, i == len(inputs) - 1)
        out = model(**x, return_logits=False)
        loss = out.lm_loss * (n_lm / totals[0]) + MTP_WEIGHT * out.mtp_loss * (n_mtp / totals[1])
        loss.backward()
        objective += loss.detach()
    finish_gradient_sync(model)
    grads = {name: full_tensor(p.grad) for name, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    for moe in model.moe_layers():
        moe.balancer.update(balance_group(mesh) if mesh is not None else None)
    if group is not None:
        dist.all_reduce(objective, group=group)
    return float(objective), grads


def train_under(layout_kwargs: dict) -> dict:
    from moe_lc.parallel import ParallelLayout, build_mesh, build_optimizer, data_parallel_info, parallelize

    layout = ParallelLayout(**layout_kwargs)
    mesh = build_mesh(layout)
    model = parallelize(build_model(model_config(), "cpu", seed=0, dtype=F64), layout, mesh)
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=WD)
    dp_rank, dp_size = data_parallel_info(mesh)
    context = ContextShard.from_mesh(mesh, ROW)
    losses = []
    for step in range(STEPS):
        share = ROWS // dp_size
        loss, grads = objective_step(model, optimizer, step_rows(step)[dp_rank * share:(dp_rank + 1) * share], mesh,
                                     context)
        losses.append(loss)
    return dict(losses=losses, grads=grads, params=full_state(model), biases=biases(model))


def unsharded_call_error() -> str:
    """What a cp = 2 model says when called with a whole row instead of this rank's shard."""
    from moe_lc.parallel import ParallelLayout, build_mesh, parallelize

    layout = ParallelLayout(cp=2)
    model = parallelize(build_model(model_config(), "cpu", seed=0, dtype=F64), layout, build_mesh(layout))
    ids, labels, bounds = step_rows(0)[0]
    try:
        model(ids, labels=labels, docs=DocumentBounds.from_host(bounds, "cpu"))
    except ValueError as err:
        return str(err)
    return "no error"


def reference_training() -> dict:
    model = build_model(model_config(), "cpu", seed=0, dtype=F64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        loss, grads = objective_step(model, optimizer, step_rows(step))
        losses.append(loss)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, biases=biases(model))


# ----------------------------------------------------------------------------- the spawns
MODEL_LAYOUTS = {
    2: [dict(cp=2), dict(cp=2, dp_mode="zero1")],
    4: [dict(dp_shard=2, cp=2, ep=2), dict(dp_replicate=2, cp=2), dict(cp=2, tp=2)],
}


def rank_runs() -> dict:
    world = dist.get_world_size()
    results = {"mla": mla_cases(ContextShard.of(dist.group.WORLD, SEQ_LEN))}
    results["models"] = [train_under(layout) for layout in MODEL_LAYOUTS[world]]
    if world == 2:
        results["unsharded"] = unsharded_call_error()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request):
    return request.param, run_distributed(rank_runs, request.param, timeout=200)


@pytest.fixture(scope="module")
def reference():
    return reference_training()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().norm().item()
    err = (out.double() - ref.double()).norm().item()
    return err / den if den > 0 else err


# ----------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_matches_one_process(ranks, layout):
    cp, results = ranks
    ref_out, ref_grads = mla_run(DocumentBounds.from_host(LAYOUTS[layout], "cpu"), lambda t: t)
    per_rank = [r["mla"]["mla", layout] for r in results]
    for rank, (out, grads) in enumerate(per_rank):
        context = ContextShard(None, rank, cp, SEQ_LEN)
        assert rel(out, shard_row(ref_out, context)) < TOL, f"rank {rank}: outputs"
        assert rel(grads["x"], shard_row(ref_grads["x"], context)) < TOL, f"rank {rank}: gradient of x"
    for name in set(ref_grads) - {"x"}:
        total = sum(grads[name] for _, grads in per_rank)
        assert rel(total, ref_grads[name]) < TOL, f"gradient of {name} summed over the ranks"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_flex_forward_matches_one_process(ranks, layout):
    cp, results = ranks
    ref_out, _ = mla_run(DocumentBounds.from_host(LAYOUTS[layout], "cpu"), lambda t: t)
    for rank, r in enumerate(results):
        context = ContextShard(None, rank, cp, SEQ_LEN)
        assert rel(r["mla"]["flex", layout], shard_row(ref_out, context)) < TOL, f"rank {rank}"


def test_one_rank_shard_runs_the_context_path_exactly():
    """cp = 1: the gather is the identity, the mask still cuts the queries at the chunk edge."""
    context = ContextShard.of(None, SEQ_LEN)
    for bounds in LAYOUTS.values():
        whole = DocumentBounds.from_host(bounds, "cpu")
        out, grads = mla_run(shard_documents(whole, context), lambda t: t)
        ref_out, ref_grads = mla_run(whole, lambda t: t)
        assert rel(out, ref_out) < TOL and all(rel(grads[n], ref_grads[n]) < TOL for n in ref_grads)


# ----------------------------------------------------------------------------- whole model
def test_model_trains_as_one_process(ranks, reference):
    world, results = ranks
    for i, layout in enumerate(MODEL_LAYOUTS[world]):
        got = results[0]["models"][i]
        for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
            assert abs(a - b) / abs(b) < TOL, f"{layout}: objective at step {step} {a} vs one process {b}"
        errors = [(rel(got["grads"][n], g), f"gradient of {n}") for n, g in reference["grads"].items()]
        errors += [(rel(got["params"][n], p), f"parameter {n}") for n, p in reference["params"].items()]
        worst, where = max(errors)
        assert worst < TOL, f"{layout}: {where} differs from one process by rel {worst:.2e}"
        assert (got["biases"] - reference["biases"]).abs().max() < 1e-12, f"{layout}: QB biases"
        for rank, r in enumerate(results[1:], start=1):
            assert torch.equal(r["models"][i]["biases"], got["biases"]), f"{layout}: rank {rank}'s QB biases"


def test_a_whole_row_under_cp_is_refused(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("checked in the two-rank spawn")
    assert "shard_model_inputs" in results[0]["unsharded"] and "layout.cp=2" in results[0]["unsharded"]


def test_the_context_path_never_reads_the_device_boundaries():
    """The sharded model (cp = 1: no communication) forms its inputs, masks and MTP targets from the
    host boundaries: the device copy is never read back."""
    ids, labels, bounds = step_rows(0)[0]
    model = build_model(model_config(), "cpu", seed=0, dtype=F64)
    inputs = shard_model_inputs(ids, labels, guarded(bounds), ContextShard.of(None, ROW))
    with forbid_host_reads():
        out = model(**inputs, return_logits=False)
        (out.lm_loss + out.mtp_loss).backward()


def test_mtp_targets_are_cut_from_the_whole_row():
    """The label after a chunk's last token comes from the next chunk, on another rank at cp = 2."""
    ids, labels, bounds = step_rows(0)[0]
    docs = DocumentBounds.from_host(bounds, "cpu")
    whole = mtp_labels(labels, docs)
    for rank in range(2):
        context = ContextShard(None, rank, 2, ROW)
        inputs = shard_model_inputs(ids, labels, docs, context)
        assert torch.equal(inputs["mtp_targets"], shard_row(whole, context))
        assert torch.equal(inputs["labels"], shard_row(labels, context))
        assert inputs["docs"].shard.context == context
    end = ROW // 4 - 1  # chunk 0's last token: its MTP target is label 16, rank 1's first
    if whole[0, end] != IGNORE_INDEX:
        assert whole[0, end] == labels[0, end + 1]


def test_hsdp_shards_over_dp_shard_and_cp_flattened():
    """dp_replicate x dp_shard x cp x tp = 2 x 2 x 2 x 2: FSDP replicates over dp_replicate and shards
    over the 4 ranks of dp_shard x cp that share this rank's tp coordinate (no communication: a fake
    process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from moe_lc.parallel import ParallelLayout, build_mesh

    for rank, expected in [(0, [[0, 2, 4, 6], [8, 10, 12, 14]]), (11, [[1, 3, 5, 7], [9, 11, 13, 15]])]:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=16)
        try:
            mesh = _fsdp_mesh(build_mesh(ParallelLayout(dp_replicate=2, dp_shard=2, cp=2, tp=2)), ("dp_shard", "cp"))
            assert mesh.mesh.tolist() == expected and mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        finally:
            dist.destroy_process_group()
