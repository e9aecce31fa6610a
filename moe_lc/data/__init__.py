"""Data: tokenizers, `.bin`/`.idx` preparation, the default corpus, synthetic tasks and packing.

Importing this package is cheap; megatron-core (the `.bin`/`.idx` reader/writer) is imported
on first use.
"""

from moe_lc.data.corpus import default_corpus
from moe_lc.data.packing import IGNORE_INDEX, Batch, DataSource, PackedDataset, Sample, collate
from moe_lc.data.prepare import PrepareStats, check_vocab, prepare_data, read_meta, require_indexed
from moe_lc.data.synthetic import (
    SyntheticDocument,
    answer_batch,
    associative_recall_document,
    passkey_document,
    synthetic_documents,
    write_synthetic,
)
from moe_lc.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Batch", "ByteTokenizer", "DataSource", "HFTokenizer", "IGNORE_INDEX", "PackedDataset", "PrepareStats",
    "Sample", "SyntheticDocument", "Tokenizer", "answer_batch", "associative_recall_document", "check_vocab",
    "collate", "default_corpus", "load_tokenizer", "passkey_document", "prepare_data", "read_meta",
    "require_indexed", "synthetic_documents", "write_synthetic",
]
