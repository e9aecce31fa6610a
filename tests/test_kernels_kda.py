"""Triton KDA kernels (moe_lc_kernels) against the float64 reference of moe_lc.ops.kda.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernels are first imported), so the shapes stay small: T <= ~300, K, V in {16, 32}.
Every check compares outputs, final states and the gradients of every input with float64.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from host_reads import forbid_host_reads, guarded  # noqa: E402
from moe_lc.ops.documents import DocumentBounds  # noqa: E402
from moe_lc.ops.kda import chunk_kda, kda_gate  # noqa: E402
from moe_lc_kernels import triton_available  # noqa: E402
from moe_lc_kernels.kda import build_plan, chunk_kda_fused, chunk_kda_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not triton_available(DEVICE):
    pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is not 1)", allow_module_level=True)

F64 = torch.float64
TOL = 1e-4  # fp32 kernels vs float64 (measured errors are ~1e-6)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values (NaN marks unwritten or broken outputs)"
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def raw_inputs(batch, seq_len, heads, key_dim, value_dim, num_states=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE).requires_grad_()

    x = dict(q=rnd(batch, seq_len, heads, key_dim), k=rnd(batch, seq_len, heads, key_dim),
             v=rnd(batch, seq_len, heads, value_dim), z=rnd(batch, seq_len, heads, key_dim, scale=2.0),
             beta=rnd(batch, seq_len, heads), A_log=rnd(heads, scale=0.5), dt_bias=rnd(heads * key_dim))
    h0 = None if num_states is None else rnd(num_states, heads, key_dim, value_dim)
    return x, h0


def fused_reference(x, h0, bounds):
    """Float64 reference for chunk_kda_fused: the same formulas, then the torch chunk op."""
    d = {n: t.double() for n, t in x.items()}
    g = kda_gate(d["z"], d["A_log"], d["dt_bias"], lower_bound=-5.0)
    return chunk_kda(l2norm(d["q"]), l2norm(d["k"]), d["v"], g, torch.sigmoid(d["beta"]),
                     initial_state=None if h0 is None else h0.double(), output_final_state=True,
                     docs=None if bounds is None else DocumentBounds.from_host(bounds, DEVICE), backend="torch")


def assert_matches(x, h0, out, final, ref_out, ref_final):
    """Forward, final state and every gradient (random cotangents on o and the final state)."""
    params = list(x.values()) + ([h0] if h0 is not None else [])
    gen = torch.Generator().manual_seed(99)
    do = torch.randn(out.shape, generator=gen).to(DEVICE)
    ds = torch.randn(final.shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad((out * do).sum() + (final * ds).sum(), params)
    ref_grads = torch.autograd.grad((ref_out * do.double()).sum() + (ref_final * ds.double()).sum(), params)
    errors = {"o": rel(out, ref_out), "final": rel(final, ref_final)}
    names = list(x) + (["h0"] if h0 is not None else [])
    errors.update({f"d{n}": rel(a, b) for n, a, b in zip(names, grads, ref_grads)})
    bad = {n: e for n, e in errors.items() if not e < TOL}
    assert not bad, f"errors above {TOL}: {bad} (all: {errors})"


@pytest.mark.parametrize("segment_chunks", [0, 1])
def test_fused_matches_float64_with_states(segment_chunks):
    """Batch of 2, T not a multiple of 64, initial and final states; serial and segmented passes."""
    x, h0 = raw_inputs(2, 150, 2, 32, 32, num_states=2, seed=1)
    out, final = chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                 initial_state=h0, output_final_state=True, segment_chunks=segment_chunks)
    assert out.dtype == torch.float32 and out.shape == (2, 150, 2, 32) and final.shape == (2, 2, 32, 32)
    assert_matches(x, h0, out, final, *fused_reference(x, h0, None))


def test_zero_query_and_key_rows_normalise_to_zero_as_in_float64():
    """A q or k row that is exactly zero (a zero projection, say) is 0 after the L2 norm only because
    of its eps (x / sqrt(|x|^2 + 1e-6)); without it the kernels would divide 0 by 0. Output, final
    state and every gradient finite and equal to float64's, with such rows inside and at the start
    of a chunk."""
    x, h0 = raw_inputs(1, 100, 2, 32, 32, num_states=1, seed=7)
    with torch.no_grad():
        for name, rows in (("q", [0, 5, 70]), ("k", [3, 5, 64])):
            x[name][:, rows] = 0.0
    out, final = chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                 initial_state=h0, output_final_state=True)
    assert_matches(x, h0, out, final, *fused_reference(x, h0, None))


def test_state_value_block_fills_the_multiprocessors():
    """64 wide where the serial pass fills the SMs, else 16 wide where that does, else 64 (segments)."""
    from moe_lc_kernels.kda import state_value_block

    assert state_value_block(8, 16, 128, 132) == 64  # B=8,T=4K: 256 programs at 64
    assert state_value_block(2, 16, 128, 132) == 16  # two 8K rows: 64 programs at 64, 256 at 16
    assert state_value_block(4, 16, 128, 132) == 16  # 128 programs at 64: one short of the SMs
    assert state_value_block(5, 16, 128, 132) == 64
    assert state_value_block(1, 16, 128, 132) == 64  # one long sequence: the segmented passes
    assert state_value_block(3, 2, 32, 4) == 64  # narrower values than the block: one block per head


@pytest.mark.parametrize("keep_states", [False, True])
def test_fused_matches_float64_with_narrow_state_blocks(monkeypatch, keep_states):
    """The state passes in 16-wide value blocks (two per head here), as the automatic choice picks
    them for a few sequences: same float64 agreement, kept states or recomputed."""
    from moe_lc_kernels import kda as kda_mod

    monkeypatch.setitem(kda_mod.TUNING, "state_bv", 16)
    monkeypatch.setitem(kda_mod.TUNING, "state_bwd_bv", 16)
    bounds = [0, 70, 150]
    x, h0 = raw_inputs(1, 150, 2, 32, 32, num_states=2, seed=4)
    out, final = chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                 initial_state=h0, output_final_state=True, seq_bounds=bounds, keep_states=keep_states)
    assert_matches(x, h0, out, final, *fused_reference(x, h0, bounds))


def test_projections_op_triton_backend_is_the_fused_kernel_of_the_same_composition():
    """moe_lc.ops.kda_projections: its triton backend (the fused kernels) against its torch backend (the
    definition) in float64, forward and gradients; a gate the kernels cannot take falls back."""
    from moe_lc.ops import kda_projections as proj

    x, h0 = raw_inputs(1, 90, 2, 16, 16, num_states=1, seed=8)
    names = ("q", "k", "v", "z", "beta", "A_log", "dt_bias")
    out, final = proj._triton(*(x[n] for n in names), -5.0, 0.25, h0, True, None)
    ref = proj._torch(*(x[n].double() for n in names), -5.0, 0.25, h0.double(), True, None)
    assert_matches(x, h0, out, final, *ref)
    softplus = proj._triton(*(x[n] for n in names), None, 0.25, h0, True, None)  # unbounded: torch
    wanted = proj._torch(*(x[n] for n in names), None, 0.25, h0, True, None)
    assert torch.equal(softplus[0], wanted[0])


def test_projections_op_hands_the_kernels_host_boundaries_without_reading_the_device():
    """Packed documents reach the fused kernels as ``docs.host``: the device cu_seqlens is never
    read back (the launch plan is built from the host copy), and the result is the float64 one."""
    from moe_lc.ops import kda_projections as proj

    bounds = [0, 3, 70, 130]
    x, h0 = raw_inputs(1, 130, 2, 16, 16, num_states=3, seed=9)
    names = ("q", "k", "v", "z", "beta", "A_log", "dt_bias")
    docs = guarded(bounds)
    with forbid_host_reads():
        out, final = proj._triton(*(x[n] for n in names), -5.0, 0.25, h0, True, docs)
    ref = proj._torch(*(x[n].double() for n in names), -5.0, 0.25, h0.double(), True,
                      DocumentBounds.from_host(bounds, DEVICE))
    assert_matches(x, h0, out, final, *ref)


@pytest.mark.parametrize("save_prep", ["inverse", "all"])
def test_saved_prep_gives_the_same_gradients(monkeypatch, save_prep):
    """save_prep keeps some or all of the forward's prep outputs instead of recomputing them in the
    backward: the same kernels on the same inputs, so the gradients must be bit-identical."""
    from moe_lc_kernels import kda as kda_mod

    bounds = [0, 90, 200]
    x, h0 = raw_inputs(1, 200, 2, 16, 16, num_states=2, seed=5)
    names = ("q", "k", "v", "z", "beta", "A_log", "dt_bias")

    def grads():
        out, final = chunk_kda_fused(*(x[n] for n in names), initial_state=h0, output_final_state=True,
                                     seq_bounds=bounds)
        return torch.autograd.grad(out.square().sum() + final.sum(), [*(x[n] for n in names), h0])

    monkeypatch.setitem(kda_mod.TUNING, "save_prep", "none")
    recomputed = grads()
    monkeypatch.setitem(kda_mod.TUNING, "save_prep", save_prep)
    saved = grads()
    for n, a, b in zip([*names, "h0"], recomputed, saved):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("kept", ["keep_states", "keep_prep"])
@pytest.mark.parametrize("segment_chunks", [0, 1])
def test_states_kept_by_the_forward_give_the_same_output_and_gradients(segment_chunks, kept):
    """keep_states: the forward's state pass keeps every chunk's state and Delta, and the backward
    skips its own; keep_prep: the forward keeps every prep output, and the backward does not rerun
    the prep. In fp32 the forward computes what the backward's reruns would, so the output, final
    state and every gradient are bit-identical to recomputing; across documents and segments alike,
    and the result is still the float64 one."""
    bounds = [0, 64, 150, 200]  # a document ending exactly at a chunk boundary, one crossing two chunks
    x, h0 = raw_inputs(1, 200, 2, 16, 16, num_states=3, seed=6)
    names = ("q", "k", "v", "z", "beta", "A_log", "dt_bias")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(1, 200, 2, 16, generator=gen).to(DEVICE)

    def run(keep):
        out, final = chunk_kda_fused(*(x[n] for n in names), initial_state=h0, output_final_state=True,
                                     seq_bounds=bounds, segment_chunks=segment_chunks, **{kept: keep})
        grads = torch.autograd.grad((out * do).sum() + final.square().sum(), [*(x[n] for n in names), h0])
        return out, final, grads

    out, final, grads = run(False)
    kept_out, kept_final, kept_grads = run(True)
    assert torch.equal(out, kept_out) and torch.equal(final, kept_final)
    for n, a, b in zip([*names, "h0"], grads, kept_grads):
        assert torch.equal(a, b), n
    fresh = chunk_kda_fused(*(x[n] for n in names), initial_state=h0, output_final_state=True, seq_bounds=bounds,
                            segment_chunks=segment_chunks, **{kept: True})
    assert_matches(x, h0, *fresh, *fused_reference(x, h0, bounds))


@pytest.mark.parametrize("kept", ["keep_states", "keep_prep"])
def test_kept_states_cost_what_the_planner_counts(kept):
    """The bytes keep_states adds to what the forward saves are every chunk's state and Delta in bf16,
    ``fused_kda_kept_states_bytes_per_head`` per head and token; keep_prep's are the prep's outputs,
    ``fused_kda_kept_prep_bytes_per_head``: the planner's figures."""
    from moe_lc.parallel.activation_memory import (fused_kda_kept_prep_bytes_per_head,
                                                   fused_kda_kept_states_bytes_per_head)

    heads, dim, tokens = 2, 16, 128
    x, _ = raw_inputs(1, tokens, heads, dim, dim, seed=4)
    inputs = [x[n].detach().to(torch.bfloat16).requires_grad_() if n not in ("A_log", "dt_bias") else x[n]
              for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias")]

    def saved_bytes(keep):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk_kda_fused(*inputs, **{kept: keep})
        return sum(storages.values())

    extra = saved_bytes(True) - saved_bytes(False)
    per_head = {"keep_states": fused_kda_kept_states_bytes_per_head, "keep_prep": fused_kda_kept_prep_bytes_per_head}
    assert extra == heads * tokens * per_head[kept](dim, dim)


def test_fused_packed_documents_segmented():
    """Packed documents of uneven lengths (one shorter than a tile), per-document states, segments of
    one and two chunks so that documents span several segments and the prefix scan is exercised."""
    bounds = [0, 3, 70, 200, 260]
    x, h0 = raw_inputs(1, 260, 1, 32, 32, num_states=4, seed=2)
    for segment_chunks in (1, 2):
        out, final = chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                     initial_state=h0, output_final_state=True, seq_bounds=bounds,
                                     segment_chunks=segment_chunks)
        assert_matches(x, h0, out, final, *fused_reference(x, h0, bounds))


def test_no_kernel_reads_an_unwritten_element(monkeypatch):
    """Every buffer the kernels allocate starts as NaN (torch.empty / empty_like poisoned while they
    run): outputs and gradients stay finite and match float64, so no kernel reads an element no kernel
    wrote. Short documents leave 16-row tiles past a sequence's end, whose score blocks must be
    written as zeros: NaN there reaches valid rows through 0 * NaN in the UT inverse."""
    bounds = [0, 3, 70, 150]
    x, h0 = raw_inputs(1, 150, 2, 32, 32, num_states=3, seed=4)
    names = ("q", "k", "v", "z", "beta", "A_log", "dt_bias")
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def make_nan(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return make_nan

    monkeypatch.setattr(torch, "empty", poisoned(real_empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(real_empty_like))
    out, final = chunk_kda_fused(*(x[n] for n in names), initial_state=h0, output_final_state=True,
                                 seq_bounds=bounds)
    params = [*(x[n] for n in names), h0]
    grads = torch.autograd.grad(out.square().sum() + final.sum(), params)
    monkeypatch.undo()
    ref_out, ref_final = fused_reference(x, h0, bounds)
    ref_grads = torch.autograd.grad(ref_out.square().sum() + ref_final.sum(), params)
    assert rel(out, ref_out) < TOL and rel(final, ref_final) < TOL
    for n, a, b in zip([*names, "h0"], grads, ref_grads):
        assert rel(a, b) < TOL, n


def test_fused_worst_case_inverse_identical_keys_no_decay():
    """Adversarial UT inverse: one key repeated, decay ~1 and beta ~1 make every in-tile score 1.
    The 16x16 diagonal inverse is a product of powers of N, whose entries reach C(15, 7) = 6435
    here, so fp32 loses ~3e-4 (measured) where random keys lose ~1e-6; tf32-level, far below the
    bf16 rounding of a training run, and a broken inverse would be off by O(1)."""
    gen = torch.Generator().manual_seed(6)
    seq_len, dim = 128, 32
    x = dict(q=torch.randn(1, seq_len, 1, dim, generator=gen),
             k=torch.randn(1, 1, 1, dim, generator=gen).expand(1, seq_len, 1, dim).contiguous(),
             v=torch.randn(1, seq_len, 1, dim, generator=gen), z=torch.full((1, seq_len, 1, dim), -30.0),
             beta=torch.full((1, seq_len, 1), 20.0), A_log=torch.zeros(1), dt_bias=torch.zeros(dim))
    x = {n: t.to(DEVICE) for n, t in x.items()}
    out, final = chunk_kda_fused(x["q"], x["k"], x["v"], x["z"], x["beta"], x["A_log"], x["dt_bias"],
                                 output_final_state=True)
    ref_out, ref_final = fused_reference(x, None, None)
    assert rel(out, ref_out) < 1e-3 and rel(final, ref_final) < 1e-3


def _round_f32_to_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to tf32's 10 mantissa bits, to nearest with ties to even (the low 13 bits
    cleared); finite inputs only, which is all the kernels' operands are."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return bits.astype(np.uint32).view(np.float32).reshape(np.shape(x))


@pytest.fixture
def emulated_tf32(monkeypatch):
    """Triton's interpreter computes every dot exactly; round fp32 operands of "tf32" dots to tf32
    (10 mantissa bits, as the tensor cores read them) and run fp32 inputs on the GPU's bf16 launch
    choices, so the precision of each backward product can be chosen without a GPU."""
    if DEVICE != "cpu":
        pytest.skip("emulates tf32 inside Triton's CPU interpreter")
    import triton.runtime.interpreter as interp

    from moe_lc_kernels import kda as kda_mod

    exact_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        name = str(input_precision).upper()
        if "TF32" in name and "X3" not in name and a.data.dtype == b.data.dtype == np.float32:
            a = interp.TensorHandle(_round_f32_to_tf32(a.data), a.dtype.scalar)
            b = interp.TensorHandle(_round_f32_to_tf32(b.data), b.dtype.scalar)
        return exact_dot(self, a, b, acc, input_precision, max_num_imprecise_acc)

    config = kda_mod._config
    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(kda_mod, "_config", lambda *args: {**config(*args), "dot": "tf32"})
    return kda_mod.TUNING


@triton.jit
def _unrounded(x, ROUND: tl.constexpr):
    """Stand-in for kda_triton._to_tf32 that leaves the rounding to the (emulated) tensor cores."""
    return x


def _gate_grad_errors(seed: int) -> dict[str, float]:
    bounds = [0, 106, 320]
    x, _ = raw_inputs(1, 320, 1, 32, 32, seed=seed)
    out, final = chunk_kda_fused(*(x[n] for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias")),
                                 output_final_state=True, seq_bounds=bounds)
    ref_out, ref_final = fused_reference(x, None, bounds)
    gen = torch.Generator().manual_seed(seed)
    do, ds = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
    grads = torch.autograd.grad((out * do).sum() + (final * ds).sum(), list(x.values()))
    ref = torch.autograd.grad((ref_out * do.double()).sum() + (ref_final * ds.double()).sum(), list(x.values()))
    return {n: rel(a, b) for n, a, b in zip(x, grads, ref)}


def test_tf32_score_products_with_matched_rounding_under_emulation(emulated_tf32, monkeypatch):
    """Every backward product in tf32 keeps every gradient within 1e-3 of float64, as close as
    near-exact score products (tf32x3), because the key-tile score products round their operands
    to tf32 once: each (i, j) term of dG then enters its row sum and its column sum with equal
    factors and cancels. Left to the tensor cores, each side rounds a different factor, and
    dt_bias and dz (built from dG) end up more than 10x and 3x further off."""
    assert emulated_tf32["bwd_prec"] == "tf32" and emulated_tf32["score_prec"] == "tf32"
    matched = _gate_grad_errors(seed=3)
    assert max(matched.values()) < 1e-3, matched
    monkeypatch.setitem(emulated_tf32, "score_prec", "tf32x3")
    near_exact = _gate_grad_errors(seed=3)
    assert matched["dt_bias"] < 3 * near_exact["dt_bias"], (matched, near_exact)

    from moe_lc_kernels import kda_triton

    monkeypatch.setitem(emulated_tf32, "score_prec", "tf32")
    monkeypatch.setattr(kda_triton, "_to_tf32", _unrounded)
    unmatched = _gate_grad_errors(seed=3)
    assert unmatched["dt_bias"] > 10 * matched["dt_bias"] and unmatched["z"] > 3 * matched["z"], (matched, unmatched)


def test_split_bf16_state_products_recover_the_state_precision(exact_bf16_dots, monkeypatch):
    """state_prec="bf16x2": the backward's state passes multiply bf16 halves hi + lo of the fp32
    state-side operand. Against the fp32 state passes (exact in the interpreter), its gradients
    must be far closer than those of plain bf16 products, which round that operand to 8 bits."""
    from moe_lc_kernels import kda as kda_mod

    x, h0 = raw_inputs(1, 200, 2, 32, 32, num_states=1, seed=3)
    xb = {n: t.detach().to(torch.bfloat16).requires_grad_() for n, t in x.items()}
    h0 = h0.detach().requires_grad_()
    params = [*xb.values(), h0]

    def grads(state_prec: str) -> list[torch.Tensor]:
        monkeypatch.setitem(kda_mod.TUNING, "state_prec", state_prec)
        out, final = chunk_kda_fused(*(xb[n] for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias")),
                                     initial_state=h0, output_final_state=True)
        gen = torch.Generator().manual_seed(5)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum() + (final * torch.randn(final.shape,
                                                                                               generator=gen)).sum()
        return [g.float() for g in torch.autograd.grad(loss, params)]

    exact = grads("tf32")
    names = [*xb, "h0"]
    plain = {n: rel(g, e) for n, g, e in zip(names, grads("bf16"), exact)}
    split = {n: rel(g, e) for n, g, e in zip(names, grads("bf16x2"), exact)}
    assert max(plain.values()) > 1e-3, plain  # bf16 state products do lose precision here
    assert max(split.values()) < max(plain.values()) / 10, (split, plain)


def test_backend_signature_with_given_gate_and_unequal_dims():
    """chunk_kda_triton takes normalised q/k, a precomputed bounded g and beta (K=16 != V=32)."""
    gen = torch.Generator().manual_seed(3)
    shape = (1, 90, 2, 16)
    q = l2norm(torch.randn(shape, generator=gen, dtype=F64)).float().to(DEVICE).requires_grad_()
    k = l2norm(torch.randn(shape, generator=gen, dtype=F64)).float().to(DEVICE).requires_grad_()
    v = torch.randn(1, 90, 2, 32, generator=gen).to(DEVICE).requires_grad_()
    g = kda_gate(3 * torch.randn(shape, generator=gen), torch.zeros(2)).to(DEVICE).requires_grad_()
    beta = torch.rand(1, 90, 2, generator=gen).to(DEVICE).requires_grad_()
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    out, final = chunk_kda_triton(q, k, v, g, beta, scale=0.3, output_final_state=True)
    d = {n: t.double() for n, t in x.items()}
    ref = chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.3, output_final_state=True, backend="torch")
    assert_matches(x, None, out, final, *ref)


def test_backend_signature_trusts_the_given_gate_floor(monkeypatch):
    """With ``gate_lower_bound`` the bounded-gate check does not read g (no g.min(): on a GPU that
    waits for all queued work); without it, it does. Packed documents come as host boundaries."""
    gen = torch.Generator().manual_seed(4)
    shape = (1, 80, 1, 16)
    q, k = (l2norm(torch.randn(shape, generator=gen)).to(DEVICE) for _ in range(2))
    v = torch.randn(shape, generator=gen).to(DEVICE)
    g = kda_gate(torch.randn(shape, generator=gen), torch.zeros(1)).to(DEVICE)
    beta = torch.rand(1, 80, 1, generator=gen).to(DEVICE)
    reads = []
    amin = torch.amin
    monkeypatch.setattr(torch.Tensor, "min", lambda self, *a: reads.append(1) or amin(self))
    trusted, _ = chunk_kda_triton(q, k, v, g, beta, seq_bounds=(0, 30, 80), gate_lower_bound=-5.0)
    assert not reads
    checked, _ = chunk_kda_triton(q, k, v, g, beta, seq_bounds=(0, 30, 80))
    assert reads and torch.equal(trusted, checked)
    ref, _ = chunk_kda(*(t.double() for t in (q, k, v, g, beta)), docs=torch.tensor([0, 30, 80]), backend="torch")
    assert rel(trusted, ref) < TOL


def test_plan_splits_documents_into_chunks_and_segments():
    plan = build_plan([3, 130, 64], torch.device("cpu"), segment_chunks=2)
    assert plan.chunk_bos.tolist() == [0, 3, 67, 131, 133]
    assert plan.chunk_eos.tolist() == [3, 67, 131, 133, 197]
    assert plan.seg_chunk0.tolist() == [0, 1, 3, 4] and plan.seg_nchunks.tolist() == [1, 2, 1, 1]
    assert plan.seg_bos.tolist() == [0, 3, 131, 133] and plan.seg_eos.tolist() == [3, 133, 133, 197]
    assert plan.seq_seg0.tolist() == [0, 1, 3] and plan.seq_nseg.tolist() == [1, 2, 1]
    assert plan.segmented
    # launch orders: longest first; pass 1 only over split documents; the partial backward pass only
    # over segments after a document's first
    assert plan.seg_order.tolist() == [1, 0, 2, 3]
    assert plan.split_order.tolist() == [1, 2] and plan.later_order.tolist() == [2]
    # the composition's [J, N] grid: step j holds every document's segment j, or the identity (4) past its last
    assert plan.compose_steps == 2 and plan.compose_index.tolist() == [0, 1, 3, 4, 2, 4]
    assert plan.compose_slot.tolist() == [0, 1, 4, 2]
    assert plan.last_seg.tolist() == [0, 2, 3] and plan.first_seg.tolist() == [0, 1, 3]


def test_plan_tables_start_16_byte_aligned_for_any_document_lengths():
    # Triton compiles a kernel again for each new pattern of 16-byte-aligned pointers: tables packed
    # end to end made every new batch layout recompile the state kernels on the GPU
    from dataclasses import fields

    for lengths in ([3, 130, 64], [1], [5, 7, 9, 200, 64, 1, 33], [8192], [100] * 13):
        for segment_chunks in (None, 2):
            plan = build_plan(lengths, torch.device("cpu"), segment_chunks)
            tables = [getattr(plan, f.name) for f in fields(plan) if isinstance(getattr(plan, f.name), torch.Tensor)]
            assert len(tables) >= 13
            for table in tables:
                assert table.data_ptr() % 16 == 0, (lengths, segment_chunks)


def test_upload_tables_keeps_values_and_lengths():
    from moe_lc_kernels.transfer import upload_tables

    tables = [[1, 2, 3], [], [4], list(range(9)), torch.tensor([7, 8])]
    for dtype in (torch.int32, torch.long):
        out = upload_tables(tables, dtype, torch.device("cpu"))
        assert [t.tolist() for t in out] == [list(map(int, t)) for t in tables]
        assert all(t.dtype == dtype and t.data_ptr() % 16 == 0 for t in out)


def test_plans_are_cached_per_lengths_and_bounded(monkeypatch):
    from moe_lc_kernels import kda as kda_mod

    monkeypatch.setattr(kda_mod, "_PLANS", {})
    cpu = torch.device("cpu")
    first = kda_mod.cached_plan([3, 130], cpu, 2)
    assert kda_mod.cached_plan([3, 130], cpu, 2) is first
    other = kda_mod.cached_plan([3, 130], cpu, None)
    assert other is not first and not other.segmented and first.segmented
    assert other.chunk_eos.tolist() == build_plan([3, 130], cpu, None).chunk_eos.tolist()
    for n in range(kda_mod._PLAN_CACHE_SIZE + 5):
        kda_mod.cached_plan([n + 1], cpu, None)
    assert len(kda_mod._PLANS) == kda_mod._PLAN_CACHE_SIZE
    assert (tuple([3, 130]), "cpu", 2) not in kda_mod._PLANS  # the least recently used went first


def test_clear_errors():
    x, _ = raw_inputs(1, 20, 1, 16, 16)
    args = [x[n] for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias")]
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda_fused(*args, lower_bound=None)
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda_fused(x["q"][..., :12], x["k"][..., :12], x["v"], x["z"][..., :12], x["beta"], x["A_log"])
    with pytest.raises(TypeError, match="float64"):
        chunk_kda_fused(*(t.double() for t in args))
    with pytest.raises(ValueError, match="seq_bounds must rise strictly from 0 to T=20"):
        chunk_kda_fused(*args, seq_bounds=[0, 5, 19])
    g = kda_gate(torch.full((1, 20, 1, 16), 5.0), torch.full((1,), 3.0), lower_bound=None)  # softplus: unbounded
    with pytest.raises(ValueError, match="bounded gate"):
        chunk_kda_triton(x["q"], x["k"], x["v"], g.to(DEVICE), torch.sigmoid(x["beta"]))
    from moe_lc_kernels.kda import parse_tuning

    assert parse_tuning("bwd_prec=tf32x3,kside_warps=8") == {"bwd_prec": "tf32x3", "kside_warps": 8}
    with pytest.raises(ValueError, match="score_prec"):  # the message lists the known keys
        parse_tuning("intra_prec=tf32")
    with pytest.raises(ValueError, match="save_prep is one of"):
        parse_tuning("save_prep=1")


def test_kernels_import_nothing_from_moe_lc():
    """The kernels package stands alone: the framework's ops call it, never the reverse (a cycle
    once hid there)."""
    code = ("import sys; import moe_lc_kernels.kda, moe_lc_kernels.kda_triton, moe_lc_kernels.short_conv, "
            "moe_lc_kernels.short_conv_triton, moe_lc_kernels.transfer; "
            "found = sorted(m for m in sys.modules if m == 'moe_lc' or m.startswith('moe_lc.')); "
            "assert not found, f'moe_lc_kernels imported {found}'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_needs_neither_gpu_nor_triton():
    code = ("import sys; import moe_lc_kernels, moe_lc.ops.kda; "
            "assert 'triton' not in sys.modules, 'importing moe_lc_kernels must not import triton'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
