"""Every command the docs show runs: the shell commands of README.md, data/README.md and
docs/*.md (```bash blocks and indented code blocks) and the examples in launch/ comments.

`COMMANDS` lists each one with how it is checked here; a command the docs gain without an
entry, or an entry whose command left the docs, fails `test_every_documented_command_is_checked`.
Runnable commands are run as written, by bash, in a scratch directory that links the repo's
launch/ and data/ scripts (so relative run_dirs stay out of the repo), with small overrides
appended (one step, tiny stages, no eval) and placeholders (`NAME`, `/data/...`) filled in.
The others are GPU-only (the docs must say so next to them), need SLURM, or install packages.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LAUNCH = sorted((REPO / "launch").iterdir())
PROGRAMS = ("moe-lc", "python", "python3", "bash", "sbatch", "torchrun", "pip", "srun")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")

# appended to a training command: one step of a small first stage, nothing else
ONE_STEP = "max_steps=1 eval.sequences=0 eval.passkey_documents=0 report.at_end=false logging.tensorboard=false " \
           "logging.progress=none threads=1"
SMOKE = f"curriculum.stages.ctx256.global_batch_tokens=512 curriculum.stages.ctx256.micro_batch=2 {ONE_STEP}"
SMOKE_DP2 = f"device=cpu curriculum.stages.ctx256.global_batch_tokens=512 curriculum.stages.ctx256.micro_batch=1 {ONE_STEP}"
SMOKE_RUN = f"test -f runs/smoke/metrics.jsonl || moe-lc train {SMOKE} > /dev/null"
PREPARED = ("test -f data/mine.idx || moe-lc prepare-data corpus/*.jsonl --output-prefix data/mine "
            "--tokenizer tokenizer.json > /dev/null")
PROXY = ("model=tiny curriculum.stages.ctx8k.seq_len=256 curriculum.stages.ctx8k.global_batch_tokens=1024 "
         f"data.synthetic_documents=8 {ONE_STEP}")
PROXY_BENCH = ("model=tiny curriculum.stages.ctx8k.seq_len=256 curriculum.stages.ctx8k.global_batch_tokens=1024 "
               "data.synthetic_documents=8 threads=1 --steps 1 --warmup 0")


# the launch choices of docs/performance.md §12.17's kernel table
DEPTH_MIXTURE_VARIANTS = 'fwd_resident_max_d=0,bwd_resident_max_d=0;fwd_resident_max_d=4096,bwd_resident_per_sm=2;fwd_resident_max_d=4096,fwd_resident_per_sm=1,bwd_resident_per_sm=1;fwd_resident_max_d=4096,fwd_resident_per_sm=4,bwd_resident_per_sm=4;fwd_resident_max_d=4096,bwd_resident_per_sm=2,fwd_resident_cols_per_warp=128,bwd_resident_cols_per_warp=128;fwd_resident_max_d=4096,bwd_resident_per_sm=2,fwd_resident_rows=2,bwd_resident_rows=2;fwd_resident_max_d=4096,bwd_resident_per_sm=2,fwd_resident_rows=2,bwd_resident_rows=2,fwd_resident_cols_per_warp=512,bwd_resident_cols_per_warp=512'


@dataclass(frozen=True)
class Run:
    """Run `command` (the documented one unless given, with placeholders filled) plus `extra`."""

    extra: str = ""
    command: Optional[str] = None
    env: str = ""  # VAR=value ... in front
    before: str = ""  # makes what the command reads where an earlier command has not (any order, any worker)


@dataclass(frozen=True)
class NotRun:
    why: str
    needs: Optional[str] = None  # a word the docs must say next to the command ("GPU")


COMMANDS: dict[str, object] = {
    # README.md
    "pip install torch==2.13.0 && pip install -e . && moe-lc train":
        Run(SMOKE, command="moe-lc train"),  # the installs are what .ci/run does before this suite
    "moe-lc train --list": Run(),
    "moe-lc train recipe=smoke optim.lr=1e-3 run_dir=runs/try": Run(SMOKE),
    "moe-lc train curriculum.run=[ctx256,ctx1k]": Run(SMOKE),
    "moe-lc train resume=auto": Run(SMOKE),
    "moe-lc plan k3-8k": Run(),
    "moe-lc bench proxy-8k --steps 10 --profile": Run(PROXY_BENCH),
    "moe-lc report runs/smoke": Run(before=SMOKE_RUN),
    "moe-lc prepare-data corpus/*.jsonl --output-prefix data/mine --tokenizer tokenizer.json": Run(),
    "moe-lc train data=custom 'data.sources=[{prefix: data/mine, weight: 1.0}]' data.tokenizer=tokenizer.json "
    "run_dir=runs/mine":
        Run(SMOKE + " model.vocab_size=512", before=PREPARED),  # the test's tokenizer has 320 ids; tiny has 258
    "bash launch/train_single_node.sh recipe=proxy-curriculum": Run(PROXY + " run_dir=runs/proxy-curriculum",
                                                                     env="MAX_RESTARTS=0"),
    "sbatch --nodes 4 launch/train.sbatch recipe=proxy-curriculum run_dir=/shared/runs/proxy":
        NotRun("needs SLURM (test_the_sbatch_script_and_the_gpu_checks_parse checks its syntax)"),
    "bash .ci/run": NotRun("installs packages, then runs this suite"),
    # data/README.md
    "moe-lc prepare-data docs/*.txt more.jsonl.gz some_dir/ --output-prefix /data/mycorpus/train "
    "--tokenizer path/to/tokenizer.json":
        Run(command="moe-lc prepare-data docs/*.txt more.jsonl.gz some_dir/ --output-prefix mycorpus/train "
                    "--tokenizer tokenizer.json"),
    "data/prepare_corpus.sh /data/mix path/to/tokenizer.json web=/raw/web code=/raw/code.jsonl":
        Run(command="data/prepare_corpus.sh mix tokenizer.json web=some_dir code=corpus/a.jsonl"),
    # docs/training.md (a synopsis: each form with its placeholders filled)
    "moe-lc train [recipe=NAME] [key=value ...]": Run(SMOKE, command="moe-lc train recipe=smoke run_dir=runs/synopsis"),
    "moe-lc train --list | --cfg | --help": Run(command="moe-lc train --list && moe-lc train --cfg && moe-lc train --help"),
    # every stage of the launch script's 2-rank example splits over its ranks (its run below is one step)
    "moe-lc plan NAME [key=value ...]": Run(command="moe-lc plan smoke layout=dp2 "
                                                    "curriculum.stages.ctx16k.global_batch_tokens=32768"),
    "moe-lc bench NAME [key=value ...] [--profile]": NotRun("the synopsis; moe-lc bench proxy-8k --steps 10 --profile runs it"),
    "moe-lc report RUN_DIR [--out DIR]": Run(command="moe-lc report runs/smoke --out report-copy", before=SMOKE_RUN),
    "moe-lc plan NAME --gpus 1024 --gpu-memory 141": Run(command="moe-lc plan proxy-8k --gpus 1024 --gpu-memory 141"),
    # README.md, docs/parallelism.md: the planner's search
    "moe-lc plan k3-8k --gpus 1024 --gpu-memory 141": Run(),
    "moe-lc plan k3-small-8k model.d_model=2560 model.num_layers=16 model.kda.num_heads=20 model.mla.num_heads=20 "
    "model.moe.latent_dim=1280 model.moe.expert_hidden=1120 model.moe.dense_hidden=6720 "
    "curriculum.stages.ctx8k.micro_batch=1": Run(),
    "moe-lc plan RECIPE [key=value ...] --gpus N [--gpu-memory G] [--gpu h100|h200] [--gpus-per-node 8]":
        Run(command="moe-lc plan proxy-8k optim.lr=1e-3 --gpus 16 --gpu-memory 80 --gpu h100 --gpus-per-node 8 "
                    "--interconnect ib400 --margin 0.1 --runners-up 3"),
    # docs/testing.md
    "python3 -m pytest -q -n 2 --dist loadfile tests": NotRun("this suite"),
    "python -m pytest -q -n 14 tests": NotRun("this suite, spread over processes on a GPU machine", needs="GPU"),
    "python3 -m pytest -q tests/test_reference_layers.py tests/test_reference_model.py": NotRun("part of this suite"),
    # docs/performance.md §12.11: compiles for sm_90 on this CPU (tests/test_sass_audit.py runs part of it)
    "python benchmarks/sass_audit.py": Run(command=f"cd {REPO} && env -u TRITON_INTERPRET python "
                                                   "benchmarks/sass_audit.py --ops sort"),
    "python3 tests/mutation/mutate.py --check": Run(command=f"cd {REPO} && python3 tests/mutation/mutate.py --check"),
    **{c: NotRun("runs test files once per mutant (minutes to ~20 min); --check above runs the same program") for c in (
        "python3 tests/mutation/mutate.py",
        "python3 tests/mutation/mutate.py --only router-softmax mla-scale-dropped",
        "python3 tests/mutation/mutate.py --only situ-betas-swapped --tests tests/test_model.py",
    )},
    # docs/performance.md: kernel and layer benchmarks
    **{c: NotRun("GPU benchmarks (Triton kernels, CUDA timing)", needs="GPU") for c in (
        "python benchmarks/bench_kda.py --out results/",
        "python benchmarks/bench_kda.py --no-torch --no-check --shapes B8_T4K,B2_T16K,B1_T64K,B1_T256K,varlen_64K,B2_T8K_H64",
        "python benchmarks/bench_kda.py --no-check --variants 'ktile_stages=2;vside_warps=8'",
        "python benchmarks/bench_kda.py --no-check --seg-sweep --seg-shapes varlen_64K,B2_T16K,B1_T64K",
        "python benchmarks/profile_kda.py --impls ours,fla",
        "python benchmarks/bench_layer.py --profile 15",
        "python benchmarks/bench_attention.py --out results/",
        "python benchmarks/bench_attention.py --quick",
        "python benchmarks/bench_grad_accumulation.py",
        "python benchmarks/bench_short_conv.py",
        "python benchmarks/bench_short_conv.py --shapes kda_qkv_B1_T16K_C6144_docs --tuning 'fwd_bt=128;bwd_bt=64'",
        "python benchmarks/bench_expert_gemms.py --batched --tokens 16384",
        'python benchmarks/bench_short_conv.py --tuning "fused_bwd=0;rows=1,fwd_bc=256,fwd_warps=2,bwd_bc=256,'
        'bwd_warps=2,fused_bwd=0;;rows=1,fwd_bc=256,fwd_warps=2,fused_bc=256,fused_warps=2;fused_bc=64"',
        "python benchmarks/bench_attention.py --heads 16 --shapes T8K_docs2,T8K_docs8,T64K_docs24,T64K_docs64,"
        "T64K_docs256 --variants varlen,padded --fresh 4",
        "python benchmarks/bench_attention.py --heads 16 --shapes T64K_docs24,T64K_docs256,T8K_single --variants "
        "loop,varlen --fresh 4",
        "TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 python benchmarks/bench_attention.py ...",
    )},
    # docs/performance.md: the whole step
    **{c: NotRun("whole-step GPU measurements (a CPU step of these models takes minutes)", needs="GPU") for c in (
        "moe-lc bench k3-small-8k --steps 3 --warmup 3 --trace DIR",
        "moe-lc bench k3-small-8k --steps 4 --warmup 3 --trace DIR",
        "moe-lc bench k3-small-8k model.num_layers=8 --steps 3 --warmup 2 --profile --trace DIR",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --profile "
        "--variant before=@.base --variant onegraph=",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant "
        "onegraph= --variant before=@.base --variant cppw=TORCHINDUCTOR_CPP_WRAPPER=1",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant auto= "
        "--variant scheduled=gc.every=50",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 2 --steps 4 --warmup 2 --variant "
        "two_kernel=MOE_LC_SHORT_CONV_TUNING=fused_bwd=0 --variant now=",
        "moe-lc bench k3-small-8k --steps 4 --warmup 3",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --variant base= --variant "
        "router=model.moe.router_backend=triton --variant conv64=MOE_LC_SHORT_CONV_TUNING=bwd_bt=64 --rounds 2 "
        "--steps 6 --warmup 3",
        "python benchmarks/bench_ab.py k3-small-8k --variant base= --variant conv64=MOE_LC_SHORT_CONV_TUNING=bwd_bt=64 "
        "--rounds 2 --steps 5 --warmup 3",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --variant mla4=model.mla.fused_projections=false "
        "--variant fused= --rounds 2 --steps 6 --warmup 3",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 3 --profile "
        "--variant base= --variant mb1=\"curriculum.stages.ctx8k.micro_batch=1\" --variant d2560mb1=\"model.d_model=2560 "
        "model.kda.num_heads=20 model.mla.num_heads=20 model.moe.latent_dim=1280 model.moe.expert_hidden=1120 "
        "model.moe.dense_hidden=6720 curriculum.stages.ctx8k.micro_batch=1\"",
        "python benchmarks/bench_ab.py proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 --rounds 1 --steps 4 "
        "--warmup 3 --profile --variant mb4= --variant mb1=\"curriculum.stages.ctx8k.micro_batch=1\" "
        "--variant mb2=\"curriculum.stages.ctx8k.micro_batch=2\"",
        "moe-lc bench proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 --steps 4 --warmup 3 --trace DIR",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 3 --variant "
        "before=@.base --variant after=",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 1 --steps 5 --warmup 3 --variant "
        "before=@.base --variant after= --variant expandable=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "python benchmarks/bench_ab.py proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 "
        "curriculum.stages.ctx8k.micro_batch=1 --rounds 1 --steps 4 --warmup 3 --variant none= --variant "
        "full=\"+curriculum.stages.ctx8k.activation_checkpointing.mode=full\"",
        "moe-lc bench proxy-64k curriculum.stages.ctx64k.global_batch_tokens=65536 --steps 2 --warmup 2 --trace DIR",
        "moe-lc bench proxy-8k compile.enabled=false curriculum.stages.ctx8k.global_batch_tokens=131072 "
        "curriculum.stages.ctx8k.micro_batch=4 --steps 3 --warmup 3",
        "moe-lc bench proxy-8k model=k3-small compile.enabled=false curriculum.stages.ctx8k.global_batch_tokens=65536 "
        "curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "moe-lc bench proxy-8k model=k3-small precision=fp8 compile.enabled=false "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "moe-lc bench proxy-256k compile.enabled=false curriculum.stages.ctx256k.global_batch_tokens=262144 --steps 2 "
        "--warmup 1",
        "moe-lc bench proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 compile.enabled=true --steps 3 "
        "--warmup 3",
        "moe-lc bench proxy-8k model=k3-small precision=fp8 compile.enabled=true "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "moe-lc bench proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 compile.enabled=true --steps 6 "
        "--warmup 5",
        "moe-lc bench proxy-8k curriculum.stages.ctx8k.global_batch_tokens=131072 compile.enabled=false --steps 5 "
        "--warmup 3",
        "moe-lc bench proxy-8k model=k3-small compile.enabled=true curriculum.stages.ctx8k.global_batch_tokens=65536 "
        "curriculum.stages.ctx8k.micro_batch=1 --steps 4 --warmup 2",
        "moe-lc bench proxy-8k model=k3-small compile.enabled=true curriculum.stages.ctx8k.global_batch_tokens=65536 "
        "curriculum.stages.ctx8k.micro_batch=1 --steps 4 --warmup 2 --trace tr",
        "moe-lc bench proxy-8k model=k3-small precision=fp8 compile.enabled=true "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 4 --warmup 2 "
        "--trace tr8",
        "python benchmarks/bench_memory.py --recipe proxy-8k --seq-lens 8192,65536 --policies none,selective,full",
        "python benchmarks/compare_precisions.py --recipe proxy-8k --steps 200 --resume-at 100 --a precision=bf16 "
        "--b precision=fp8 --out results/precisions",
        "python benchmarks/compare_paths.py --recipe proxy-8k --steps 20 "
        "curriculum.stages.ctx8k.global_batch_tokens=16384 curriculum.stages.ctx8k.micro_batch=1",
        "OUT=results/gpu STEP_TIMEOUT=300 bash benchmarks/gpu_checks.sh",
        "moe-lc bench proxy-8k model=k3-small compile.enabled=true compile.targets=[norms,attn_res,float8] "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2 "
        "--profile",
        "moe-lc bench proxy-8k model=k3-small compile.enabled=true compile.targets=[norms,attn_res,float8] "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True moe-lc bench proxy-8k model=k3-small compile.enabled=true "
        "compile.targets=[norms,attn_res,float8] curriculum.stages.ctx8k.global_batch_tokens=65536 "
        "curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True moe-lc bench proxy-8k model=k3-small compile.enabled=true "
        "curriculum.stages.ctx8k.global_batch_tokens=65536 curriculum.stages.ctx8k.micro_batch=1 --steps 3 --warmup 2",
        "python benchmarks/host_time_kda.py",
        "moe-lc bench k3-small-8k --steps 3 --warmup 2",
        "python benchmarks/bench_expert_gemms.py",
        "python benchmarks/bench_expert_gemms.py --stacking --tokens 16384",
        "moe-lc bench k3-small-8k model.kda.fused_projections=false --steps 3 --warmup 2",
        "moe-lc bench k3-small-8k model.kda.fused_projections=false curriculum.stages.ctx8k.micro_batch=1 "
        '"curriculum.stages.ctx8k.activation_checkpointing={mode: none}" --steps 3 --warmup 2',
        "python benchmarks/compare_precisions.py --recipe proxy-8k --steps 200 --a precision=bf16 --b precision=fp8 "
        "--out results/precisions model=k3-small compile.enabled=true curriculum.stages.ctx8k.global_batch_tokens=8192 "
        "curriculum.stages.ctx8k.micro_batch=1",
        "moe-lc bench k3-small-8k --steps 4 --warmup 2",
        "moe-lc bench k3-small-8k model.fp32_embedding=true --steps 4 --warmup 2",
        "python benchmarks/bench_linear_cross_entropy.py",
        "python benchmarks/bench_depth_mixture.py --sources 4,7 "
        '--variants "fwd_block_d=512,bwd_block_d=512;l2_budget=41943040"',
        "python benchmarks/bench_depth_mixture.py --pre-norm --sources 4,7",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 2 --steps 5 --warmup 3 --variant apart= "
        "--variant fused=model.attn_res.fused_norm=true",
        'moe-lc bench k3-small-8k "curriculum.stages.ctx8k.activation_checkpointing={mode: none}" --steps 3 --warmup 2',
        "python benchmarks/bench_depth_mixture.py --pre-norm --no-compile --sources 2,3,4 --rep-ms 60 --variants "
        f'"{DEPTH_MIXTURE_VARIANTS}"',
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 5 --warmup 2 --variant "
        "tiled=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_max_d=0,bwd_resident_max_d=0 --variant "
        "resident=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_max_d=4096,bwd_resident_per_sm=2 --variant "
        "res2rows=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_max_d=4096,bwd_resident_per_sm=2,fwd_resident_rows=2,"
        "bwd_resident_rows=2",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant gb131k= "
        "--variant gb524k=curriculum.stages.ctx8k.global_batch_tokens=524288",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 5 --warmup 2 --variant "
        "no_keys=model.mla.keys_backend=torch --variant after= --variant "
        "bwd_only=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_max_d=0,bwd_resident_per_sm=1",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant base= "
        "--variant wgrad=model.moe.wgrad_backend=triton --variant lce=model.loss_backend=triton --variant "
        "prep_all=MOE_LC_KDA_TUNING=save_prep=all",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant base= "
        '--variant both="model.loss_backend=triton MOE_LC_KDA_TUNING=save_prep=all"',
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant "
        'now=MOE_LC_SHORT_CONV_TUNING=fused_bwd=0 --variant fused= --variant pf="MOE_LC_SHORT_CONV_TUNING=fused_bwd=0 '
        'MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_prefetch=1,bwd_resident_prefetch=1" --variant '
        "both=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_prefetch=1,bwd_resident_prefetch=1",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 1 --steps 4 --warmup 2 --variant "
        'now=MOE_LC_SHORT_CONV_TUNING=fused_bwd=0 --variant r1f="MOE_LC_SHORT_CONV_TUNING=rows=1,fwd_bc=256,fwd_warps=2,'
        'fused_bc=256,fused_warps=2" --variant fb=',
        "python benchmarks/bench_depth_mixture.py --pre-norm --no-compile --sources 2,4,6 --rep-ms 30 --variants "
        '"bwd_resident_maxnreg=128;fwd_resident_per_sm=3,fwd_resident_maxnreg=80;fwd_resident_cols_per_warp=512,'
        "fwd_resident_per_sm=4;bwd_resident_cols_per_warp=512,bwd_resident_per_sm=2;fwd_resident_cols_per_warp=512,"
        'fwd_resident_per_sm=4,bwd_resident_maxnreg=128"',
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 1 --steps 4 --warmup 2 --variant "
        "base=@.base --variant new= --variant newdm=MOE_LC_DEPTH_MIXTURE_TUNING=bwd_resident_maxnreg=128,"
        "fwd_resident_cols_per_warp=512,fwd_resident_per_sm=4",
        "moe-lc bench k3-small-8k model.num_layers=11 --steps 4 --warmup 3 --trace DIR",
        "python benchmarks/bench_expert_gemms.py --orientations --tokens 16384",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 1 --steps 4 --warmup 2 --variant after= "
        "--variant before=@.base --variant dm_bwd_uncapped=MOE_LC_DEPTH_MIXTURE_TUNING=bwd_resident_maxnreg=0,"
        "bwd_resident_per_sm=1",
        'python -m pytest -q tests/test_short_conv.py "tests/test_compile.py::test_a_training_moe_layer_is_one_graph_on_the_gpu"',
        'python benchmarks/bench_short_conv.py --shapes kda_qkv_B1_T16K_C6144_docs --repeats 40 --tuning ";rows=1,fwd_bt=128,'
        'fwd_bc=256,fwd_warps=4;rows=1,fwd_bt=128,fwd_bc=256,fwd_warps=2;fused_bt=64;fused_bc=512,fused_warps=8;"',
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 1 --steps 4 --warmup 2 --variant after= "
        "--variant before=@.base --variant rowsfwd=MOE_LC_SHORT_CONV_TUNING=rows=1,fwd_bt=128,fwd_bc=256,fwd_warps=4",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 2 --steps 4 --warmup 2 --variant after= "
        "--variant old=@.base2",
        "python -m pytest -q tests/test_output_gate.py",
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 2 --steps 4 --warmup 2 --variant after= "
        '--variant nogate="model.kda.gate_backend=torch model.mla.gate_backend=torch"',
        "python benchmarks/bench_ab.py k3-small-8k model.num_layers=11 --rounds 2 --steps 4 --warmup 2 --variant after= "
        "--variant pre=@.base3",
        "moe-lc bench k3-small-8k model.num_layers=11 --steps 3 --warmup 2 --trace DIR",
    )},
    # launch/ comments
    "bash launch/train_single_node.sh recipe=proxy-8k": Run(PROXY + " run_dir=runs/proxy-8k", env="MAX_RESTARTS=0"),
    "NPROC=2 bash launch/train_single_node.sh layout=dp2 curriculum.stages.ctx16k.global_batch_tokens=32768 "
    "run_dir=runs/dp2":
        Run(SMOKE_DP2, env="MAX_RESTARTS=0"),
    "MASTER_ADDR=node001 NNODES=4 NODE_RANK=0 bash launch/train_multi_node.sh recipe=proxy-curriculum":
        Run(PROXY + " run_dir=runs/multi", command="MASTER_ADDR=127.0.0.1 NNODES=1 NODE_RANK=0 bash "
            "launch/train_multi_node.sh recipe=proxy-curriculum", env="GPUS_PER_NODE=1 MAX_RESTARTS=0 MASTER_PORT={port}"),
}


# ----------------------------------------------------------------------------- finding commands


def _is_command(line: str) -> bool:
    words = line.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return bool(words) and (words[0] in PROGRAMS or words[0].endswith(".sh"))


def _without_comment(line: str) -> str:
    lexer = shlex.shlex(line, posix=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return " ".join(lexer)


def _joined(lines: list[str]) -> list[str]:
    """Lines with their backslash continuations joined."""
    out, pending = [], ""
    for line in lines:
        text = line.strip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        out.append(pending + text)
        pending = ""
    return out


def _blocks(path: Path) -> list[tuple[list[str], str]]:
    """The shell code blocks of a markdown file, each with the text just before it."""
    lines, blocks = path.read_text().splitlines(), []
    fence, body, before = None, [], []
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if fence is None:
                fence, body = line[3:].strip(), []
            else:
                if fence in ("bash", "sh", "shell", ""):
                    blocks.append((body, "\n".join(lines[max(0, i - len(body) - 12) : i - len(body)])))
                fence = None
            continue
        if fence is not None:
            body.append(line)
        elif line.startswith("    ") and (before or (i > 0 and not lines[i - 1].strip())):
            before.append(line)
        else:
            if before:
                start = i - len(before)
                blocks.append((before, "\n".join(lines[max(0, start - 12) : start])))
            before = []
    if before:  # a block that ends the file
        start = len(lines) - len(before)
        blocks.append((before, "\n".join(lines[max(0, start - 12) : start])))
    return blocks


def documented_commands() -> dict[str, str]:
    """Command -> the text around it (for markers such as "GPU")."""
    found: dict[str, str] = {}
    for path in DOCS:
        for body, context in _blocks(path):
            for line in _joined(body):
                if line and not line.startswith("#") and _is_command(line):
                    found.setdefault(_without_comment(line), context + "\n" + "\n".join(body))
    for path in LAUNCH:
        comments = [line[1:] for line in path.read_text().splitlines() if line.startswith("#") and not line.startswith("#!")]
        for line in _joined(comments):
            if line.startswith(tuple(PROGRAMS)) or _is_command(line):
                found.setdefault(_without_comment(line), "\n".join(comments))
    return found


def test_every_documented_command_is_checked():
    found = documented_commands()
    assert sorted(set(found) - set(COMMANDS)) == [], "commands in the docs without a check in COMMANDS"
    assert sorted(set(COMMANDS) - set(found)) == [], "COMMANDS entries no longer in the docs"


def test_commands_that_are_not_run_here_say_why_in_the_docs():
    found = documented_commands()
    for command, how in COMMANDS.items():
        if isinstance(how, NotRun) and how.needs is not None:
            assert how.needs in found[command], (command, how.needs)


def test_the_sbatch_script_and_the_gpu_checks_parse():
    for script in (REPO / "launch" / "train.sbatch", REPO / "benchmarks" / "gpu_checks.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)


# ----------------------------------------------------------------------------- running them


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A working directory with the repo's scripts, a small corpus and a tokenizer.json."""
    from test_data_prepare import make_bpe_tokenizer

    work = tmp_path_factory.mktemp("docs")
    (work / "launch").symlink_to(REPO / "launch")
    (work / "data").mkdir()
    (work / "data" / "prepare_corpus.sh").symlink_to(REPO / "data" / "prepare_corpus.sh")
    make_bpe_tokenizer(work / "tokenizer.json")
    text = "def f(x):\n    return x + 1\n" * 400
    for d in ("corpus", "docs", "some_dir"):
        (work / d).mkdir()
    (work / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(40)))
    (work / "docs" / "a.txt").write_text(text)
    (work / "some_dir" / "b.txt").write_text(text[::-1])
    with gzip.open(work / "more.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": text}) + "\n")
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNS = [(c, how) for c, how in COMMANDS.items() if isinstance(how, Run)]


@pytest.mark.parametrize("command, how", RUNS, ids=[c[:60] for c, _ in RUNS])
def test_a_documented_command_runs(command, how, scratch, tmp_path_factory):
    line = how.command or command
    if how.extra:  # after the last command of a && chain
        line = f"{line} {how.extra}"
    env_prefix = how.env.format(port=_free_port())
    env = {**os.environ, "MOE_LC_CACHE": str(tmp_path_factory.getbasetemp() / "moe_lc_cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if how.before:
        line = f"{how.before}; {line}"
    script = f"set -e; export {env_prefix}; {line}" if env_prefix else f"set -e; {line}"
    proc = subprocess.run(["bash", "-c", script], cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
