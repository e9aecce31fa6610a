"""The machines the planner prices: a small table of GPUs and inter-node networks, and a cluster.

Every number names its source: "datasheet" (the vendor's published figure), "measured here" (this
project's own measurement on one H200, docs/performance.md) or "assumed" (a planning choice that
a measurement should replace). Bandwidths are per GPU and per direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_lc.config import ConfigError

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # datasheet: the marketed size (80 GB, 141 GB), read as GiB of device memory
    bf16_peak: float  # datasheet: dense bf16 tensor-core FLOP/s (no sparsity)
    hbm_bandwidth: float  # datasheet: B/s
    nvlink_bandwidth: float  # datasheet: NVLink 4, 900 GB/s per GPU both directions together


H100 = GPU("H100 SXM", 80, 989e12, 3.35e12, 450 * GB)
H200 = GPU("H200 SXM", 141, 989e12, 4.8e12, 450 * GB)
GPUS = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth: float  # datasheet: one NIC port per GPU, B/s per direction


NETWORKS = {
    "ib400": Network("InfiniBand NDR 400 Gb/s per GPU", 50 * GB),
    "ib200": Network("InfiniBand 200 Gb/s per GPU", 25 * GB),
    "ib800": Network("InfiniBand XDR 800 Gb/s per GPU", 100 * GB),
}

HBM_FRACTION = 0.88  # measured here: a device copy ran at 4.25 TB/s of the H200's 4.8
LINK_FRACTION = 0.8  # assumed: what large NCCL collectives reach of a link's bandwidth (NVLink and IB alike)


@dataclass(frozen=True)
class ComputeRates:
    """What a step's kernels reach, by kind of work (`moe_lc.metrics.kernel_kinds`): each FLOP kind as a
    share of the bf16 peak, the memory-bound kernels as bytes moved per byte the layers keep for
    backward, the optimizer as a share of the HBM bandwidth."""

    dense_gemm: float
    grouped_gemm: float
    attention: float
    kda: float  # of the KDA recurrence's FLOPs as `moe_lc.model.accounting` counts them
    memory_passes: float  # memory-bound bytes / the bytes kept for backward without checkpointing, at HBM_FRACTION
    optimizer_hbm: float  # the fused AdamW update and the gradient norm

    def share(self, kind: str) -> float:
        return getattr(self, kind)


# measured here: the kernels of `moe-lc bench --trace` on one H200 (k3-small at 8K, the proxy at 8K and
# 64K; docs/performance.md, "The planner's step time by kind"), each the middle of the runs' values:
# dense GEMMs 700-755 TFLOP/s, grouped 371-615, attention 335-468 (within documents), KDA 20-23, the
# memory-bound kernels 7.1-8.7 passes, AdamW + its norm 0.61 of the HBM bandwidth
MEASURED_RATES = ComputeRates(dense_gemm=0.74, grouped_gemm=0.55, attention=0.40, kda=0.021, memory_passes=8.0,
                              optimizer_hbm=0.61)

DEFAULT_MARGIN = 0.10  # assumed: memory kept free for the CUDA context, NCCL and allocator fragmentation

# measured here: the host's time per decoder layer and micro-batch, forward and backward (Python, dispatch and
# launches, whatever the layer's width), from steps bound by their host on H100 machines (the GPU idle 24-71% of
# the step): k3-small's layers at 8 of 20, one 8K row a micro-batch, 105 ms a micro-batch (13.1 ms a layer); the
# proxy (9 layers) at one and two 8K rows, 110 and 120 ms (12.2 and 13.3 ms a layer); docs/performance.md §12.14.
# Where a micro-batch's kernels take less, the GPU waits for the host.
HOST_LAYER_SECONDS = 0.013
# what a checkpointed layer adds to its host time, as a share of it: the forward again and the checkpoint's own
# bookkeeping (saved-tensor hooks, RNG and autocast state). Measured here on an H100: the proxy at one 8K row a
# micro-batch, every layer recomputed, took 1.63x the step with none (3.328 against 2.043 s, same call, both
# bound by the host; docs/performance.md §12.15). The forward alone is 0.42 of a KDA layer's host time
# (benchmarks/host_time_kda.py, §12.3): the rest is the checkpoint's. Selective recompute not measured.
HOST_RECOMPUTE_SHARE = 0.63


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs of one kind in nodes of ``gpus_per_node``, NVLink inside a node, ``network`` across."""

    gpu: GPU
    gpus: int
    gpus_per_node: int
    network: Network
    memory_gib: float  # per GPU
    margin: float = DEFAULT_MARGIN
    rates: ComputeRates = MEASURED_RATES
    host_layer_s: float = HOST_LAYER_SECONDS  # the host's time per decoder layer and micro-batch

    @property
    def usable_gib(self) -> float:
        """What a layout may plan to use per GPU."""
        return self.memory_gib * (1 - self.margin)

    def flops(self, kind: str = "dense_gemm") -> float:
        """FLOP/s one GPU sustains on one kind of work (``moe_lc.model.accounting.FLOP_KINDS``)."""
        return self.gpu.bf16_peak * self.rates.share(kind)

    @property
    def hbm(self) -> float:
        return self.gpu.hbm_bandwidth * HBM_FRACTION

    @property
    def nvlink(self) -> float:
        return self.gpu.nvlink_bandwidth * LINK_FRACTION

    @property
    def inter_node(self) -> float:
        return self.network.bandwidth * LINK_FRACTION

    def members_per_node(self, size: int, stride: int) -> int:
        """How many of a group's ``size`` ranks, ``stride`` ranks apart, share one node."""
        if stride >= self.gpus_per_node:
            return 1
        return max(1, min(size, self.gpus_per_node // stride))

    def describe(self) -> str:
        nodes = -(-self.gpus // self.gpus_per_node)
        return (f"{self.gpus} x {self.gpu.name} ({nodes} nodes of {self.gpus_per_node}), {self.memory_gib:g} GiB "
                f"per GPU ({self.usable_gib:.1f} usable at a {self.margin:.0%} margin), NVLink "
                f"{self.gpu.nvlink_bandwidth / GB:.0f} GB/s, {self.network.name}")


@dataclass(frozen=True)
class ClusterRequest:
    """What `moe-lc plan --gpus ...` was given, checked by :meth:`resolve`."""

    gpus: int
    gpu_memory_gib: Optional[float] = None  # None: the GPU's datasheet size
    gpu: Optional[str] = None  # None: an H100 for 80 GiB or less, else an H200
    gpus_per_node: int = 8
    interconnect: str = "ib400"
    margin: float = DEFAULT_MARGIN

    def resolve(self) -> Cluster:
        """The cluster, or a ConfigError naming the option and the fix."""
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"--gpus {self.gpus}: give the number of GPUs, a positive integer")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node}: give a positive integer")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"--gpus {self.gpus} is not a whole number of {self.gpus_per_node}-GPU nodes; "
                              f"use a multiple of {self.gpus_per_node} or set --gpus-per-node")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ConfigError(f"--gpu-memory {self.gpu_memory_gib}: give the GiB of one GPU, e.g. 80 or 141")
        name = self.gpu or ("h100" if (self.gpu_memory_gib or H200.memory_gib) <= H100.memory_gib else "h200")
        if name not in GPUS:
            raise ConfigError(f"--gpu {name}: use one of {', '.join(GPUS)}")
        if self.interconnect not in NETWORKS:
            raise ConfigError(f"--interconnect {self.interconnect}: use one of {', '.join(NETWORKS)}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"--margin {self.margin}: give the share of memory to keep free, in [0, 1)")
        gpu = GPUS[name]
        memory = self.gpu_memory_gib if self.gpu_memory_gib is not None else gpu.memory_gib
        return Cluster(gpu, self.gpus, self.gpus_per_node, NETWORKS[self.interconnect], memory, self.margin)


def default_cluster(world_size: int, gpus_per_node: int, device_name: Optional[str] = None) -> Cluster:
    """H200s on NDR InfiniBand: what the plan of a recipe's own layout prices its time on; H100s where
    ``device_name`` (``torch.cuda.get_device_name``) names one, as a bench on an H100 compares with."""
    gpu = H100 if device_name is not None and "H100" in device_name.upper() else H200
    return Cluster(gpu, world_size, gpus_per_node, NETWORKS["ib400"], gpu.memory_gib)
