"""The document-causal attention op (moe_lc.ops.attention) against a float64 reference written from
the formula: softmax(q k^T * scale + M) v with M = 0 where the key is not after the query and in
its document, -inf elsewhere; gradients of q, k, v from autograd through that formula.

Every backend that runs here is tested: on CPU "torch" and "padded" (forward and gradients) and
"flex" (eager, forward only: torch has no CPU backward for flex attention); on CUDA all four,
"varlen" in bf16.
Rows of 300 tokens span three of flex's 128-token blocks, so documents start inside blocks, fill
whole blocks and end on block edges.
"""

from __future__ import annotations

import pytest
import torch

import moe_lc.ops.attention as attention
from moe_lc.ops.attention import (
    CUDA_ORDER_DOCUMENTS,
    causal_document_attention,
    document_mask,
    inputs_unsupported_reason,
    resolve_backend,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64
# Relative (Frobenius) error allowed against float64: fp32 ~100x its unit roundoff (6e-8) for sums
# over 300 keys; bf16 ~5x its unit roundoff (3.9e-3), as the fused kernels round the
# probabilities to bf16 before multiplying by v.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
BACKENDS = ["torch", "padded", "flex", "varlen"]
T = 300
CASES = {
    "one-token documents": [1, 130, 1, 1, 40, 127],
    "empty document": [7, 0, 293],
    "documents on block edges": [128, 128, 44],
    "single document": [T],
    "no documents": None,
}
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


def bounds_of(lens: list[int]) -> list[int]:
    return [0] + torch.tensor(lens).cumsum(0).tolist()


def reference(q, k, v, scale: float, lens) -> torch.Tensor:
    """softmax(q k^T * scale + M) v in float64, M from the document of every token."""
    seq_len = q.shape[2]
    doc = torch.zeros(seq_len, dtype=torch.long) if lens is None else torch.repeat_interleave(
        torch.arange(len(lens)), torch.tensor(lens))
    i = torch.arange(seq_len)
    allowed = (i[None, :] <= i[:, None]) & (doc[:, None] == doc[None, :])
    scores = (q.double().cpu() @ k.double().cpu().transpose(-1, -2)) * scale
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double().cpu()


def inputs(dtype, batch=1, heads=2, qk_dim=24, v_dim=16, seq_len=T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, seq_len, qk_dim, generator=gen) for _ in range(2))
    v, dout = (torch.randn(batch, heads, seq_len, v_dim, generator=gen) for _ in range(2))
    return [t.to(DEVICE, dtype) for t in (q, k, v, dout)]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values"
    ref = ref.double().cpu()
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def skip_unless_runs(backend: str, q, k, v) -> None:
    reason = attention.backend_unavailable_reason(backend, DEVICE) or inputs_unsupported_reason(backend, q, k, v)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")


def documents(lens):
    if lens is None:
        return {}
    return {"cu_seqlens": torch.tensor(bounds_of(lens), dtype=torch.int32, device=DEVICE)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_float64_reference(backend, case, dtype):
    q, k, v, _ = inputs(dtype, batch=2 if CASES[case] is None else 1)
    skip_unless_runs(backend, q, k, v)
    out = causal_document_attention(q, k, v, 0.3, backend=backend, **documents(CASES[case]))
    assert out.shape == v.shape and out.dtype == dtype
    assert rel(out, reference(q, k, v, 0.3, CASES[case])) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_float64_reference(backend, case, dtype):
    q, k, v, dout = inputs(dtype, batch=2 if CASES[case] is None else 1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    skip_unless_runs(backend, q, k, v)
    out = causal_document_attention(q, k, v, 0.3, backend=backend, **documents(CASES[case]))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, 0.3, CASES[case])
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    errors = {name: rel(g, r) for name, g, r in zip("qkv", grads, ref_grads)}
    assert all(e < TOLERANCE[dtype] for e in errors.values()), errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_head_sizes(backend):
    """MLA's head sizes (q/k 192 = 128 + 64 shared, v 128) are accepted, with gradients where the
    backend has a backward here."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    lens = [50, 1, 79]
    q, k, v, dout = inputs(dtype, qk_dim=192, v_dim=128, seq_len=sum(lens))
    skip_unless_runs(backend, q, k, v)
    with_grad = inputs_unsupported_reason(backend, q.requires_grad_(), k, v) is None
    q.requires_grad_(with_grad)
    out = causal_document_attention(q, k, v, 192**-0.5, backend=backend, **documents(lens))
    assert rel(out, reference(q.detach(), k, v, 192**-0.5, lens)) < TOLERANCE[dtype]
    if with_grad:
        (dq,) = torch.autograd.grad(out, q, dout)
        leaf = q.detach().double().cpu().requires_grad_()
        (ref_dq,) = torch.autograd.grad(reference(leaf, k, v, 192**-0.5, lens), leaf, dout.double().cpu())
        assert rel(dq, ref_dq) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_is_built_once_for_several_calls(backend, monkeypatch):
    """One document_mask per batch serves every layer: later calls build nothing and read nothing
    back from the device; without a mask every call builds its own."""
    q, k, v, _ = inputs(DTYPES[-1])
    skip_unless_runs(backend, q, k, v)
    lens = CASES["one-token documents"]
    builds, reads = [], []
    block_mask, read_bounds = attention._block_mask, attention._read_bounds
    monkeypatch.setattr(attention, "_block_mask", lambda *a, **kw: builds.append(1) or block_mask(*a, **kw))
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: reads.append(1) or read_bounds(cu))

    mask = document_mask(T, device=DEVICE, backend=backend, **documents(lens))
    built, read = len(builds), len(reads)
    ref = reference(q, k, v, 0.3, lens)
    for _ in range(3):
        assert rel(causal_document_attention(q, k, v, 0.3, mask=mask), ref) < TOLERANCE[q.dtype]
    assert (len(builds), len(reads)) == (built, read)
    assert built + read >= 1  # the mask needed a block mask or the host boundaries once

    causal_document_attention(q, k, v, 0.3, backend=backend, **documents(lens))
    assert len(builds) + len(reads) > built + read


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_bounds_need_no_device_read(backend, monkeypatch):
    """seq_bounds (the host copy the trainer has) replaces the device read of cu_seqlens."""
    q, k, v, _ = inputs(DTYPES[-1])
    skip_unless_runs(backend, q, k, v)
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: pytest.fail("cu_seqlens was read back"))
    lens = CASES["one-token documents"]
    out = causal_document_attention(q, k, v, 0.3, backend=backend, seq_bounds=bounds_of(lens), **documents(lens))
    assert rel(out, reference(q, k, v, 0.3, lens)) < TOLERANCE[q.dtype]


@pytest.mark.parametrize("given", ["cu_seqlens", "seq_bounds"])
def test_one_document_spanning_the_row_is_plain_causal(given, monkeypatch):
    """[0, T] needs no mask and no host read: auto takes the no-documents order (SDPA on CUDA)."""
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: pytest.fail("cu_seqlens was read back"))
    documents = {"cu_seqlens": torch.tensor([0, T], dtype=torch.int32, device=DEVICE), "seq_bounds": [0, T]}
    mask = document_mask(T, device=DEVICE, **{given: documents[given]})
    assert not mask.has_documents and mask.backend == resolve_backend("auto", DEVICE, has_documents=False)
    q, k, v, _ = inputs(DTYPES[-1])
    assert rel(causal_document_attention(q, k, v, 0.3, mask=mask), reference(q, k, v, 0.3, [T])) < TOLERANCE[q.dtype]


def test_auto_is_torch_on_cpu():
    assert resolve_backend("auto", torch.device("cpu"), has_documents=True) == "torch"
    assert resolve_backend("auto", torch.device("cpu"), has_documents=False) == "torch"
    assert document_mask(T, seq_bounds=bounds_of([T])).backend == "torch"


def test_auto_follows_the_cuda_order(monkeypatch):
    """On CUDA, auto takes the first backend of its order that runs here and takes the inputs."""
    cuda = torch.device("cuda")
    unavailable = set()
    monkeypatch.setattr(attention, "backend_unavailable_reason",
                        lambda name, device: "off in this test" if name in unavailable else None)
    long_documents = attention.PADDED_MIN_MEAN_LENGTH
    assert resolve_backend("auto", cuda, True, mean_document_length=long_documents) == CUDA_ORDER_DOCUMENTS[0]
    unavailable.add(CUDA_ORDER_DOCUMENTS[0])
    assert resolve_backend("auto", cuda, True, mean_document_length=long_documents) == CUDA_ORDER_DOCUMENTS[1]
    unavailable.clear()
    fp32 = torch.zeros(1, 1, 4, 16)  # varlen takes fp16/bf16 only
    expected = next(name for name in CUDA_ORDER_DOCUMENTS if inputs_unsupported_reason(name, fp32, fp32, fp32) is None)
    assert resolve_backend("auto", cuda, True, inputs=(fp32, fp32, fp32), mean_document_length=long_documents) == expected


def test_auto_pads_documents_only_where_they_are_long_and_known_on_the_host(monkeypatch):
    """"padded" makes one SDPA call per document: auto takes it for batches of long documents whose
    boundaries the host holds, never where it would have to read them back or launch per short one."""
    monkeypatch.setattr(attention, "backend_unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(attention, "_read_bounds", lambda cu: pytest.fail("cu_seqlens was read back"))
    cuda, n = torch.device("cuda"), attention.PADDED_MIN_MEAN_LENGTH
    assert CUDA_ORDER_DOCUMENTS[0] == "padded"
    long_docs, short_docs = [0, 3 * n, 4 * n], [0, n // 2, n, 3 * n // 2]  # means 2n and n / 2
    assert document_mask(4 * n, seq_bounds=long_docs, device=cuda).backend == "padded"
    assert resolve_backend("auto", cuda, True, mean_document_length=n / 2) == CUDA_ORDER_DOCUMENTS[1]
    assert attention._mean_length(short_docs) == n / 2
    assert resolve_backend("auto", cuda, True) == CUDA_ORDER_DOCUMENTS[1]  # boundaries not on the host
    assert resolve_backend("padded", cuda, True) == "padded"  # asked for: taken whatever the lengths


def test_padded_lengths_are_few_and_close_above_the_length():
    """Each length pads to at most 1/16 more from 8K tokens on (a multiple of 512 below), and the
    lengths that occur are few: every one of them is an execution plan that cuDNN builds once."""
    lengths = {attention.padded_length(n) for n in range(1, 65537)}
    assert all(attention.padded_length(n) >= n for n in range(1, 65537))
    assert max(attention.padded_length(n) - n for n in range(1, 8193)) == attention.PAD_MIN_STEP - 1
    assert max(attention.padded_length(n) / n for n in range(8192, 65537)) <= 1 + 1 / 16
    assert sorted(x for x in lengths if x <= 8192) == list(range(512, 8193, 512))  # 16 up to 8K
    assert len(lengths) == 16 + 3 * 16  # and 16 per doubling after
    assert all(attention.padded_length(n) == n for n in lengths)  # a padded length pads to itself


def test_padding_documents_changes_nothing_in_float64():
    """Documents padded to their lengths (512 pads to itself; 37 and 600 pad up) give the formula's
    output and gradients: the zero rows after a document are hidden from its real queries."""
    lens = [512, 37, 600]
    q, k, v, dout = (t.double().cpu() for t in inputs(torch.float32, heads=1, qk_dim=8, v_dim=4, seq_len=sum(lens)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = document_mask(sum(lens), seq_bounds=bounds_of(lens), backend="padded")
    assert mask.backend == "padded"
    out = causal_document_attention(q, k, v, 0.3, mask=mask)
    ref = reference(q, k, v, 0.3, lens)
    assert rel(out, ref) < 1e-12
    grads, ref_grads = torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)
    assert all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))


def test_auto_with_a_mask_the_inputs_do_not_fit_runs_torch():
    """Under auto, inputs the mask's backend cannot take run the reference loop, with a warning."""
    q, k, v, dout = inputs(torch.float32)
    fake = attention.DocumentMask("varlen", T, 1, True, bounds=tuple(bounds_of([100, 200])))
    with pytest.warns(UserWarning, match="cannot take these inputs"):
        out = causal_document_attention(q, k, v, 0.3, mask=fake)
    assert rel(out, reference(q, k, v, 0.3, [100, 200])) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v: causal_document_attention(q, k, v, 0.3, seq_bounds=[0, 5, T - 1]), "rise from 0"),
    (lambda q, k, v: causal_document_attention(q, k[..., :8], v, 0.3), "one shape"),
    (lambda q, k, v: causal_document_attention(q, k, v[:, :, :5], 0.3), "v must be"),
    (lambda q, k, v: causal_document_attention(q, k, v, 0.3, backend="cudnn"), "unknown backend"),
    (lambda q, k, v: causal_document_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                               v.expand(2, -1, -1, -1), 0.3, seq_bounds=[0, T]), "batch size 1"),
    (lambda q, k, v: causal_document_attention(q, k, v, 0.3, seq_bounds=[0, T],
                                               mask=document_mask(T, seq_bounds=[0, T])), "documents once"),
    (lambda q, k, v: causal_document_attention(q, k, v, 0.3, mask=document_mask(T + 1)), "built for batch"),
    (lambda q, k, v: causal_document_attention(q, k, v, 0.3, backend="flex", mask=document_mask(T)),
     'built for backend "torch"'),
])
def test_bad_input_says_what_to_fix(call, message):
    q, k, v, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match=message):
        call(q, k, v)


def test_unavailable_backend_is_an_error_not_a_fallback():
    q, k, v, _ = (t.cpu() for t in inputs(torch.float32))
    with pytest.raises(RuntimeError, match='"varlen" unavailable'):
        causal_document_attention(q, k, v, 0.3, backend="varlen")
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        causal_document_attention(q, k, v, 0.3, backend="flex")


# ----------------------------------------------------------------------------- queries from part of the row
# Two ranges of the row, as a context-parallel rank holds them: documents start inside them, before
# them and (block edges: 256) at their first token.
QUERY_RANGES = ((40, 130), (256, 300))


def at_query_positions(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:, :, a:b] for a, b in QUERY_RANGES], dim=2)


def check_queries_from_part_of_the_row(backend: str, lens, dtype, with_grad: bool, given: str = "cu_seqlens") -> None:
    """q of the ranges' positions against the whole row's k, v: the row's reference at those positions.
    ``given``: the documents as device boundaries or as host ints."""
    q_row, k, v, dout_row = inputs(dtype)
    q, dout = at_query_positions(q_row), at_query_positions(dout_row)
    q, k, v = (t.requires_grad_(with_grad) for t in (q, k, v))
    docs = documents(lens) if given == "cu_seqlens" or lens is None else {"seq_bounds": bounds_of(lens)}
    mask = document_mask(T, device=DEVICE, backend=backend, query_ranges=QUERY_RANGES, **docs)
    out = causal_document_attention(q, k, v, 0.3, mask=mask)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and mask.backend == backend
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q_row, k, v)]
    ref = at_query_positions(reference(*leaves, 0.3, lens))
    assert rel(out, ref) < TOLERANCE[dtype]
    if with_grad:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
        errors = {name: rel(g, r) for name, g, r in
                  zip("qkv", grads, (at_query_positions(ref_grads[0]), *ref_grads[1:]))}
        assert all(e < TOLERANCE[dtype] for e in errors.values()), errors


@pytest.mark.parametrize("given", ["cu_seqlens", "seq_bounds"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_from_part_of_the_row_match_the_rows_reference(backend, case, dtype, given):
    q, k, v, _ = inputs(dtype)
    skip_unless_runs(backend, q, k, v)
    with_grad = inputs_unsupported_reason(backend, q.requires_grad_(), k, v) is None
    check_queries_from_part_of_the_row(backend, CASES[case], dtype, with_grad, given)


def standin_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size):
    """FlashAttention's variable-length attention written out: sequence i's queries against its keys,
    causal with the diagonal aligned at the end (window (-1, 0)), as the varlen kernel computes it."""
    assert window_size == (-1, 0)
    outs = []
    for i in range(len(cu_seq_q) - 1):
        qs, ks = query[cu_seq_q[i]:cu_seq_q[i + 1]], key[cu_seq_k[i]:cu_seq_k[i + 1]]
        vs = value[cu_seq_k[i]:cu_seq_k[i + 1]]
        n_q, n_k = qs.shape[0], ks.shape[0]
        assert n_q <= max_q and n_k <= max_k
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=qs.device).tril(n_k - n_q)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vs))
    return torch.cat(outs)


@pytest.mark.parametrize("case", ["one-token documents", "documents on block edges", "single document"])
def test_varlen_packs_each_query_pieces_keys(case, monkeypatch):
    """On CPU, with a stand-in for FlashAttention's kernel: the varlen path's packing of query pieces
    and their keys (cu_seqlens of both sides, the key index, the maxima) and its backward."""
    monkeypatch.setattr(attention, "_varlen_api", lambda: standin_varlen)
    monkeypatch.setattr(attention, "_varlen_options", lambda: (True, True))
    monkeypatch.setattr(attention, "backend_unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(attention, "inputs_unsupported_reason", lambda name, q, k, v: None)
    check_queries_from_part_of_the_row("varlen", CASES[case], torch.float32, with_grad=True)


def test_query_pieces_cut_at_documents():
    pieces = attention.query_pieces([0, 10, 10, 25, 40], [(5, 20), (30, 40)])
    assert pieces.query_bounds == (0, 5, 15, 25)
    assert list(zip(pieces.key_starts, pieces.key_ends)) == [(0, 10), (10, 20), (25, 40)]
    with pytest.raises(ValueError, match="inside the row of 40"):
        attention.query_pieces([0, 40], [(30, 50)])
    q, k, v, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="query_ranges"):
        causal_document_attention(q[:, :, :10], k, v, 0.3)
    mask = document_mask(T, query_ranges=QUERY_RANGES)
    with pytest.raises(ValueError, match="holds 134 queries"):
        causal_document_attention(q[:, :, :10], k, v, 0.3, mask=mask)
