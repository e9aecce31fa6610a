"""Shared test settings.

One intra-op thread per process: the suite runs multi-process (gloo) tests on a 2-core
machine, and oversubscribed OpenMP threads spin-wait each other into 5-10x slowdowns.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
