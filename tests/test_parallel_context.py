"""Context parallelism of the KDA layer: zigzag sharding, each rank's view of the documents, the
short convolution's halo, KCP for chunk_kda and the whole layer, against one process.

The host bookkeeping is checked against a token-by-token brute force. The multi-process checks
(gloo, cp = 2 and 4, float64) spawn once per cp and run every case there; the references are the
same ops on the whole row in this process. Outputs and token gradients must equal the reference
at the rank's tokens, and replicated tensors' gradients (the initial state, the layer's
parameters) summed over the ranks must equal the reference's: rel < 1e-10 in float64.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from host_reads import forbid_host_reads, guarded
from parallel_harness import run_distributed
from moe_lc.config import KDAConfig
from moe_lc.model.kda import KDAttention
from moe_lc.ops.documents import DocumentBounds
from moe_lc.ops.kda import chunk_kda, kda_gate, recurrent_kda
from moe_lc.ops.short_conv import short_conv
from moe_lc.parallel.layout import MESH_DIMS
from moe_lc.parallel.context import ContextShard, shard_documents, shard_row, unshard_row

F64 = torch.float64
TOL = 1e-10
SEQ_LEN = 64  # 2 cp chunks of 16 (cp = 2) or 8 (cp = 4) tokens
HEADS, KEY_DIM, VALUE_DIM, CHANNELS, D_MODEL = 2, 8, 4, 6, 16
# Chunk edges at 16, 32, 48 (cp = 2) and every 8 tokens (cp = 4).
LAYOUTS = {
    "one_document": [0, 64],
    # [5, 29) crosses ranks; [29, 30) lies inside one chunk; [30, 61) runs through whole chunks
    # and, under cp = 2, from chunk 2 (rank 1) into chunk 3 (rank 0, the far end of its zigzag pair)
    "crossing": [0, 5, 29, 30, 61, 64],
    "at_chunk_edges": [0, 16, 32, 40, 64],  # documents starting exactly at chunk edges
}
OP_CASES = [("one_document", False), ("crossing", False), ("crossing", True), ("at_chunk_edges", True)]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------- inputs (same in every process)
def kda_inputs(layout: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, SEQ_LEN, HEADS, KEY_DIM)
    q = F.normalize(torch.randn(shape, dtype=F64, generator=gen), dim=-1)
    k = F.normalize(torch.randn(shape, dtype=F64, generator=gen), dim=-1)
    v = torch.randn(1, SEQ_LEN, HEADS, VALUE_DIM, dtype=F64, generator=gen)
    # slow decays (about -0.1 per step), so that states carry across several chunks
    g = kda_gate(torch.randn(shape, dtype=F64, generator=gen), 0.5 * torch.randn(HEADS, dtype=F64, generator=gen),
                 torch.randn(HEADS * KEY_DIM, dtype=F64, generator=gen) - 5)
    beta = torch.sigmoid(torch.randn(1, SEQ_LEN, HEADS, dtype=F64, generator=gen))
    num_docs = len(LAYOUTS[layout]) - 1
    state = torch.randn(num_docs, HEADS, KEY_DIM, VALUE_DIM, dtype=F64, generator=gen)
    weight = torch.randn(1, SEQ_LEN, HEADS, VALUE_DIM, dtype=F64, generator=gen)  # loss = sum(weight * o)
    return (q, k, v, g, beta), state, weight


def conv_inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, SEQ_LEN, CHANNELS, dtype=F64, generator=gen)
    w = torch.randn(CHANNELS, 4, dtype=F64, generator=gen)
    return x, w, torch.randn(1, SEQ_LEN, CHANNELS, dtype=F64, generator=gen)


def layer_and_inputs(seed: int = 2):
    torch.manual_seed(seed)
    layer = KDAttention(D_MODEL, KDAConfig(num_heads=HEADS, head_dim=KEY_DIM, conv_size=4, backend="torch")).double()
    with torch.no_grad():  # away from the initial A = 0 so that every parameter matters
        layer.A_log.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, SEQ_LEN, D_MODEL, dtype=F64, generator=gen)
    return layer, x, torch.randn(1, SEQ_LEN, D_MODEL, dtype=F64, generator=gen)


# ----------------------------------------------------------------------------- what each process computes
def kda_run(docs: DocumentBounds, layout: str, with_state: bool, to_local):
    """Outputs and gradients of chunk_kda on the row (to_local: the identity) or this rank's shard."""
    tensors, state, weight = kda_inputs(layout)
    leaves = [to_local(t).requires_grad_() for t in tensors]
    state = state.requires_grad_() if with_state else None
    out, _ = chunk_kda(*leaves, initial_state=state, docs=docs, backend="torch")
    (out * to_local(weight)).sum().backward()
    grads = {name: t.grad for name, t in zip("q k v g beta".split(), leaves)}
    if with_state:
        grads["initial_state"] = state.grad
    return out.detach(), grads


def conv_run(docs: DocumentBounds, to_local):
    x, w, dout = (t.clone() for t in conv_inputs())
    x = to_local(x).requires_grad_()
    w.requires_grad_()
    y = short_conv(x, w, docs, activation="silu", backend="torch")
    (y * to_local(dout)).sum().backward()
    return y.detach(), {"x": x.grad, "weight": w.grad}


def layer_run(docs: DocumentBounds, to_local):
    layer, x, dout = layer_and_inputs()
    x = to_local(x).requires_grad_()
    y = layer(x, docs)
    (y * to_local(dout)).sum().backward()
    return y.detach(), {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}


def _rank_runs() -> dict:
    """Every case on this rank of a cp group spanning the world."""
    context = ContextShard.of(dist.group.WORLD, SEQ_LEN)
    docs = {name: shard_documents(DocumentBounds.from_host(b, "cpu"), context) for name, b in LAYOUTS.items()}
    local = lambda t: shard_row(t, context)  # noqa: E731
    results = {"rank": context.rank}
    for layout, with_state in OP_CASES:
        results["kda", layout, with_state] = kda_run(docs[layout], layout, with_state, local)
    for layout in LAYOUTS:
        results["conv", layout] = conv_run(docs[layout], local)
        results["layer", layout] = layer_run(docs[layout], local)
    x = torch.arange(SEQ_LEN * 3, dtype=F64).view(1, SEQ_LEN, 3)
    results["unshard"] = unshard_row(shard_row(x, context), context)
    if context.size == 4:  # cp groups of 2 inside a (dp_shard = 2) x (cp = 2) mesh: group ranks are not global ranks
        mesh = init_device_mesh("cpu", (1, 1, 2, 2, 1), mesh_dim_names=MESH_DIMS)
        sub = ContextShard.from_mesh(mesh, SEQ_LEN)
        sharded = shard_documents(DocumentBounds.from_host(LAYOUTS["crossing"], "cpu"), sub)
        results["mesh"] = sub.rank, layer_run(sharded, lambda t: shard_row(t, sub))
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def ranks(request):
    """(cp, each rank's results): one spawn per cp for all the cases."""
    return request.param, run_distributed(_rank_runs, request.param, timeout=150)


def assert_matches(cp: int, per_rank: list, reference, replicated: set[str]) -> None:
    """Outputs and token gradients at every rank's tokens; replicated gradients summed over ranks."""
    ref_out, ref_grads = reference
    for rank, (out, grads) in enumerate(per_rank):
        context = ContextShard(None, rank, cp, SEQ_LEN)
        assert rel(out, shard_row(ref_out, context)) < TOL, f"rank {rank}: outputs"
        for name, grad in grads.items():
            if name not in replicated:
                assert rel(grad, shard_row(ref_grads[name], context)) < TOL, f"rank {rank}: gradient of {name}"
    for name in replicated & set(ref_grads):
        total = sum(grads[name] for _, grads in per_rank if grads[name] is not None)  # None: no token uses it
        assert rel(total, ref_grads[name]) < TOL, f"gradient of {name} summed over ranks"


@pytest.mark.parametrize("layout, with_state", OP_CASES)
def test_chunk_kda_matches_one_process(ranks, layout, with_state):
    cp, results = ranks
    whole = DocumentBounds.from_host(LAYOUTS[layout], "cpu")
    reference = kda_run(whole, layout, with_state, lambda t: t)
    assert_matches(cp, [r["kda", layout, with_state] for r in results], reference, {"initial_state"})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_short_conv_halo_matches_one_process(ranks, layout):
    cp, results = ranks
    reference = conv_run(DocumentBounds.from_host(LAYOUTS[layout], "cpu"), lambda t: t)
    assert_matches(cp, [r["conv", layout] for r in results], reference, {"weight"})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kda_layer_matches_one_process(ranks, layout):
    cp, results = ranks
    reference = layer_run(DocumentBounds.from_host(LAYOUTS[layout], "cpu"), lambda t: t)
    params = set(reference[1]) - {"x"}
    assert_matches(cp, [r["layer", layout] for r in results], reference, params)


def test_cp_groups_of_a_mesh_match_one_process(ranks):
    cp, results = ranks
    if cp != 4:
        pytest.skip("the mesh case runs in the four-rank spawn")
    reference = layer_run(DocumentBounds.from_host(LAYOUTS["crossing"], "cpu"), lambda t: t)
    for group in (results[:2], results[2:]):  # dp_shard rows of the mesh: global ranks {0, 1} and {2, 3}
        assert [r["mesh"][0] for r in group] == [0, 1]
        assert_matches(2, [r["mesh"][1] for r in group], reference, set(reference[1]) - {"x"})


def test_unshard_row_restores_the_row(ranks):
    _, results = ranks
    x = torch.arange(SEQ_LEN * 3, dtype=F64).view(1, SEQ_LEN, 3)
    for r in results:
        assert torch.equal(r["unshard"], x)


# ----------------------------------------------------------------------------- one process
def test_one_rank_shard_runs_the_context_path_exactly():
    """cp = 1: one rank holds chunks 0 and 1, so the scan and the halo run with local copies only."""
    context = ContextShard.of(None, SEQ_LEN)
    for layout, bounds in LAYOUTS.items():
        whole = DocumentBounds.from_host(bounds, "cpu")
        sharded = shard_documents(whole, context)
        for with_state in (False, True):
            out, grads = kda_run(sharded, layout, with_state, lambda t: t)
            ref_out, ref_grads = kda_run(whole, layout, with_state, lambda t: t)
            assert rel(out, ref_out) < TOL
            assert all(rel(grads[n], ref_grads[n]) < TOL for n in ref_grads)
        out, grads = layer_run(sharded, lambda t: t)
        ref_out, ref_grads = layer_run(whole, lambda t: t)
        assert rel(out, ref_out) < TOL and all(rel(grads[n], ref_grads[n]) < TOL for n in ref_grads)


def test_the_context_path_never_reads_the_device_boundaries():
    layer, x, _ = layer_and_inputs()
    docs = shard_documents(guarded(LAYOUTS["crossing"]), ContextShard.of(None, SEQ_LEN))
    with forbid_host_reads():
        layer(x.requires_grad_(), docs).sum().backward()


# ----------------------------------------------------------------------------- host bookkeeping
def brute_force_view(bounds: list[int], cp: int, rank: int) -> dict:
    """Token by token: which document and chunk each local token is in, grouped into pieces."""
    chunk_len = bounds[-1] // (2 * cp)
    doc_of = [max(n for n in range(len(bounds) - 1) if bounds[n] <= t) for t in range(bounds[-1])]
    tokens = [t for c in (rank, 2 * cp - 1 - rank) for t in range(c * chunk_len, (c + 1) * chunk_len)]
    pieces = []
    for i, t in enumerate(tokens):
        key = (t // chunk_len, doc_of[t])
        if pieces and pieces[-1]["key"] == key:
            pieces[-1]["end"], pieces[-1]["last"] = i + 1, t
        else:
            pieces.append(dict(key=key, start=i, end=i + 1, first=t, last=t))
    chunks = []
    for c in range(2 * cp):
        start, end = c * chunk_len, (c + 1) * chunk_len
        chunks.append((doc_of[start], doc_of[end - 1], start in bounds, end in bounds,
                       len({doc_of[t] for t in range(start, end)}) == 1 and start not in bounds))
    return dict(
        pieces=[(p["start"], p["end"], *p["key"], p["first"] != bounds[p["key"][1]],
                 p["last"] + 1 != bounds[p["key"][1] + 1]) for p in pieces],
        chunks=chunks,
        positions=[t - bounds[doc_of[t]] for t in tokens],
    )


def test_document_view_matches_a_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        cp = rng.randint(1, 4)
        seq_len = 2 * cp * rng.randint(1, 6)
        cuts = sorted(rng.sample(range(1, seq_len), rng.randint(0, min(seq_len - 1, 9))))
        bounds = [0, *cuts, seq_len]
        for rank in range(cp):
            view = shard_documents(DocumentBounds.from_host(bounds, "cpu"), ContextShard(None, rank, cp, seq_len)).shard
            expected = brute_force_view(bounds, cp, rank)
            got = [(p.local_start, p.local_end, p.chunk, p.doc, p.from_previous, p.into_next) for p in view.pieces]
            assert got == expected["pieces"], (bounds, cp, rank)
            assert [(c.first_doc, c.last_doc, c.starts_document, c.ends_document, c.tail_from_previous)
                    for c in view.chunks] == expected["chunks"]
            assert view.positions.tolist() == expected["positions"]
            assert view.local.host == (0, *(p.local_end for p in view.pieces))


def test_zigzag_sharding():
    context = ContextShard(None, 1, 4, 64)
    assert context.chunks == (1, 6) and context.ranges == ((8, 16), (48, 56)) and context.local_len == 16
    assert [ContextShard(None, 0, 4, 64).holder(c) for c in range(8)] == [
        (0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    x = torch.arange(64).view(1, 64)
    assert shard_row(x, context).tolist() == [[*range(8, 16), *range(48, 56)]]


def test_bad_shards_and_inputs_get_one_clear_error():
    with pytest.raises(ValueError, match="multiple of 8"):
        ContextShard(None, 0, 4, 60)
    with pytest.raises(ValueError, match="rank 4 is not one of the 4"):
        ContextShard(None, 4, 4, 64)
    docs = DocumentBounds.from_host([0, 30, 64], "cpu")
    with pytest.raises(ValueError, match="seq_len=64"):
        shard_documents(docs, ContextShard(None, 0, 2, 32))
    sharded = shard_documents(docs, ContextShard(None, 0, 2, 64))
    with pytest.raises(ValueError, match="already sharded"):
        shard_documents(sharded, ContextShard(None, 0, 2, 64))
    (q, k, v, g, beta), _, _ = kda_inputs("one_document")
    local = [t[:, :32] for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="has no process group"):
        chunk_kda(*local, docs=sharded, backend="torch")
    with pytest.raises(ValueError, match="pass this rank's local row"):
        chunk_kda(q, k, v, g, beta, docs=sharded, backend="torch")
    with pytest.raises(ValueError, match="shards one packed row"):
        chunk_kda(*[torch.cat([t, t]) for t in local], docs=sharded, backend="torch")
    with pytest.raises(NotImplementedError, match="output_final_state=False"):
        chunk_kda(*local, docs=sharded, output_final_state=True, backend="torch")
    with pytest.raises(ValueError, match="not a context-parallel shard"):
        recurrent_kda(*local, docs=sharded)
    with pytest.raises(ValueError, match="has no process group"):
        short_conv(torch.zeros(1, 32, 3), torch.zeros(3, 4), sharded)
    with pytest.raises(ValueError, match="chunks of at least 3 tokens"):
        short_conv(torch.zeros(1, 4, 3), torch.zeros(3, 4), shard_documents(
            DocumentBounds.from_host([0, 8], "cpu"), ContextShard(None, 0, 2, 8)))
