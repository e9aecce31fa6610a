"""What checkpoint checksums cost on this machine (CPU, one process).

    python benchmarks/bench_checkpoint_integrity.py [--mib 512] [--dir /tmp/bench_ckpt] [--out r.json]

- hash rate: sha256 (what the manifest records) and blake2b over the same in-memory bytes, 1 MiB
  updates as the checkpoint code does, best of 3;
- a checkpoint of `--mib` MiB of fp32 tensors (one `nn.Module`): the save, whose writer hashes
  each tensor file after writing it, and the full check before a load (`CheckpointManager.verify`
  from a fresh manager, files in the page cache), with the bytes hashed and the rate;
- the same save with hashing turned off (the digests replaced by a constant), so the difference
  is the hashing's share of a save; saves alternate, best of 2 each.

One process hashes every file; with N ranks each hashes its own files (its shard), so the time
per rank is shard bytes / hash rate. The directory is removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from moe_lc.checkpoint import CheckpointManager, ondisk

warnings.filterwarnings("ignore", message="torch.distributed is")


def hash_rate(algorithm: str, data: bytes) -> float:
    """MB/s (10^6 bytes) of hashlib `algorithm` over `data` in 1 MiB updates, best of 3."""
    view, best = memoryview(data), float("inf")
    for _ in range(3):
        digest, t0 = hashlib.new(algorithm), time.perf_counter()
        for i in range(0, len(data), 1 << 20):
            digest.update(view[i : i + (1 << 20)])
        best = min(best, time.perf_counter() - t0)
    return len(data) / best / 1e6


def model_of(mib: int) -> nn.Module:
    chunks = max(1, mib // 64)
    per = mib * 2**20 // 4 // chunks
    torch.manual_seed(0)
    return nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(chunks)])


def timed_save(root: Path, model: nn.Module) -> tuple[Path, float]:
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    path = CheckpointManager(root, keep_last=None).save(1, {"model": model, "rng": None})
    return path, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="tensor bytes of the checkpoint, MiB")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_checkpoint_integrity"))
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    data = os.urandom(256 << 20)
    rates = {name: hash_rate(name, data) for name in ("sha256", "blake2b")}
    del data

    model = model_of(args.mib)
    real_digest = ondisk.file_digest
    save_s, unhashed_save_s = float("inf"), float("inf")
    for _ in range(2):  # alternated, best of 2: the first save also pays for warm-up
        ondisk.file_digest = lambda p: "0" * 64  # the save without hashing, for the difference
        try:
            unhashed_save_s = min(unhashed_save_s, timed_save(args.dir, model)[1])
        finally:
            ondisk.file_digest = real_digest
        path, seconds = timed_save(args.dir, model)
        save_s = min(save_s, seconds)
    manifest = ondisk.read_manifest(path)
    hashed = ondisk.hashed_bytes(manifest, manifest["files"])
    t0 = time.perf_counter()
    CheckpointManager(args.dir).verify(path)
    verify_s = time.perf_counter() - t0
    shutil.rmtree(args.dir, ignore_errors=True)

    result = {
        "sha256_MBps": rates["sha256"], "blake2b_MBps": rates["blake2b"], "checkpoint_bytes": hashed,
        "save_s": save_s, "save_without_hashing_s": unhashed_save_s, "verify_s": verify_s,
        "verify_MBps": hashed / verify_s / 1e6,
    }
    print(f"hash rate (in memory, 1 MiB updates): sha256 {rates['sha256']:.0f} MB/s, "
          f"blake2b {rates['blake2b']:.0f} MB/s")
    print(f"checkpoint of {hashed / 1e6:.0f} MB: save {save_s:.2f}s (without hashing {unhashed_save_s:.2f}s), "
          f"full check {verify_s:.2f}s = {result['verify_MBps']:.0f} MB/s")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
