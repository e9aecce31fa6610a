"""A checkpoint saved under one parallel layout resumes under another. Two ranks (torchrun, gloo,
moe_lc.parallel) train stage ctx256 data-parallel (FSDP2) and switch to tensor parallelism for
stage ctx1k inside the run (checkpoint, rebuild, reload); one process then resumes from the
FSDP checkpoint. Two ranks likewise switch from data parallelism to context parallelism (cp=2:
each rank runs its zigzag shard of every row) at the stage boundary. All follow the
single-process run: the same global batches, only summation orders differ.

The proxy-8k recipe's first stage, unedited but for the tiny model and a small sequence and
batch, fits one process and two ranks (its layout fits the world) and takes its first step on
both with the same loss (`moe-lc bench`, which builds and steps a stage as `moe-lc train` does).

The runs compute in float64 on CPU (precision=fp64). In fp32 the rounding of the layouts' different
reduction orders grows through Adam's first steps and can flip a routing decision (gradient norms
3e-5 apart at step 3 on a clean clone), so no fp32 bound is both safe and tight. In float64 the runs
agree to ~1e-16 at every step, and a bound of 1e-10 keeps six orders of magnitude of headroom while
any real difference fails it (as weight decay on the norm weights after the switch to tensor
parallelism did, at 4e-5, under the former fp32 bound of 1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moe_lc.parallel")

from moe_lc.train.main import run_bench_cli, run_train_cli  # noqa: E402

FAST = [
    "device=cpu",
    "precision=fp64",
    "model.mtp=true",  # MTP's targets cross chunk edges under cp
    "curriculum.run=[ctx256,ctx1k]",
    "curriculum.stages.ctx256.steps=3",
    "curriculum.stages.ctx256.global_batch_tokens=1024",
    "curriculum.stages.ctx256.micro_batch=1",
    "curriculum.stages.ctx1k.steps=2",
    "curriculum.stages.ctx1k.global_batch_tokens=2048",
    "curriculum.stages.ctx1k.micro_batch=1",
    "curriculum.stages.ctx16k.global_batch_tokens=32768",  # every stage must split over 2 ranks
    "eval.sequences=0",
    "eval.passkey_documents=0",
    "checkpoint.every=2",
    "checkpoint.keep_last=10",
    "logging.progress=none",
    "logging.tensorboard=false",
    "report.at_end=false",
    "threads=1",
]


RTOL = 1e-10  # float64 runs that differ only in summation order (measured ~1e-16 apart)


def _losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "moe_lc_cache")


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache) -> Path:
    """The uninterrupted single-process run every layout is compared with."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_LC_CACHE", cache)
        assert run_train_cli([*FAST, f"run_dir={run_dir}"]) == 0
    return run_dir


def _two_ranks(cache: str, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOE_LC_CACHE": cache, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "moe_lc.train", *FAST, *overrides, f"run_dir={run_dir}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device cpu x 2 (fp64)" in proc.stdout and "layout changes for stage ctx1k" in proc.stdout
    return proc


def test_two_data_parallel_ranks_then_one_process(tmp_path, cache, single, monkeypatch):
    monkeypatch.setenv("MOE_LC_CACHE", cache)
    ref = _losses(single)

    dp2 = tmp_path / "dp2"
    _two_ranks(cache, dp2, "layout=dp2", "curriculum.stages.ctx1k.layout={tp: 2, dp_shard: 1}")
    two = _losses(dp2)
    assert sorted(two) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        assert two[step] == pytest.approx(ref[step], rel=RTOL)
    # the global gradient norm (clipping is active: norms are above grad_clip=1) over FSDP, then TP shards
    two_norms, ref_norms = _losses(dp2, "grad_norm"), _losses(single, "grad_norm")
    assert max(ref_norms.values()) > 1.0
    for step in ref_norms:
        assert two_norms[step] == pytest.approx(ref_norms[step], rel=RTOL)

    # MFU's attention keys come from every rank's documents: the same global number as one process
    two_keys, ref_keys = _losses(dp2, "keys_per_token"), _losses(single, "keys_per_token")
    assert two_keys == pytest.approx(ref_keys, rel=1e-12)

    resumed = tmp_path / "resumed"
    assert run_train_cli([*FAST, f"run_dir={resumed}", f"resume={dp2 / 'checkpoints' / 'step_00000002'}"]) == 0
    got = _losses(resumed)
    assert sorted(got) == [3, 4, 5]
    for step in got:  # across the ctx256 -> ctx1k boundary, on one process
        assert got[step] == pytest.approx(ref[step], rel=RTOL)


def test_data_parallel_then_context_parallel_at_a_stage_boundary(tmp_path, cache, single):
    """ctx256 on two data-parallel ranks, then ctx1k with cp=2: both ranks read the same rows and
    each computes its two zigzag chunks of every row (KDA's segment states, MLA's gathered latents,
    the convolution halo, MTP's targets across the chunk edges, label counts over dp x cp). Python's
    garbage collector runs on the step schedule here (`gc.every`): the same losses as one process."""
    run = tmp_path / "cp2"
    proc = _two_ranks(cache, run, "layout=dp2", "curriculum.stages.ctx1k.layout={cp: 2, dp_shard: 1}",
                      "eval.sequences=2", "eval.passkey_documents=1",  # the stage ends evaluate under dp, then cp
                      "gc.every=1")  # every rank collects after every step, across the layout change too
    assert "cp=2" in proc.stdout and "eval skipped" not in proc.stdout
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in evals] == ["ctx256", "ctx1k"] and all(e["loss"] > 0 for e in evals)
    for key in ("loss", "grad_norm", "label_tokens"):
        got, ref = _losses(run, key), _losses(single, key)
        assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5], key
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=RTOL), (key, step)
    assert _losses(run, "keys_per_token") == pytest.approx(_losses(single, "keys_per_token"), rel=1e-12)


PROXY_8K_TINY = ["device=cpu", "model=tiny", "curriculum.stages.ctx8k.seq_len=256", "curriculum.stages.ctx8k.global_batch_tokens=1024",
                 "curriculum.stages.ctx8k.micro_batch=1",
                 "data.synthetic_documents=8", "threads=1", "--steps", "1", "--warmup", "0"]


def test_proxy_8k_first_stage_fits_one_process_and_two_ranks(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("MOE_LC_CACHE", cache)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert run_bench_cli(["proxy-8k", *PROXY_8K_TINY, "--json", str(one)]) == 0
    env = {**os.environ, "MOE_LC_CACHE": cache, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "moe_lc.cli", "bench", "proxy-8k", *PROXY_8K_TINY, "--json", str(two)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, ranks = json.loads(one.read_text()), json.loads(two.read_text())
    assert single["stage"] == ranks["stage"] == "ctx8k"
    assert single["layout"].startswith("pp=1 dp_replicate=1 dp_shard=1 cp=1 tp=1 ep=1 (world 1")
    assert ranks["layout"].startswith("pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=1 ep=2 (world 2")  # ep 8 fitted to 2
    assert (single["grad_accum"], ranks["grad_accum"]) == (4, 2)
    assert ranks["first_loss"] == pytest.approx(single["first_loss"], rel=1e-5)
    assert ranks["keys_per_token"] == pytest.approx(single["keys_per_token"], rel=1e-12)  # over the global batch
