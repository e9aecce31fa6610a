"""The multi-process harness itself: a failing rank is reported as the cause, not its peers, and the
gloo ranks run on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_harness import run_distributed

# Asked at import, as torchao does: a spawned worker imports this module (to unpickle its function)
# before it runs anything, and CUDA keeps this first answer for the life of the process.
CUDA_DEVICES_AT_IMPORT = torch.cuda.device_count()


def _rank_one_fails() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one broke on purpose")
    dist.barrier()  # rank 0 waits here for a peer that is gone
    return 0


@pytest.mark.timeout(120)
def test_the_failing_rank_is_reported_first():
    with pytest.raises(RuntimeError) as err:
        run_distributed(_rank_one_fails, 2, timeout=60)
    report = str(err.value)
    assert report.startswith("rank 1 failed"), report[:2000]
    assert "rank one broke on purpose" in report


def _default_device() -> tuple[str, bool]:
    from moe_lc.parallel.mesh import default_device_type

    return default_device_type(), torch.cuda.is_available()


@pytest.mark.timeout(120)
def test_the_ranks_run_on_the_cpu_even_where_a_gpu_is_present():
    # what the parity tests compare against is a CPU run; meshes default to CUDA where it is visible
    assert run_distributed(_default_device, 2, timeout=60) == [("cpu", False)] * 2
