"""The whole tiny model against a float64 re-implementation of its forward from the formulas
(tests/reference_math.py) with the model's own weights: logits, LM loss, MTP loss and the gradient
of the objective with respect to every parameter. Also the loss conventions (token-weighted mean,
IGNORE_INDEX, the chunked loss) and the initialisation's statistics."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import configs
import reference_math as ref
from moe_lc.model.init import build_model
from moe_lc.model.moe import LatentMoE, RoutedExperts
from moe_lc.model.transformer import IGNORE_INDEX
from moe_lc.presets import get_preset
from packed import packed
from reference_checks import FLOAT64_RTOL, assert_matches, randomize, rel

VOCAB = 500  # padded to 512 rows: the padding rows must never be scored


def tiny(**overrides):
    """The tiny preset with a padded vocabulary and the MTP layer."""
    return configs.tiny(**{"vocab_size": VOCAB, "mtp": True, **overrides})


def reference_model(cfg, seed=0):
    return randomize(build_model(cfg, seed=seed).double(), seed=seed + 1).eval()


def packed_documents(seed: int):
    """One row of five documents: ends with an EOD-like token (no target after it), a document cut by
    the row end (its last label continues it), a one-token document, and a padding tail with no
    targets at all (long enough to fill whole loss chunks)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 12, 5, 11]
    ids, labels = [], []
    for n, kind in zip(lengths, ["eod", "eod", "cut", "eod", "padding"]):
        doc = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        ids.append(doc[:n])
        lab = doc[1:].clone()
        if kind == "eod":
            lab[-1] = IGNORE_INDEX
        elif kind == "padding":
            lab[:] = IGNORE_INDEX
        labels.append(lab)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return torch.cat(ids)[None], torch.cat(labels)[None], cu


def unpacked_rows(seed: int):
    """Two rows of one document each; the second has an untargeted tail, so the rows carry different
    numbers of label tokens (a mean of row means would weigh them wrongly)."""
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (2, 13), generator=gen)
    ids, labels = stream[:, :-1], stream[:, 1:].clone()
    labels[1, 4:] = IGNORE_INDEX
    return ids, labels, None


def reference_rows(ids, labels, bounds):
    return [(ids[0], labels[0], bounds)] if bounds is not None else [(ids[b], labels[b], None) for b in range(len(ids))]


def cu_tensor(bounds):
    return None if bounds is None else torch.tensor(bounds, dtype=torch.int32)


def check_model(model, ids, labels, bounds, **forward):
    """Logits (when returned), LM and MTP losses, and the gradient of the loss, against the reference."""
    rows = reference_rows(ids, labels, bounds)
    want = ref.model_losses(model, rows)
    out = model(ids, labels, **packed(cu_tensor(bounds)), **forward)
    for key in ("lm_loss", "mtp_loss", "loss"):
        if key in want:
            assert rel(getattr(out, key), want[key]) < FLOAT64_RTOL, key
    if out.logits is not None:
        want_logits = torch.stack([ref.logits(model, ref.hidden_states(model, r[0], r[2])) for r in rows])
        assert out.logits.shape[-1] == VOCAB and rel(out.logits.reshape(want_logits.shape), want_logits) < FLOAT64_RTOL
    params = dict(model.named_parameters())
    assert_matches(lambda: model(ids, labels, **packed(cu_tensor(bounds)), **forward).loss,
                   lambda: ref.model_losses(model, rows)["loss"], params)


@pytest.mark.parametrize("mode", ["block", "full", "none"])
def test_model_matches_reference_on_packed_documents(mode):
    model = reference_model(tiny(**{"attn_res.mode": mode}))
    biases = [m.balancer.bias for m in model.moe_layers()]
    assert all(b.abs().min() > 0 for b in biases) and len(biases) == 5  # 4 trunk MoE layers + the MTP's
    check_model(model, *packed_documents(seed=2))


def test_model_matches_reference_on_separate_rows_with_two_dense_layers():
    model = reference_model(tiny(**{"moe.first_dense_layers": 2, "attn_res.block_size": 3}))
    check_model(model, *unpacked_rows(seed=3))


def test_chunked_loss_matches_reference():
    """Chunks of 4 tokens over a row whose padding tail fills whole chunks without a target."""
    model = reference_model(tiny())
    model.loss_chunk_elements = 4 * model.cfg.padded_vocab_size
    check_model(model, *packed_documents(seed=4), return_logits=False)


def test_mtp_targets_are_two_tokens_ahead_inside_documents():
    """A hand-worked row: documents [10 11 12 | 20 21], the first ends with an untargeted token."""
    labels = torch.tensor([11, 12, IGNORE_INDEX, 21, 22])
    assert ref.mtp_targets(labels, [0, 3, 5]).tolist() == [12, IGNORE_INDEX, IGNORE_INDEX, 22, IGNORE_INDEX]


def test_mtp_loss_predicts_the_token_two_ahead_from_the_next_embedding():
    """The MTP head, run by hand: input h_t and embed(token t+1), target token t+2, weight 0.1."""
    model = reference_model(tiny())
    stream = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    ids, labels = stream[:, :-1], stream[:, 1:]  # every position targeted
    out = model(ids, labels)
    h = model.hidden_states(ids)
    mtp_logits = model.logits_from_hidden(model.mtp(h, model.embed(stream[:, 1:]), None))
    logp = torch.log_softmax(mtp_logits[:, :-1], -1)
    want = -logp.gather(-1, stream[:, 2:, None]).mean()
    assert rel(out.mtp_loss, want) < FLOAT64_RTOL
    assert rel(out.loss, out.lm_loss + ref.MTP_WEIGHT * want) < FLOAT64_RTOL


def test_lm_loss_is_a_token_weighted_mean_that_skips_ignored_positions():
    model = reference_model(tiny(mtp=False))
    ids, labels, _ = unpacked_rows(seed=6)
    logp = torch.log_softmax(model(ids).logits, -1)
    valid = labels != IGNORE_INDEX
    want = -logp[valid].gather(-1, labels[valid][:, None]).sum() / valid.sum()
    assert rel(model(ids, labels).lm_loss, want) < FLOAT64_RTOL
    assert int(valid[0].sum()) != int(valid[1].sum())  # a mean of row means would differ


# ----------------------------------------------------------------------------- initialisation
def test_initialisation_statistics():
    """Projections ~ N(0, 0.02), output projections ~ N(0, 0.02 / sqrt(2 L)), norms one, pseudo-queries and
    A zero. A sample std of n draws is within 6 / sqrt(2 n) of sigma (relative) and a sample mean within
    6 sigma / sqrt(n), except with probability ~1e-9."""
    cfg = get_preset("tiny")
    model = build_model(cfg, seed=0)
    groups = {"projection": [], "output": []}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Linear, nn.Embedding)):
            groups["output" if leaf in ("o_proj", "w_out", "latent_up") else "projection"].append(module.weight)
        elif isinstance(module, RoutedExperts):
            groups["projection"] += [module.w_gate, module.w_in]
            groups["output"].append(module.w_out)
    std = {"projection": 0.02, "output": 0.02 / math.sqrt(2 * cfg.num_layers)}
    for group, tensors in groups.items():
        values = torch.cat([t.detach().flatten() for t in tensors]).double()
        n, sigma = values.numel(), std[group]
        assert abs(values.std().item() / sigma - 1) < 6 / math.sqrt(2 * n), group
        assert abs(values.mean().item()) < 6 * sigma / math.sqrt(n), group
    assert len(groups["output"]) == 5 * 2 + 4 * 2  # o_proj and w_out per layer, latent_up and experts' w_out per MoE
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        if name.endswith(("query", "A_log")):
            assert torch.all(p == 0), name
    assert all(torch.all(m.balancer.bias == 0) for m in model.modules() if isinstance(m, LatentMoE))
