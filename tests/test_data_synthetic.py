"""Synthetic long-range tasks: answers are where reported, recoverable from the context, deterministic."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from moe_lc.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    PackedDataset,
    answer_batch,
    associative_recall_document,
    passkey_document,
    synthetic_documents,
    write_synthetic,
)
from moe_lc.train.evaluation import answer_hits, token_losses

TOK = ByteTokenizer()


def text_of(tokens) -> str:
    return TOK.decode([int(t) for t in tokens])


@pytest.mark.parametrize("length", [120, 1000, 5000])
def test_passkey_answer_is_the_number_hidden_in_the_context(length):
    for doc in synthetic_documents("passkey", 6, length, seed=11):
        assert len(doc.tokens) == length and doc.tokens[-1] == TOK.eod_id and np.sum(doc.tokens == TOK.eod_id) == 1
        text = text_of(doc.tokens)
        needles = re.findall(r"The pass key is (\d+)\. Remember it\.", text)
        assert len(needles) == 1
        question = re.fullmatch(r"(?s).*\nWhat is the pass key\? The pass key is (\d+)", text)
        assert question and question.group(1) == needles[0] == doc.answers[0]
        # Reported answer positions hold the answer at the very end; evidence positions hold it in the context.
        assert text_of(doc.tokens[doc.answer_positions]) == doc.answers[0]
        assert doc.answer_positions[-1] == length - 2  # just before EOD
        np.testing.assert_array_equal(doc.tokens[doc.evidence_positions], doc.tokens[doc.answer_positions])
        assert doc.evidence_positions.max() < doc.answer_positions.min()
        assert text_of(doc.tokens[: doc.evidence_positions[0]]).endswith("The pass key is ")


def test_passkey_depth_spreads_over_the_whole_context():
    length = 4000
    depths = np.array([d.evidence_positions[0] / length for d in synthetic_documents("passkey", 40, length, seed=5)])
    assert depths.min() < 0.2 and depths.max() > 0.8


@pytest.mark.parametrize("length", [200, 3000])
def test_associative_recall_answers_are_the_values_of_the_queried_keys(length):
    for doc in synthetic_documents("associative_recall", 5, length, seed=2, num_queries=4):
        assert len(doc.tokens) == length and doc.tokens[-1] == TOK.eod_id
        text = text_of(doc.tokens)
        context, queries = text.split("\nQueries:")
        pairs = re.findall(r" ([a-z]{4})=(\d{4});", context)
        table = dict(pairs)
        assert len(table) == len(pairs) >= 4, "keys must be distinct"
        asked = re.findall(r"\n([a-z]{4})=(\d{4})", queries)
        assert len(asked) == 4
        assert [v for _, v in asked] == list(doc.answers)
        assert all(table[k] == v for k, v in asked)
        assert text_of(doc.tokens[doc.answer_positions]) == "".join(doc.answers)
        np.testing.assert_array_equal(doc.tokens[doc.evidence_positions], doc.tokens[doc.answer_positions])
        for q in range(4):  # each answer's evidence is the value right after its key in the context
            ev = doc.evidence_positions[4 * q]
            assert text_of(doc.tokens[ev - 6: ev]) == f" {asked[q][0]}="
        if length >= 3000:
            assert len(pairs) > 100  # the context is really filled with pairs


def test_generators_are_deterministic_by_seed_and_index():
    for make in (passkey_document, associative_recall_document):
        a, b, c = make(3, 600, seed=1), make(3, 600, seed=1), make(3, 600, seed=2)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.answer_positions, b.answer_positions)
        assert not np.array_equal(a.tokens, c.tokens)
        assert not np.array_equal(a.tokens, make(4, 600, seed=1).tokens)
    few = synthetic_documents("passkey", 2, 300, seed=9)
    many = synthetic_documents("passkey", 5, 300, seed=9)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(few, many))


def test_answer_batch_labels_only_the_answers_and_scores():
    docs = synthetic_documents("passkey", 2, 200, seed=0) + synthetic_documents("associative_recall", 1, 300, seed=0)
    batch = answer_batch(docs)
    assert batch.input_ids.shape == (1, 700) and batch.cu_seqlens.tolist() == [0, 200, 400, 700]
    labels = batch.labels[0].numpy()
    offsets = [0, 200, 400]
    expected = np.full(700, IGNORE_INDEX)
    for off, d in zip(offsets, docs):
        expected[off + d.answer_positions - 1] = d.tokens[d.answer_positions]  # predicted from the previous position
    np.testing.assert_array_equal(labels, expected)
    assert batch.num_label_tokens == sum(len(d.answer_positions) for d in docs)
    # A model that puts all mass on the right answer scores 1.0; one that is always wrong scores 0.
    perfect = torch.full((1, 700, 258), -30.0)
    mask = labels != IGNORE_INDEX
    perfect[0, np.flatnonzero(mask), labels[mask]] = 30.0
    # (the stage-end evaluation's per-position measures, moe_lc.train.evaluation)
    answers = torch.from_numpy(mask)
    assert bool((answer_hits(perfect, batch.labels)[answers] == 1).all())
    assert float(token_losses(perfect, batch.labels)[answers].max()) < 1e-6
    wrong = torch.zeros(1, 700, 258)
    wrong[..., 257] = 5.0
    assert float(answer_hits(wrong, batch.labels).sum()) == 0.0


def test_write_synthetic_is_a_packable_source(tmp_path):
    prefix = tmp_path / "passkey"
    stats = write_synthetic(prefix, "passkey", 6, 256, seed=4)
    assert stats.documents == 6 and stats.tokens == 6 * 256
    docs = synthetic_documents("passkey", 6, 256, seed=4)
    saved = json.loads((tmp_path / "passkey.answers.json").read_text())
    assert [d["answer_positions"] for d in saved["documents"]] == [d.answer_positions.tolist() for d in docs]
    ds = PackedDataset([str(prefix)], seq_len=256, seed=0)
    seen = set()
    for i in range(6):  # length == seq_len: every sequence is exactly one whole document
        s = ds[i]
        assert s.cu_seqlens.tolist() == [0, 256]
        k = next(k for k, d in enumerate(docs) if np.array_equal(d.tokens, s.input_ids.numpy()))
        seen.add(k)
    assert seen == set(range(6))


def test_bad_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown synthetic task 'needle'"):
        synthetic_documents("needle", 1, 100)
    with pytest.raises(ValueError, match="too short.*need at least"):
        passkey_document(0, 20)
    with pytest.raises(ValueError, match="fewer than num_queries=50"):
        associative_recall_document(0, 200, num_queries=50)
    with pytest.raises(ValueError, match="num_documents must be >= 1"):
        synthetic_documents("passkey", 0, 100)
