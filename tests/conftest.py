"""Shared test settings.

One intra-op thread per process: the suite runs multi-process (gloo) tests on a 2-core
machine, and oversubscribed OpenMP threads spin-wait each other into 5-10x slowdowns. Triton's
interpreter on machines without a GPU.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run in Triton's interpreter where there is no GPU. The choice is made when a
# kernel module is imported (its @triton.jit functions are built for one mode), so it is set
# here, before any test module imports moe_lc (whose ops import the kernels) in either mode.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shared_corpus_cache(tmp_path_factory):
    """One default-corpus cache per test session (under pytest's temp root), never ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MOE_LC_CACHE", str(tmp_path_factory.getbasetemp() / "moe_lc_cache"))
    yield
    mp.undo()
