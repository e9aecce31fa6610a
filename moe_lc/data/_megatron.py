"""The one place that imports megatron-core's indexed dataset (the `.bin`/`.idx` reader/writer).

megatron-core warns (and logs) at import time that Transformer Engine and Apex are missing;
neither is used by its dataset module, so that noise is silenced here rather than alarming users.
The import is lazy (it costs seconds) so that `import moe_lc.data` stays cheap.
"""

from __future__ import annotations

import functools
import logging
import warnings
from types import ModuleType


@functools.lru_cache(maxsize=None)
def indexed_dataset_module() -> ModuleType:
    """megatron.core.datasets.indexed_dataset, imported once without its import-time warnings."""
    megatron_logger = logging.getLogger("megatron")
    previous_level = megatron_logger.level
    megatron_logger.setLevel(logging.WARNING)  # its import also logs INFO lines about fused kernels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as err:  # pragma: no cover - megatron-core is a declared dependency
        raise ImportError(
            "moe_lc.data needs megatron-core to read and write .bin/.idx files; "
            "install it with: pip install 'megatron-core>=0.14,<0.17'"
        ) from err
    finally:
        megatron_logger.setLevel(previous_level)
    # Its reader logs an INFO line per dataset opened; keep our own logs readable.
    logging.getLogger(indexed_dataset.__name__).setLevel(logging.WARNING)
    return indexed_dataset


def open_indexed(prefix: str):
    """megatron-core's IndexedDataset at `prefix` (memory-mapped)."""
    return indexed_dataset_module().IndexedDataset(prefix, mmap=True)


def new_builder(bin_path: str, dtype):
    """megatron-core's IndexedDatasetBuilder writing token ids of `dtype` to `bin_path`."""
    return indexed_dataset_module().IndexedDatasetBuilder(bin_path, dtype=dtype)


def optimal_dtype(vocab_size: int):
    """The smallest integer dtype megatron-core uses for a vocabulary of this size."""
    return indexed_dataset_module().DType.optimal_dtype(vocab_size)
