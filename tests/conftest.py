"""Shared test settings.

One intra-op thread per process: the suite runs multi-process (gloo) tests on a 2-core
machine, and oversubscribed OpenMP threads spin-wait each other into 5-10x slowdowns.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shared_corpus_cache(tmp_path_factory):
    """One default-corpus cache per test session (under pytest's temp root), never ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MOE_LC_CACHE", str(tmp_path_factory.getbasetemp() / "moe_lc_cache"))
    yield
    mp.undo()
