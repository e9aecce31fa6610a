#!/usr/bin/env bash
# The GPU-only checks and the whole-step measurements (docs/performance.md §12) in one go, each
# step with its own time limit, so that one machine session yields every number: the GPU tests
# (fast paths against the plain path), `moe-lc bench` of the proxy and of k3-small in bf16 and
# fp8, and the activation memory per policy. Logs, JSON and a summary of exit codes go to $OUT.
#
#   OUT=results/gpu STEP_TIMEOUT=300 bash benchmarks/gpu_checks.sh      # PACK=1: one .tgz of it all
#
# ONLY="gpu_tests compare_paths" runs just the named steps (a machine lent for 10-minute calls).
#
# Needs a CUDA GPU and the project importable (installed, or on PYTHONPATH with moe_lc_kernels and
# moe_lc_recipes); torchao for the fp8 step, pytest-xdist for the tests. `python -m moe_lc.cli` is `moe-lc`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
mkdir -p "$OUT"

step() {
    local name=$1
    shift
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    echo "== $name ($(date +%T))"
    timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

S=curriculum.stages.ctx8k
# the whole suite, GPU-only tests included, spread over TEST_WORKERS processes (pytest-xdist;
# about 5 minutes with 14 on a 16-core H200 machine, docs/testing.md)
step gpu_tests python -m pytest -q -rfEs -p no:cacheprovider -n "${TEST_WORKERS:-14}" tests
# the sublayers' pre-norms in the depth mixture's kernels (attn_res.fused_norm, on by default,
# docs/performance.md §12.16): the kernels' tests, the mixture with its norm apart and fused, and the
# step interleaved with the norms apart at k3-small's layers (8 of 20: an H100 holds it); `compare_paths`
# below checks the losses with it on
step prenorm_tests python -m pytest -q -rfEs -p no:cacheprovider tests/test_depth_mixture.py
step prenorm_kernels python benchmarks/bench_depth_mixture.py --pre-norm --sources 4,7
step ab_prenorm python benchmarks/bench_ab.py k3-small-8k model.num_layers=8 --rounds 2 --steps 5 --warmup 3 \
    --variant apart=model.attn_res.fused_norm=false --variant fused= --out "$OUT/ab_prenorm.json"
# the depth mixture's resident kernels (whole rows in registers, on by default, docs/performance.md
# §12.17, §12.19): the kernels by launch choice, and the step at k3-small's 20 layers (an H200; on an
# H100 add model.num_layers=8) against the forward tiled (its resident forward ran slower in §12.19's trace)
step depth_mixture_kernels python benchmarks/bench_depth_mixture.py --pre-norm --no-compile --sources 2,3,4 \
    --variants "fwd_resident_max_d=0,bwd_resident_max_d=0;fwd_resident_max_d=0"
step ab_depth_mixture python benchmarks/bench_ab.py k3-small-8k --rounds 2 --steps 5 --warmup 3 \
    --variant resident= --variant fwd_tiled=MOE_LC_DEPTH_MIXTURE_TUNING=fwd_resident_max_d=0 \
    --out "$OUT/ab_depth_mixture.json"
# the fused router and counting sort (moe.router_backend, off by default: no faster on an H100 at
# k3-small's layers, docs/performance.md §12.10): their tests, the step interleaved against the
# default on an H200 at all 20 layers, and the losses against the plain path with them on
step router_tests python -m pytest -q -rfEs -p no:cacheprovider tests/test_routing.py tests/test_token_permutation.py \
    tests/test_compile.py
step ab_router python benchmarks/bench_ab.py k3-small-8k --variant base= \
    --variant router=model.moe.router_backend=triton --rounds 2 --steps 5 --warmup 3 --out "$OUT/ab_router.json"
step compare_paths_router python benchmarks/compare_paths.py --recipe proxy-8k --steps 20 \
    curriculum.stages.ctx8k.global_batch_tokens=16384 curriculum.stages.ctx8k.micro_batch=1 \
    +curriculum.stages.ctx8k.activation_checkpointing.kda_states=true model.moe.router_backend=triton \
    --out "$OUT/compare_paths_router.json"
# the short convolution's one-pass backward at 64-row programs (twice the programs, half the steps each)
# in the whole step, interleaved against its default 128 (~8 minutes: STEP_TIMEOUT=580)
step ab_short_conv python benchmarks/bench_ab.py k3-small-8k --variant base= \
    --variant conv64=MOE_LC_SHORT_CONV_TUNING=fused_bt=64 --rounds 2 --steps 5 --warmup 3 --out "$OUT/ab_short_conv.json"
# the short convolution's row kernels (rows carried between steps, unmasked steps inside a document,
# docs/performance.md §8, §12.27): their tests, the kernels at the model's shape by launch choice (the
# default: tile forward, one-pass row backward; the row forward at two widths; the backward at other
# tiles), and the step with the row forward interleaved against the tiles
step short_conv_rows_tests python -m pytest -q -rfEs -p no:cacheprovider tests/test_short_conv.py
step short_conv_rows python benchmarks/bench_short_conv.py --shapes kda_qkv_B1_T16K_C6144_docs --repeats 40 \
    --tuning ";rows=1,fwd_bt=128,fwd_bc=256,fwd_warps=4;rows=1,fwd_bt=128,fwd_bc=256,fwd_warps=2;fused_bt=64;fused_bc=512,fused_warps=8;"
step ab_short_conv_rows python benchmarks/bench_ab.py k3-small-8k --rounds 2 --steps 5 --warmup 3 --variant tiles= \
    --variant rows=MOE_LC_SHORT_CONV_TUNING=rows=1,fwd_bt=128,fwd_bc=256,fwd_warps=4 \
    --out "$OUT/ab_short_conv_rows.json"
# the output gates in one kernel each way (docs/performance.md §12.28): their tests with the compiled
# kernels, the whole step against the reference gates (KDA's norm compiled, MLA's eager), interleaved
step output_gate_tests python -m pytest -q -rfEs -p no:cacheprovider tests/test_output_gate.py
step ab_output_gate python benchmarks/bench_ab.py k3-small-8k --rounds 2 --steps 5 --warmup 3 --variant fused= \
    --variant reference="model.kda.gate_backend=torch model.mla.gate_backend=torch" --out "$OUT/ab_output_gate.json"
# the proxy through the trainer on every GPU here, its stages unedited (one and two GPUs: issue 17)
step train_proxy_8k torchrun --standalone --nproc-per-node "$(python -c 'import torch; print(torch.cuda.device_count())')" \
    -m moe_lc.train recipe=proxy-8k max_steps=20 run_dir="$OUT/run_proxy_8k" eval.sequences=0 eval.passkey_documents=0
# compiled (the proxy recipes' `auto` on one GPU) and eager, same machine; warm-up covers the first
# batch whose KDA documents split into segments (one more Triton compile, docs/performance.md 12.2.1)
step bench_proxy_8k python -m moe_lc.cli bench proxy-8k $S.global_batch_tokens=131072 compile.enabled=true --steps 6 \
    --warmup 5 --profile --json "$OUT/bench_proxy_8k.json"
step bench_proxy_8k_eager python -m moe_lc.cli bench proxy-8k $S.global_batch_tokens=131072 compile.enabled=false \
    --steps 5 --warmup 5 --json "$OUT/bench_proxy_8k_eager.json"
step bench_k3_small python -m moe_lc.cli bench proxy-8k model=k3-small compile.enabled=true $S.global_batch_tokens=65536 \
    $S.micro_batch=1 --steps 4 --warmup 2 --trace "$OUT/trace_k3_small" --json "$OUT/bench_k3_small.json"
step bench_k3_small_fp8 python -m moe_lc.cli bench proxy-8k model=k3-small precision=fp8 compile.enabled=true \
    $S.global_batch_tokens=65536 $S.micro_batch=1 --steps 4 --warmup 2 --json "$OUT/bench_k3_small_fp8.json"
step bench_k3_small_fp8_experts python -m moe_lc.cli bench proxy-8k model=k3-small precision=fp8 float8.experts=true \
    compile.enabled=true $S.global_batch_tokens=65536 $S.micro_batch=1 --steps 4 --warmup 2 --trace "$OUT/trace_k3_fp8x" \
    --json "$OUT/bench_k3_small_fp8_experts.json"
# the KDA layer's host time part by part, with and without kda.fused_projections (docs/performance.md §12.3)
step host_kda python benchmarks/host_time_kda.py
# the k3-small recipe laid out for one H200 (two rows a micro-batch, nothing recomputed; traced: its
# breakdown and where the GPU waits, trace_k3_small_8k/rank0_gaps.txt), with every
# 4th layer checkpointed as before, and
# without the fused KDA projections, and one row a micro-batch as before: the same run's baselines
step bench_k3_small_8k python -m moe_lc.cli bench k3-small-8k --steps 3 --warmup 2 --trace "$OUT/trace_k3_small_8k" \
    --json "$OUT/bench_k3_small_8k.json"
step bench_k3_small_8k_every4 python -m moe_lc.cli bench k3-small-8k "$S.activation_checkpointing={mode: full, every: 4}" \
    --steps 3 --warmup 2 --json "$OUT/bench_k3_small_8k_every4.json"
step bench_k3_small_8k_six_proj python -m moe_lc.cli bench k3-small-8k model.kda.fused_projections=false --steps 3 \
    --warmup 2 --json "$OUT/bench_k3_small_8k_six_proj.json"
step bench_k3_small_8k_one_row python -m moe_lc.cli bench k3-small-8k model.kda.fused_projections=false \
    $S.micro_batch=1 "$S.activation_checkpointing={mode: none}" --steps 3 --warmup 2 \
    --json "$OUT/bench_k3_small_8k_one_row.json"
# the routed experts' grouped GEMMs, bf16 against float8, per GEMM (docs/performance.md §12.3)
step expert_gemms python benchmarks/bench_expert_gemms.py
# each of a MoE layer's six grouped GEMMs as the step runs it and the other way round (docs/performance.md §12.26)
step expert_gemms_orientations python benchmarks/bench_expert_gemms.py --orientations --tokens 16384
# the gate and input GEMMs split or stacked into one (bf16), and the step without the kept KDA states
step expert_gemms_stacking python benchmarks/bench_expert_gemms.py --stacking --tokens 16384
step bench_k3_small_8k_no_kda_states python -m moe_lc.cli bench k3-small-8k $S.activation_checkpointing.kda_states=false \
    --steps 3 --warmup 2 --json "$OUT/bench_k3_small_8k_no_kda_states.json"
# the experts' per-micro-batch weight-gradient sums: torch's two-dtype add against accumulate_ (§12.3)
step grad_accumulation python benchmarks/bench_grad_accumulation.py
# the short convolution's kernels at KDA's stacked q, k, v shape and the older reference shape (§8)
step short_conv python benchmarks/bench_short_conv.py
# the padded per-document cuDNN attention against varlen, long and short documents (§11)
step attention_padded python benchmarks/bench_attention.py --heads 16 --shapes T8K_docs2,T8K_docs8,T64K_docs24,T64K_docs64,T64K_docs256 \
    --variants varlen,padded --fresh 4 --out "$OUT"
# the KDA op with the states kept by the forward: timing against fla, the B=2, T=16K check, the fuzz
step kda_keep_states python benchmarks/bench_kda.py --no-torch --shapes B2_T16K,B8_T4K --check-shapes B2_T16K \
    --fuzz 12 --keep-states --out "$OUT/kda_keep_states"
# the fused LM loss against the checkpointed chunks, and the AttnRes mixture's kernels against the
# reference (eager and compiled) with three other launch choices (the 4-row default before) (docs/performance.md §12.3)
step linear_cross_entropy python benchmarks/bench_linear_cross_entropy.py
step depth_mixture python benchmarks/bench_depth_mixture.py --sources 4,7 \
    --variants "fwd_rows=4,fwd_warps=4,bwd_rows=4,bwd_warps=4;fwd_rows=2,fwd_warps=2,bwd_rows=2,bwd_warps=2;programs=1056"
# the step without the mixture kernels and the fused loss (the compiled reference and the
# checkpointed chunks), and with the fp32 embedding: the same run's baselines
step bench_k3_small_8k_reference_mix_loss python -m moe_lc.cli bench k3-small-8k model.attn_res.backend=torch \
    model.fused_loss=false --steps 3 --warmup 2 --json "$OUT/bench_k3_small_8k_reference_mix_loss.json"
step bench_k3_small_8k_fp32_embedding python -m moe_lc.cli bench k3-small-8k model.fp32_embedding=true --steps 3 \
    --warmup 2 --json "$OUT/bench_k3_small_8k_fp32_embedding.json"
step bench_proxy_256k python -m moe_lc.cli bench proxy-256k curriculum.stages.ctx256k.global_batch_tokens=262144 \
    --steps 2 --warmup 1 --json "$OUT/bench_proxy_256k.json"
step compare_paths python benchmarks/compare_paths.py --recipe proxy-8k --steps 20 $S.global_batch_tokens=16384 \
    $S.micro_batch=1 +$S.activation_checkpointing.kda_states=true --out "$OUT/compare_paths.json"
# FP8 against BF16 over 200 steps of k3-small (one 8K row a step; no resume: its checkpoint is 52 GB),
# and the resume across precisions on the proxy (docs/training.md, "FP8")
step precision_curves python benchmarks/compare_precisions.py --recipe proxy-8k --steps 200 --a precision=bf16 \
    --b precision=fp8 --out "$OUT/precisions" model=k3-small compile.enabled=true $S.global_batch_tokens=8192 \
    $S.micro_batch=1
step precision_resume python benchmarks/compare_precisions.py --recipe proxy-8k --steps 8 --resume-at 4 \
    --resume-steps 2 --a precision=bf16 --b precision=fp8 --window 4 --out "$OUT/precision_resume" \
    $S.global_batch_tokens=32768 compile.enabled=false  # six short launches: no compile in each
step memory python benchmarks/bench_memory.py --recipe proxy-8k --seq-lens 8192,65536,262144 \
    --policies none,selective,full --out "$OUT/memory.json"

# PACK=1: everything in one archive beside the summary (for machines that return only a few files)
if [ -n "${PACK:-}" ]; then
    tar -czf /tmp/gpu_checks.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
        && mv /tmp/gpu_checks.tgz "$OUT/gpu_checks.tgz"
fi
