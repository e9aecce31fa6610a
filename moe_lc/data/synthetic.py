"""Synthetic long-range tasks: is the whole context actually used?

Two generators, each a pure function of (seed, document index, length, tokenizer):

- passkey retrieval: a number stated once at a random depth inside filler text, asked for at
  the very end ("What is the pass key? The pass key is 40917").
- associative recall: many `key=value;` pairs, then queries `key=` whose answers are the values
  given (possibly thousands of tokens) earlier.

A document is built in token space from separately tokenized pieces, so it has exactly
`length` tokens (EOD included) for any tokenizer, and the answer's tokens are literally the
tokens given in the context (`evidence_positions`). `answer_positions` are the indices of the
answer tokens; the model predicts tokens[p] from position p - 1. `answer_batch` turns
documents into a packed batch whose only labels are the answers, so loss/accuracy on it
measure long-range retrieval. With length == seq_len, `write_synthetic` output packs one
document per training sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from moe_lc.data.packing import IGNORE_INDEX, Batch
from moe_lc.data.prepare import PrepareStats, write_indexed
from moe_lc.data.tokenizer import Tokenizer, describe_tokenizer, load_tokenizer

TASKS = ("passkey", "associative_recall")
_TASK_CODE = {"passkey": 1, "associative_recall": 2}

_FILLER = (
    "The river keeps moving past the old mill. ",
    "A small boat waits near the shore. ",
    "Clouds drift slowly over the hills. ",
    "The market opens early on most days. ",
    "Someone is reading by the window. ",
    "Leaves gather in the corner of the yard. ",
    "The train to the coast leaves at noon. ",
    "A cat sleeps on the warm stone wall. ",
)


@dataclass(frozen=True)
class SyntheticDocument:
    """One task instance: `tokens` (ending in EOD) and where its answers are."""

    task: str
    tokens: np.ndarray  # int64 [length]
    answer_positions: np.ndarray  # int64: tokens[p] is an answer token, to be predicted at p - 1
    evidence_positions: np.ndarray  # int64, aligned: where the same token was given in the context
    answers: tuple[str, ...]  # the answer strings, in order of appearance


def _enc(tok: Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text), dtype=np.int64)


def _filler(tok: Tokenizer, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n filler tokens (whole sentences, the last one cut) and the sentence start offsets <= n."""
    sentences = [_enc(tok, s) for s in _FILLER]
    pieces, starts, total = [], [0], 0
    while total < n:
        piece = sentences[int(rng.integers(len(sentences)))]
        pieces.append(piece)
        total += len(piece)
        starts.append(total)
    tokens = np.concatenate(pieces)[:n] if pieces else np.zeros(0, dtype=np.int64)
    return tokens, np.asarray([s for s in starts if s <= n], dtype=np.int64)


def _assemble(tok: Tokenizer, parts: list[tuple[np.ndarray, str]], length: int):
    """Concatenate (tokens, role) parts + EOD; roles 'answer:<k>' / 'evidence:<k>' are recorded."""
    tokens = np.concatenate([p for p, _ in parts] + [np.asarray([tok.eod_id], dtype=np.int64)])
    assert len(tokens) == length, (len(tokens), length)
    where: dict[str, np.ndarray] = {}
    offset = 0
    for piece, role in parts:
        if role:
            where[role] = np.arange(offset, offset + len(piece), dtype=np.int64)
        offset += len(piece)
    keys = sorted((k for k in where if k.startswith("answer:")), key=lambda k: int(k.split(":")[1]))
    answer = np.concatenate([where[k] for k in keys])
    evidence = np.concatenate([where["evidence:" + k.split(":")[1]] for k in keys])
    return tokens, answer, evidence


def passkey_document(index: int, length: int, seed: int = 0, tokenizer: Union[str, Tokenizer] = "byte", digits: int = 5) -> SyntheticDocument:
    """Filler with 'The pass key is N.' at a random sentence boundary; the document ends asking for N."""
    tok = load_tokenizer(tokenizer)
    rng = np.random.default_rng([seed, _TASK_CODE["passkey"], index])
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    key_tokens = _enc(tok, key)
    needle = [(_enc(tok, "The pass key is "), ""), (key_tokens, "evidence:0"), (_enc(tok, ". Remember it. "), "")]
    query = [(_enc(tok, "\nWhat is the pass key? The pass key is "), ""), (key_tokens, "answer:0")]
    fixed = sum(len(p) for p, _ in needle + query) + 1
    if length < fixed:
        raise ValueError(f"passkey: length {length} is too short for this tokenizer; need at least {fixed} tokens")
    filler, starts = _filler(tok, rng, length - fixed)
    depth = int(starts[rng.integers(len(starts))])
    parts = [(filler[:depth], "")] + needle + [(filler[depth:], "")] + query
    tokens, answer, evidence = _assemble(tok, parts, length)
    return SyntheticDocument("passkey", tokens, answer, evidence, (key,))


def _key_name(i: int, letters: int) -> str:
    chars = []
    for _ in range(letters):
        i, r = divmod(i, 26)
        chars.append(chr(ord("a") + r))
    return "".join(chars)


def associative_recall_document(
    index: int,
    length: int,
    seed: int = 0,
    tokenizer: Union[str, Tokenizer] = "byte",
    num_queries: int = 4,
    key_letters: int = 4,
    value_digits: int = 4,
) -> SyntheticDocument:
    """'Pairs: abcd=1234; ...' filling the context, then filler, then 'Queries:' 'key=' -> value."""
    tok = load_tokenizer(tokenizer)
    rng = np.random.default_rng([seed, _TASK_CODE["associative_recall"], index])
    header, query_header = _enc(tok, "Pairs:"), _enc(tok, "\nQueries:")
    max_pairs = max(num_queries, min(length // 4, 26**key_letters))
    key_ids = rng.choice(26**key_letters, size=max_pairs, replace=False)
    values = rng.integers(10 ** (value_digits - 1), 10**value_digits, size=max_pairs)
    keys = [_key_name(int(k), key_letters) for k in key_ids]
    vals = [str(int(v)) for v in values]
    # Take pairs while they fit, keeping room for num_queries of the costliest query so far.
    budget = length - 1 - len(header) - len(query_header)
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (" key=", value, ";", "\nkey=")
    used = max_query_cost = 0
    for k, v in zip(keys, vals):
        pair = (_enc(tok, f" {k}="), _enc(tok, v), _enc(tok, ";"), _enc(tok, f"\n{k}="))
        query_cost = max(max_query_cost, len(pair[3]) + len(pair[1]))
        cost = len(pair[0]) + len(pair[1]) + len(pair[2])
        if used + cost + num_queries * query_cost > budget:
            break
        pairs.append(pair)
        used, max_query_cost = used + cost, query_cost
    if len(pairs) < num_queries:
        raise ValueError(
            f"associative_recall: length {length} fits only {len(pairs)} key-value pairs, fewer than "
            f"num_queries={num_queries}; use a longer length or fewer queries"
        )
    asked = [int(a) for a in rng.choice(len(pairs), size=num_queries, replace=False)]
    query_number = {a: qn for qn, a in enumerate(asked)}
    filler, _ = _filler(tok, rng, budget - used - sum(len(pairs[a][3]) + len(pairs[a][1]) for a in asked))

    parts: list[tuple[np.ndarray, str]] = [(header, "")]
    for n, (key_part, value, sep, _) in enumerate(pairs):
        parts += [(key_part, ""), (value, f"evidence:{query_number[n]}" if n in query_number else ""), (sep, "")]
    parts += [(filler, ""), (query_header, "")]
    for qn, a in enumerate(asked):
        parts += [(pairs[a][3], ""), (pairs[a][1], f"answer:{qn}")]
    tokens, answer, evidence = _assemble(tok, parts, length)
    return SyntheticDocument("associative_recall", tokens, answer, evidence, tuple(vals[a] for a in asked))


_GENERATORS = {"passkey": passkey_document, "associative_recall": associative_recall_document}


def synthetic_documents(
    task: str, num_documents: int, length: int, seed: int = 0, tokenizer: Union[str, Tokenizer] = "byte", **options
) -> list[SyntheticDocument]:
    """Documents 0..num_documents-1 of a task; document i is the same whatever num_documents is."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {list(TASKS)}")
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    tok = load_tokenizer(tokenizer)
    return [_GENERATORS[task](i, length, seed, tok, **options) for i in range(num_documents)]


def write_synthetic(
    output_prefix: Union[str, Path],
    task: str,
    num_documents: int,
    length: int,
    seed: int = 0,
    tokenizer: Union[str, Tokenizer] = "byte",
    **options,
) -> PrepareStats:
    """Write a task as a `.bin`/`.idx` data source, plus `<prefix>.answers.json` (positions per document)."""
    tok = load_tokenizer(tokenizer)
    docs = synthetic_documents(task, num_documents, length, seed, tok, **options)
    info = {"task": task, "length": length, "seed": seed, "options": options}
    n_docs, n_tokens = write_indexed(output_prefix, (d.tokens for d in docs), describe_tokenizer(tok), {"synthetic": info})
    answers = {**info, "documents": [
        {"answers": list(d.answers), "answer_positions": d.answer_positions.tolist(),
         "evidence_positions": d.evidence_positions.tolist()} for d in docs]}
    Path(f"{output_prefix}.answers.json").write_text(json.dumps(answers) + "\n")
    return PrepareStats(str(output_prefix), n_docs, n_tokens, files=0, tokenizer=describe_tokenizer(tok))


def answer_batch(documents: Sequence[SyntheticDocument]) -> Batch:
    """Documents packed into one row whose only labels are the answer tokens (label at p-1 = tokens[p])."""
    if not documents:
        raise ValueError("answer_batch needs at least one document")
    ids, labels, cu = [], [], [0]
    for d in documents:
        lab = np.full(len(d.tokens), IGNORE_INDEX, dtype=np.int64)
        lab[d.answer_positions - 1] = d.tokens[d.answer_positions]
        ids.append(d.tokens)
        labels.append(lab)
        cu.append(cu[-1] + len(d.tokens))
    input_ids = torch.from_numpy(np.concatenate(ids)).unsqueeze(0)
    label_t = torch.from_numpy(np.concatenate(labels)).unsqueeze(0)
    return Batch(input_ids, label_t, torch.tensor(cu, dtype=torch.int32), int((label_t != IGNORE_INDEX).sum()))
