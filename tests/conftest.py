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


@pytest.fixture
def exact_bf16_dots(monkeypatch):
    """Triton's interpreter multiplies the raw bits of bf16 dot operands (a [64, 32] x [32, 64]
    product comes out ~5e10 off); widen them to fp32 first, so bf16 kernel paths run on the CPU
    (its fp32 -> bf16 conversions truncate, where the GPU rounds to nearest). Skips where the
    interpreter is off (a GPU runs the kernels themselves)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("patches Triton's CPU interpreter")
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    exact_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar.is_bf16():
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        return exact_dot(self, widen(a), widen(b), acc, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
