"""prepare-data: text/JSONL -> .bin/.idx read back by megatron-core itself; tokenizers; vocab checks."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from moe_lc.cli import main as cli_main
from moe_lc.data import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer, prepare_data, read_meta
from moe_lc.data.synthetic import synthetic_documents

tokenizers = pytest.importorskip("tokenizers")


def megatron_dataset(prefix):
    """megatron-core's own reader, imported here directly (not through moe_lc's wrapper)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix), mmap=True)


def make_bpe_tokenizer(path: Path, specials=("[UNK]", "<|endoftext|>", "<pad>")) -> Path:
    """A tiny byte-level BPE tokenizer.json trained on a few strings with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the cat sat on the mat", "hello world 12345 67890", "The pass key is 4211. Remember it.",
              "What is the pass key? Queries: abcd=1234; efgh=5678;"]
    tok.train_from_iterator(corpus * 5, trainer)
    tok.save(str(path))
    return path


@pytest.fixture()
def corpus_files(tmp_path):
    """Text files (one document each, one empty), a JSONL file and a gzipped JSONL in a subdirectory."""
    rng = np.random.default_rng(0)
    texts = {
        "a.txt": "Hello, world!\nSecond line with ünïcødé and emoji \U0001F600.\n",
        "b.txt": "".join(chr(c) for c in rng.integers(32, 127, size=3000)),
        "empty.txt": "",
    }
    for name, text in texts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    lines = [{"text": "first json document"}, {"text": "second, with \"quotes\"\nand newline", "id": 7}, {"text": "x" * 500}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    sub = tmp_path / "more"
    sub.mkdir()
    with gzip.open(sub / "d.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": "zipped document"}) + "\n")
    inputs = [tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "empty.txt", tmp_path / "c.jsonl", sub]
    expected_texts = [texts["a.txt"], texts["b.txt"]] + [r["text"] for r in lines] + ["zipped document"]
    return inputs, expected_texts


def test_bin_idx_read_back_by_megatron_matches_independent_tokenisation(tmp_path, corpus_files):
    inputs, texts = corpus_files
    prefix = tmp_path / "out" / "data"
    stats = prepare_data(inputs, prefix, "byte")
    assert stats.documents == len(texts) and stats.skipped_empty == 1
    ds = megatron_dataset(prefix)
    assert len(ds) == len(texts)
    assert np.array_equal(ds.document_indices, np.arange(len(texts) + 1))  # one sequence per document
    total = 0
    for i, text in enumerate(texts):
        expected = np.array(list(text.encode("utf-8")) + [256])  # bytes, then EOD
        np.testing.assert_array_equal(ds[i].astype(np.int64), expected)
        total += len(expected)
    assert stats.tokens == total
    meta = read_meta(prefix)
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 258 and meta["eod_id"] == 256
    assert meta["documents"] == len(texts) and meta["tokens"] == total
    assert not list((tmp_path / "out").glob("*.tmp-*")), "temporary files left behind"


def test_hf_tokenizer_path(tmp_path, corpus_files):
    inputs, texts = corpus_files
    tok_path = make_bpe_tokenizer(tmp_path / "tokenizer.json")
    reference = tokenizers.Tokenizer.from_file(str(tok_path))
    eod = reference.token_to_id("<|endoftext|>")
    prefix = tmp_path / "hf"
    stats = prepare_data(inputs, prefix, str(tok_path))
    ds = megatron_dataset(prefix)
    for i, text in enumerate(texts):
        expected = reference.encode(text, add_special_tokens=False).ids + [eod]
        np.testing.assert_array_equal(ds[i].astype(np.int64), expected)
    assert stats.tokenizer["vocab_size"] == reference.get_vocab_size() and stats.tokenizer["eod_id"] == eod
    tok = load_tokenizer(str(tok_path))
    assert isinstance(tok, HFTokenizer) and tok.pad_id == reference.token_to_id("<pad>")
    assert tok.decode(tok.encode(texts[0])) == texts[0]
    # Synthetic tasks in HF token space: exact length, answers decode back.
    for task in ("passkey", "associative_recall"):
        for doc in synthetic_documents(task, 3, 400, seed=1, tokenizer=tok):
            assert len(doc.tokens) == 400 and doc.tokens[-1] == eod
            assert tok.decode(doc.tokens[doc.answer_positions].tolist()) == "".join(doc.answers)
            np.testing.assert_array_equal(doc.tokens[doc.evidence_positions], doc.tokens[doc.answer_positions])
    check_vocab(prefix, reference.get_vocab_size(), tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_vocab(prefix, 100_000, tokenizer=ByteTokenizer())


def test_hf_tokenizer_needs_an_end_of_document_token(tmp_path):
    path = make_bpe_tokenizer(tmp_path / "noeod.json", specials=("[UNK]", "<my_end>"))
    with pytest.raises(ValueError, match="eod_token"):
        HFTokenizer(path)
    assert HFTokenizer(path, eod_token="<my_end>").eod_id == tokenizers.Tokenizer.from_file(str(path)).token_to_id("<my_end>")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(path, eod_token="<nope>")


def test_cli_prepare_data(tmp_path, corpus_files, capsys):
    inputs, texts = corpus_files
    prefix = tmp_path / "cli"
    assert cli_main(["prepare-data", *map(str, inputs), "--output-prefix", str(prefix)]) == 0
    out = capsys.readouterr().out
    n_tokens = sum(len(t.encode("utf-8")) + 1 for t in texts)
    assert f"{len(texts):,} documents" in out and f"{n_tokens:,} tokens" in out
    assert len(megatron_dataset(prefix)) == len(texts)

    jsonl = tmp_path / "content.jsonl"
    jsonl.write_text(json.dumps({"content": "abc"}) + "\n" + json.dumps({"content": "de"}) + "\n")
    assert cli_main(["prepare-data", str(jsonl), "--output-prefix", str(tmp_path / "k"), "--json-key", "content"]) == 0
    assert [list(x) for x in megatron_dataset(tmp_path / "k")] == [[97, 98, 99, 256], [100, 101, 256]]

    assert cli_main(["prepare-data", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "input not found" in capsys.readouterr().err


def test_input_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        prepare_data([bad], tmp_path / "o")
    wrong_key = tmp_path / "key.jsonl"
    wrong_key.write_text('{"body": "ok"}\n')
    with pytest.raises(ValueError, match=r"key.jsonl:1: no field 'text' .*'body'.*--json-key"):
        prepare_data([wrong_key], tmp_path / "o")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_data([empty], tmp_path / "o")
    with pytest.raises(ValueError, match="no input files"):
        prepare_data([], tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="unknown tokenizer 'gpt9'"):
        prepare_data([wrong_key], tmp_path / "o", tokenizer="gpt9")
    assert not list(tmp_path.glob("o*")), "a failed prepare must not leave (partial) outputs"


def test_check_vocab(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("some text ÿ")  # contains a byte >= 0xc3
    prefix = tmp_path / "p"
    prepare_data([doc], prefix)
    assert check_vocab(prefix, 512)["vocab_size"] == 258
    with pytest.raises(ValueError, match=r"vocab 258.*vocab_size is 200"):
        check_vocab(prefix, 200)
    # Foreign Megatron data (no meta): the largest token id decides.
    Path(f"{prefix}.meta.json").unlink()
    assert check_vocab(prefix, 257)["vocab_size"] == 257  # EOD 256 is the largest id
    with pytest.raises(ValueError, match="token id 256"):
        check_vocab(prefix, 256)
    with pytest.raises(FileNotFoundError, match=r"missing .*nothere\.bin and .*nothere\.idx.*moe-lc prepare-data"):
        check_vocab(tmp_path / "nothere", 512)
