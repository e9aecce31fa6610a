"""The fused LM-head cross-entropy (moe_lc.ops.linear_cross_entropy): its loss and gradients against
the formula in float64, the model's fused loss against its checkpointed chunks, autocast, the
loss-only forward without gradients, and which path the model takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import configs
import moe_lc.model.transformer as transformer
import moe_lc.ops.linear_cross_entropy as lce
from moe_lc.metrics.breakdown import component_ranges
from moe_lc.model.init import build_model
from moe_lc.model.transformer import IGNORE_INDEX
from moe_lc.ops.linear_cross_entropy import chunk_loss, chunk_loss_and_grad, linear_cross_entropy, resolve_backend
from moe_lc_kernels import cross_entropy as triton_ce
from reference_checks import FLOAT64_RTOL, randomize, rel

BF16_RTOL = 1e-2  # docs/testing.md, Tolerances: bf16 against a reference
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: the interpreter on a CPU (conftest)
VOCAB = 500  # the tiny model's head padded to 512 rows: the padding must take no part


def formula_loss(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean over labelled tokens of log sum_v exp(z_v) - z_y, z = h W_v^T, the log-sum-exp written out."""
    z = h @ w[:vocab_size].t()
    peak = z.max(dim=-1, keepdim=True).values.detach()
    lse = (peak + (z - peak).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    valid = labels != IGNORE_INDEX
    picked = z[valid, labels[valid]]
    return (lse[valid] - picked).sum() / valid.sum()


def head_case(seed: int = 0, tokens: int = 37, d: int = 16, rows: int = 40, vocab: int = 33):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, d, generator=g, dtype=torch.float64).requires_grad_()
    w = (torch.randn(rows, d, generator=g, dtype=torch.float64) / d**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < 0.3] = IGNORE_INDEX
    labels[:3] = IGNORE_INDEX
    return h, w, labels


def test_float64_loss_and_gradients_match_the_formula():
    """Chunks of 8 over 37 tokens (a partial last chunk), ignored labels, a head of 40 rows of which 33 are
    the vocabulary: loss, dL/dh and dL/dW against the formula; the 7 padding rows get exactly zero."""
    h, w, labels = head_case()
    want = formula_loss(h, w, labels, 33)
    want_h, want_w = torch.autograd.grad(want, (h, w))
    got = linear_cross_entropy(h, w, labels, vocab_size=33, chunk_tokens=8, backend="torch")
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float64
    assert rel(got, want) < FLOAT64_RTOL
    assert rel(got_h, want_h) < FLOAT64_RTOL and rel(got_w, want_w) < FLOAT64_RTOL
    assert torch.equal(got_w[33:], torch.zeros_like(got_w[33:]))
    assert torch.equal(got_h[:3], torch.zeros_like(got_h[:3]))  # ignored tokens: no gradient
    frozen_h = h.detach()  # only W wants a gradient: dh is not computed
    weight_only, = torch.autograd.grad(linear_cross_entropy(frozen_h, w, labels, 33, chunk_tokens=8), (w,))
    assert rel(weight_only, want_w) < FLOAT64_RTOL


def test_sum_reduction_scales_the_gradients_by_the_incoming_gradient():
    """reduction="sum" over [2, T, d] inputs, its backward from a gradient of 0.37 (as the MTP weight or a
    micro-batch's share would give): n_valid x the mean and 0.37 n_valid x its gradients."""
    h, w, labels = head_case(seed=1, tokens=24)
    n = int((labels != IGNORE_INDEX).sum())
    want = formula_loss(h, w, labels, 33) * n
    want_h, want_w = torch.autograd.grad(0.37 * want, (h, w))
    got = linear_cross_entropy(h.view(2, 12, -1), w, labels.view(2, 12), 33, chunk_tokens=5, reduction="sum",
                               backend="torch")
    got_h, got_w = torch.autograd.grad(0.37 * got, (h, w))
    assert rel(got, want) < FLOAT64_RTOL
    assert rel(got_h, want_h) < FLOAT64_RTOL and rel(got_w, want_w) < FLOAT64_RTOL


def test_the_backward_can_run_again_for_each_input_apart():
    """A pipeline's split backward (zero-bubble schedules) asks this node for the input's gradient, then
    again (retain_graph) for the weight's: the kept dh and dW must serve both unchanged."""
    h, w, labels = head_case(seed=2)
    loss = 0.37 * linear_cross_entropy(h, w, labels, 33, chunk_tokens=8, backend="torch")
    want_h, want_w = torch.autograd.grad(loss, (h, w), retain_graph=True)
    got_h, = torch.autograd.grad(loss, (h,), retain_graph=True)
    got_w, = torch.autograd.grad(loss, (w,))
    assert torch.equal(got_h, want_h) and torch.equal(got_w, want_w)


def models(cfg, fused: tuple[bool, ...] = (True, False), chunk_tokens: int = 7, dtype=torch.float64):
    """The same randomised model once per path, with loss chunks of ``chunk_tokens`` tokens."""
    built = []
    for f in fused:
        model = randomize(build_model(cfg, seed=0).to(dtype), seed=1)
        model.fused_loss = f
        model.loss_chunk_elements = chunk_tokens * cfg.padded_vocab_size
        built.append(model)
    return built


def row(cfg, tokens: int = 40, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, tokens // 2), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, tokens // 2), generator=g)
    labels[0, 2:11] = IGNORE_INDEX  # a whole chunk without a target among others
    labels[1, -3:] = IGNORE_INDEX
    return ids, labels


def losses_and_gradients(model, ids, labels):
    out = model(ids, labels, return_logits=False)
    out.loss.backward()
    terms = {k: getattr(out, k).detach() for k in ("loss", "lm_loss", "mtp_loss") if getattr(out, k) is not None}
    return terms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mtp", [False, True])
def test_model_fused_loss_equals_the_checkpointed_chunks_in_float64(mtp):
    """40 tokens in chunks of 7 (a partial last one), a padded head: every loss term and every parameter's
    gradient of the fused path equal the checkpointed chunks' (MTP through the same head when on)."""
    cfg = configs.tiny(vocab_size=VOCAB, mtp=mtp)
    ids, labels = row(cfg)
    (terms, grads), (want_terms, want_grads) = [losses_and_gradients(m, ids, labels) for m in models(cfg)]
    assert terms.keys() == want_terms.keys() and ("mtp_loss" in terms) == mtp
    for k in terms:
        assert rel(terms[k], want_terms[k]) < FLOAT64_RTOL, k
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert rel(grads[name], want_grads[name]) < FLOAT64_RTOL, name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the GEMM that adds into an fp32 dW)"))])
def test_bf16_autocast_loss_and_gradients_are_within_bf16_precision_of_the_formula(device):
    """fp32 h and W under CPU bf16 autocast against the float64 formula: the GEMMs take h and W rounded to
    bf16 (2^-9 relative), the logits and their gradients are rounded again, the cross-entropy is fp32; a
    few dozen such roundings in quadrature stay within docs/testing.md's 1e-2 for bf16 against a
    reference (measured ~5e-3 for the gradients, as F.linear + F.cross_entropy under autocast give),
    while a wrong formula (a scored ignored label, a padding row in the softmax, a missing 1/n) moves
    them by O(1)."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(300, 64, generator=g)
    w = 3 * torch.randn(512, 64, generator=g) / 8
    labels = torch.randint(0, VOCAB, (300,), generator=g)
    labels[::5] = IGNORE_INDEX
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    want = formula_loss(h64, w64, labels, VOCAB)
    want_h, want_w = torch.autograd.grad(want, (h64, w64))
    h32, w32 = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        got = linear_cross_entropy(h32, w32, labels.to(device), VOCAB, chunk_tokens=64, backend="torch")
    got_h, got_w = torch.autograd.grad(got, (h32, w32))
    assert got.dtype == got_h.dtype == got_w.dtype == torch.float32
    got, got_h, got_w = got.cpu(), got_h.cpu(), got_w.cpu()
    assert rel(got, want) < BF16_RTOL and rel(got_h, want_h) < BF16_RTOL and rel(got_w, want_w) < BF16_RTOL
    assert torch.equal(got_w[VOCAB:], torch.zeros_like(got_w[VOCAB:]))


def test_bf16_autocast_model_fused_loss_is_within_bf16_precision_of_the_checkpointed_chunks():
    """The model (fp32 weights) under CPU bf16 autocast, both paths. The forward up to the loss is the
    same (so is the routing); the losses are the same fp32 cross-entropy of the same bf16 logits. The
    gradients the loss hands back (the head's weight; the final norms', which see dh directly) differ
    by the two paths' bf16 roundings of the logit gradients and GEMM outputs, each 2^-9 relative: within
    the 1e-2 of docs/testing.md's bf16 row. Deeper parameters are left out: the layers' bf16 backward
    amplifies any difference in dh (up to ~0.8% at the default initialisation, far more in the
    randomised model), which says nothing about the loss."""
    cfg = configs.tiny(vocab_size=VOCAB, mtp=True)
    ids, labels = row(cfg, seed=5)
    results = []
    for model in models(cfg, dtype=torch.float32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(losses_and_gradients(model, ids, labels))
    (terms, grads), (want_terms, want_grads) = results
    assert terms.keys() == want_terms.keys() == {"loss", "lm_loss", "mtp_loss"}
    for k in terms:
        assert rel(terms[k], want_terms[k]) < BF16_RTOL, k
    for name in ("lm_head.weight", "final_norm.weight", "mtp.final_norm.weight"):
        assert grads[name].dtype == torch.float32
        assert rel(grads[name], want_grads[name]) < BF16_RTOL, name


def test_under_autocast_the_chunk_logits_are_those_of_an_autocast_linear(monkeypatch):
    """The kernel sees bf16 logits equal to F.linear's under autocast (the same bf16 operands and GEMM)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 33, (12,), generator=g)
    seen = []

    def recorded(z, y, grad_dtype):
        seen.append((z, grad_dtype))
        return chunk_loss_and_grad(z, y, grad_dtype)

    monkeypatch.setattr(lce, "chunk_loss_and_grad", recorded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_cross_entropy(h, w, labels, 33, chunk_tokens=12, backend="torch").backward()
        want = nn.functional.linear(h, w)[:, :33]
    (logits, grad_dtype), = seen
    assert logits.dtype == grad_dtype == want.dtype == torch.bfloat16
    assert torch.equal(logits, want)
    assert h.grad.dtype == w.grad.dtype == torch.float32


def test_without_gradients_the_loss_is_computed_alone(monkeypatch):
    """no_grad (evaluation), or nothing requiring a gradient: the same loss, no autograd node, and the
    gradient kernel (and with it the dh and dW buffers) never runs."""
    cfg = configs.tiny(vocab_size=VOCAB, mtp=True)
    ids, labels = row(cfg)
    model, = models(cfg, fused=(True,))
    model.eval()
    want = model(ids, labels, return_logits=False)
    calls = {"loss": 0, "grad": 0}

    def count(key, fn):
        def counted(*args):
            calls[key] += 1
            return fn(*args)
        return counted

    monkeypatch.setattr(lce, "chunk_loss", count("loss", chunk_loss))
    monkeypatch.setattr(lce, "chunk_loss_and_grad", count("grad", chunk_loss_and_grad))
    with torch.no_grad():
        out = model(ids, labels, return_logits=False)
    model.requires_grad_(False)
    frozen = model(ids, labels, return_logits=False)
    for got in (out, frozen):
        assert got.loss.grad_fn is None and got.lm_loss.grad_fn is None
        assert rel(got.loss, want.loss) < FLOAT64_RTOL and rel(got.mtp_loss, want.mtp_loss) < FLOAT64_RTOL
    assert calls == {"loss": 2 * 2 * 6, "grad": 0}  # two runs x (LM + MTP) x 6 chunks of 7 over 40 tokens


class RecordingLoss:
    """A loss object in the model's place, as tensor parallelism's VocabParallelLoss is."""

    def __init__(self) -> None:
        self.inputs: list[type] = []

    def __call__(self, logits, labels):
        self.inputs.append(type(logits))
        return transformer.language_model_loss(logits, labels)


class Float8LikeLinear(nn.Linear):
    """A subclass of nn.Linear, as torchao's Float8Linear is: the fused path must not read its weight."""


def record_paths(monkeypatch):
    calls = {"fused": 0, "checkpointed": 0}

    def fused(*args, **kwargs):
        calls["fused"] += 1
        return lce.linear_cross_entropy(*args, **kwargs)

    def checkpointed(*args, **kwargs):
        calls["checkpointed"] += 1
        return torch_checkpoint(*args, **kwargs)

    torch_checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(transformer, "linear_cross_entropy", fused)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", checkpointed)
    return calls


def test_dispatch_plain_head_takes_the_fused_path_and_a_swapped_loss_or_head_the_checkpointed_one(monkeypatch):
    cfg = configs.tiny(vocab_size=VOCAB, mtp=True)
    ids, labels = row(cfg)
    plain, tp_like, float8_like, chosen_off = models(cfg, fused=(True, True, True, False))
    tp_like.lm_loss = RecordingLoss()
    float8_like.lm_head.__class__ = Float8LikeLinear
    expected = {
        "plain": (plain, {"fused": 2, "checkpointed": 0}),  # LM and MTP, through the model's own lm_loss
        "tp-swapped loss": (tp_like, {"fused": 0, "checkpointed": 6}),  # 6 chunks of the LM loss; MTP unchunked
        "float8-like head": (float8_like, {"fused": 0, "checkpointed": 6}),
        "fused_loss=False": (chosen_off, {"fused": 0, "checkpointed": 6}),
    }
    for what, (model, want) in expected.items():
        calls = record_paths(monkeypatch)
        model(ids, labels, return_logits=False).loss.backward()
        assert calls == want, what
        monkeypatch.undo()
    assert set(tp_like.lm_loss.inputs) == {torch.Tensor}  # it was given logits, never HeadLogits


def test_the_profiler_wrapper_keeps_the_fused_path_inside_the_loss_range(monkeypatch):
    """moe_lc.metrics.breakdown wraps lm_loss to open moe_lc::loss: the fused loss still runs, inside it
    (its logsumexp, which the checkpointed path does not call, lies in a loss range every time)."""
    cfg = configs.tiny(vocab_size=VOCAB, mtp=True)
    ids, labels = row(cfg)
    model, = models(cfg, fused=(True,))
    calls = record_paths(monkeypatch)
    with profile(activities=[ProfilerActivity.CPU]) as prof, component_ranges(model):
        model(ids, labels, return_logits=False).loss.backward()
    assert calls == {"fused": 2, "checkpointed": 0}
    events = prof.events()
    ranges = [e.time_range for e in events if e.name == "moe_lc::loss"]
    lse = [e.time_range for e in events if e.name == "aten::logsumexp"]
    assert len(lse) >= 2 * 6  # LM and MTP, 6 chunks each (the profiler may list an op's overload too)
    assert all(any(r.start <= t.start and t.end <= r.end for r in ranges) for t in lse)


def test_backend_choice():
    assert resolve_backend(torch.device("cpu")) == "torch"
    if torch.cuda.is_available():  # "auto" takes Triton where it runs on CUDA
        assert resolve_backend(torch.device("cuda")) == "triton"
    assert resolve_backend(torch.device("cuda"), "torch") == "torch"
    assert resolve_backend(torch.device("cpu"), "compiled") == "compiled"
    assert resolve_backend(torch.device(DEVICE), "triton") == "triton"  # on a CPU, Triton's interpreter (conftest)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend(torch.device("cpu"), "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_chunk_kernel_matches_the_eager_reference_on_cuda():
    """The compiled elementwise part against the eager one on bf16 logits: the same fp32 math in
    another order (losses to fp32 rounding, 1e-5), gradients to one bf16 rounding (2^-8 of each element)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(300, 1000, device="cuda", generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (300,), device="cuda", generator=g)
    labels[::7] = IGNORE_INDEX
    want_loss, want_grad = chunk_loss_and_grad(logits, labels, torch.bfloat16)
    got_loss, got_grad = lce._compiled(chunk_loss_and_grad)(logits, labels, torch.bfloat16)
    assert rel(got_loss, want_loss) < 1e-5
    assert got_grad.dtype == torch.bfloat16
    assert ((got_grad.float() - want_grad.float()).abs() <= 2**-8 * want_grad.float().abs() + 1e-6).all()
    assert rel(lce._compiled(chunk_loss)(logits, labels), chunk_loss(logits, labels)) < 1e-5


def rows_formula(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [n], gradient [n, V]) in float64 from the formula: logsumexp - z[y]; softmax - onehot(y);
    zero rows where the label is ignored."""
    z, labels = logits.cpu().double(), labels.cpu()
    peak = z.max(dim=-1, keepdim=True).values
    lse = peak + (z - peak).exp().sum(-1, keepdim=True).log()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    loss = torch.where(valid, (lse - z.gather(-1, target[:, None])).squeeze(-1), 0.0)
    grad = (z - lse).exp() - torch.nn.functional.one_hot(target, z.shape[-1]).double()
    return loss, torch.where(valid[:, None], grad, 0.0)


def rising_and_falling_rows(n: int = 24, vocab: int = 1000, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose row maximum sits in the first block, in the last, or moves up block by block (so the
    online sum is rescaled), with magnitudes where exp overflows fp32 without the shift; labels with
    ignored rows and one label at each end of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(vocab, dtype=torch.float32)
    ramp = torch.stack([cols / vocab * 120.0, (vocab - cols) / vocab * 120.0, torch.zeros(vocab)])
    logits = 3 * torch.randn(n, vocab, generator=g) + ramp[torch.arange(n) % 3] + 40.0
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    labels[1], labels[2] = 0, vocab - 1
    return logits.to(DEVICE), labels.to(DEVICE)


@pytest.mark.parametrize("block", [256, 4096])  # four blocks with a partial last one; one block, masked
def test_triton_rows_match_the_float64_formula_in_fp32(monkeypatch, block):
    """fp32 logits: the online logsumexp in fp32 over blocks gives the formula's loss and gradient to
    fp32 rounding (a few ulps of lse ~ 160; the gradients' sum of exp to 1e-6 relative). A gradient
    that kept the label's 1, a lane rescaled wrongly, or the padding columns in the sum move them by
    O(1e-2) or more."""
    monkeypatch.setitem(triton_ce.TUNING, "block", block)
    logits, labels = rising_and_falling_rows()
    want_loss, want_grad = rows_formula(logits, labels)
    loss, grad = triton_ce.cross_entropy_rows(logits.clone(), labels, IGNORE_INDEX, torch.float32)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    loss, grad = loss.cpu(), grad.cpu()
    assert (loss.double() - want_loss).abs().max() < 1e-5 * want_loss.abs().max()
    assert (grad.double() - want_grad).abs().max() < 1e-5
    ignored = labels.cpu() == IGNORE_INDEX
    assert torch.equal(loss[ignored], torch.zeros_like(loss[ignored]))
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    loss_only, none = triton_ce.cross_entropy_rows(logits, labels, IGNORE_INDEX)
    assert none is None and torch.equal(loss_only.cpu(), loss)


def test_triton_rows_write_the_bf16_gradient_over_the_logits_within_one_rounding(monkeypatch):
    """bf16 logits: the gradient overwrites them (the same storage) and is the float64 gradient of those
    bf16 logits rounded once to bf16: half an ulp (2^-8 of each element) on a GPU, a whole ulp (2^-7)
    in Triton's interpreter, which truncates fp32 to bf16; 1e-6 absolute where it underflows. The
    loss is fp32."""
    monkeypatch.setitem(triton_ce.TUNING, "block", 256)
    logits, labels = rising_and_falling_rows(seed=5)
    logits = logits.to(torch.bfloat16)
    want_loss, want_grad = rows_formula(logits, labels)
    buffer = logits.clone()
    loss, grad = triton_ce.cross_entropy_rows(buffer, labels, IGNORE_INDEX, torch.bfloat16)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == torch.bfloat16
    assert (loss.cpu().double() - want_loss).abs().max() < 1e-5 * want_loss.abs().max()
    assert ((grad.cpu().double() - want_grad).abs() <= 2**-7 * want_grad.abs() + 1e-6).all()
    into_fp32 = triton_ce.cross_entropy_rows(logits, labels, IGNORE_INDEX, torch.float32)[1]
    assert into_fp32.dtype == torch.float32 and (into_fp32.cpu().double() - want_grad).abs().max() < 1e-5


def test_triton_rows_give_nan_for_a_label_outside_the_vocabulary():
    """A label outside [0, V) that is not IGNORE cannot be scored: NaN, which the trainer stops on,
    rather than a finite loss that trains on the wrong token."""
    logits, labels = rising_and_falling_rows(n=6, vocab=50)
    labels[3], labels[4] = 50, -7
    loss = triton_ce.cross_entropy_rows(logits, labels, IGNORE_INDEX, torch.float32)[0].cpu()
    assert loss[3].isnan() and loss[4].isnan()
    assert loss[[0, 1, 2, 5]].isfinite().all()


def test_triton_backend_loss_and_gradients_match_the_reference_backend():
    """The whole fused op on the triton backend (Triton's interpreter) against the torch one in fp32:
    37 tokens in chunks of 8 (a partial last chunk), ignored labels, a padded head. The same fp32 math
    in another order: 1e-5."""
    h, w, labels = head_case(seed=4)
    h32, w32 = h.detach().float().to(DEVICE).requires_grad_(), w.detach().float().to(DEVICE).requires_grad_()
    labels = labels.to(DEVICE)
    want = linear_cross_entropy(h32, w32, labels, vocab_size=33, chunk_tokens=8, backend="torch")
    want_h, want_w = torch.autograd.grad(want, (h32, w32))
    got = linear_cross_entropy(h32, w32, labels, vocab_size=33, chunk_tokens=8, backend="triton")
    got_h, got_w = torch.autograd.grad(got, (h32, w32))
    assert rel(got, want) < 1e-5 and rel(got_h, want_h) < 1e-5 and rel(got_w, want_w) < 1e-5
    assert torch.equal(got_w[33:], torch.zeros_like(got_w[33:]))
    with torch.no_grad():
        assert rel(linear_cross_entropy(h32, w32, labels, 33, chunk_tokens=8, backend="triton"), want) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_chunk_kernel_matches_the_eager_reference_on_cuda():
    """The Triton elementwise part compiled for the GPU against the eager one on bf16 logits of
    k3-small's vocabulary (16 blocks a row): losses to fp32 rounding (1e-5), gradients to one bf16
    rounding each side (2^-7 of each element, 1e-6 absolute where they underflow)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(300, 65536, device="cuda", generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 65536, (300,), device="cuda", generator=g)
    labels[::7] = IGNORE_INDEX
    want_loss, want_grad = chunk_loss_and_grad(logits, labels, torch.bfloat16)
    got_loss, got_grad = lce._triton_loss_and_grad(logits.clone(), labels, torch.bfloat16)
    assert rel(got_loss, want_loss) < 1e-5
    assert ((got_grad.float() - want_grad.float()).abs() <= 2**-7 * want_grad.float().abs() + 1e-6).all()
    assert rel(lce._triton_loss(logits, labels), chunk_loss(logits, labels)) < 1e-5
