"""The multi-process harness itself: a failing rank is reported as the cause, not its peers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from parallel_harness import run_distributed


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
