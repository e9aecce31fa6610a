"""The fast GPU paths against the plain (reference) path over the first training steps of a recipe.

Trains the recipe's first stage twice from the same seed on the same batches, on one GPU:

- fast: every op on its "auto" backend (grouped expert GEMMs, fused SiTU, the KDA and short-conv
  Triton kernels, attention over the packed documents on its "auto" backend), compiled as the recipe's
  ``compile:`` says (the proxy recipes' ``auto``: compiled on one GPU; ``compile.enabled=false``
  compares the eager fast path);
- plain: every op on its PyTorch reference ("torch": the per-expert loop, SiTU in PyTorch, the
  chunked KDA in PyTorch, one SDPA per document, with cuDNN's SDPA off so that new document
  lengths do not each build a plan, the AttnRes mixture in PyTorch, the LM loss in checkpointed
  chunks), every projection of a layer's input as its own GEMM, the embedding kept fp32 in the
  stream (``fp32_embedding``), never compiled.

and prints the two loss curves and their relative difference per step. Both run in bf16 under
autocast, so they differ by bf16 rounding in different places; the check is that the difference
stays at that level (``--tolerance``, relative, 2e-2 by default: a few bf16 eps accumulated over
the steps) and does not grow into a different trajectory.

    python benchmarks/compare_paths.py --recipe proxy-8k --steps 20 \\
        curriculum.stages.ctx8k.global_batch_tokens=32768 [--out paths.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time

import torch

import moe_lc.ops.attention as attention
from moe_lc.model.ffn import GatedFFN
from moe_lc.model.moe import RoutedExperts
from moe_lc.train.curriculum import plan_curriculum, total_steps
from moe_lc.train.data import build_stage_data
from moe_lc.train.model_setup import build_model_state
from moe_lc.train.recipes import compose_recipe, recipes_dir, split_recipe_args
from moe_lc.train.runtime import init_runtime
from moe_lc.train.step import run_steps


@contextlib.contextmanager
def plain_attention():
    """Attention on its reference loop (module constants of moe_lc.ops.attention), cuDNN SDPA off."""
    orders = attention.CUDA_ORDER_DOCUMENTS, attention.CUDA_ORDER_NO_DOCUMENTS
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    attention.CUDA_ORDER_DOCUMENTS = attention.CUDA_ORDER_NO_DOCUMENTS = ("torch",)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        attention.CUDA_ORDER_DOCUMENTS, attention.CUDA_ORDER_NO_DOCUMENTS = orders
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def use_reference_ops(model: torch.nn.Module) -> None:
    """The experts' loop and SiTU in PyTorch wherever the model has them."""
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.backend = m.activation_backend = "torch"
        elif isinstance(m, GatedFFN):
            m.activation_backend = "torch"


def train(cfg, runtime, steps: int, plain: bool) -> tuple[list[float], float]:
    torch.manual_seed(cfg.seed)
    plans = plan_curriculum(cfg, runtime.world_size)
    plan = next(p for p in plans if p.run)
    model_cfg = copy.deepcopy(cfg.model)
    if plain:
        model_cfg.kda.backend = "torch"  # the chunked KDA and the short convolutions in PyTorch
        model_cfg.fp32_embedding = True  # the stream as it was: fp32 mixtures (docs/design.md §7.5)
        model_cfg.attn_res.backend = "torch"  # the depth mixture in PyTorch
        model_cfg.attn_res.fused_norm = False  # its pre-norms in their own calls (implied by the above)
        model_cfg.fused_loss = False  # the LM loss in checkpointed chunks (loss_backend then unused)
        model_cfg.moe.dispatch_backend = "torch"  # the token permutation in PyTorch
        model_cfg.moe.fused_projections = False  # the router, W_down and the shared experts one by one
        model_cfg.kda.fused_projections = False  # KDA's six projections of x one by one
        model_cfg.mla.fused_projections = False  # MLA's four projections of x one by one
        model_cfg.mla.keys_backend = "torch"  # MLA's keys: the split and the concatenation in PyTorch
        model_cfg.mla.gate_backend = model_cfg.kda.gate_backend = "torch"  # the output gates in PyTorch
        model_cfg.moe.router_backend = "torch"  # the router, its statistics and the sort in PyTorch
        model_cfg.moe.wgrad_backend = "torch"  # the experts' weight gradients from autograd, then added
    state = build_model_state(model_cfg, cfg.optim, plan.layout, runtime, cfg.seed, plan.checkpointing, plan.seq_len,
                              compiled=None if plain else cfg.compile)
    if plain:
        use_reference_ops(state.model)
    data = build_stage_data(plan, cfg.data, cfg.model.vocab_size, cfg.seed, sync=runtime.rank0_first)
    losses = []
    t0 = time.perf_counter()
    with plain_attention() if plain else contextlib.nullcontext():
        taken = run_steps(state, data, range(plan.start_step, plan.start_step + steps), 0, total_steps(plans),
                          cfg.optim, runtime)
        with contextlib.closing(taken):
            for k, t in enumerate(taken):
                losses.append(t.result.loss)
                print(f"{'plain' if plain else 'fast'} step {k + 1}/{steps}: loss {t.result.loss:.5f} "
                      f"({t.time_s:.2f} s)", file=sys.stderr, flush=True)
    return losses, (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="proxy-8k")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=2e-2, help="largest relative loss difference accepted")
    ap.add_argument("--out", default=None, help="write both curves as JSON here")
    ap.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = ap.parse_args()
    recipe, rdir, rest = split_recipe_args([f"recipe={args.recipe}", *args.overrides])
    cfg = compose_recipe(recipe, rest, recipes_dir(rdir))
    cfg.max_steps = None
    runtime = init_runtime(cfg.device, cfg.precision, cfg.threads)
    if runtime.device.type != "cuda":
        print("compare_paths: needs a CUDA GPU (on a CPU both paths are the reference)", file=sys.stderr)
        return 2
    fast, fast_s = train(cfg, runtime, args.steps, plain=False)
    torch.cuda.empty_cache()
    plain, plain_s = train(cfg, runtime, args.steps, plain=True)
    rel = [abs(a - b) / abs(b) for a, b in zip(fast, plain)]
    print(f"recipe {args.recipe}, {torch.cuda.get_device_name()}, {args.steps} steps: fast {fast_s:.2f} s/step, "
          f"plain {plain_s:.2f} s/step ({plain_s / fast_s:.1f}x)")
    print(f"{'step':>4} {'fast loss':>10} {'plain loss':>10} {'rel diff':>9}")
    for k, (a, b, r) in enumerate(zip(fast, plain, rel)):
        print(f"{k + 1:>4} {a:>10.5f} {b:>10.5f} {r:>9.2e}")
    worst = max(rel)
    print(f"largest relative difference {worst:.2e} (tolerance {args.tolerance:.0e}): "
          f"{'within' if worst <= args.tolerance else 'OUTSIDE'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(recipe=args.recipe, fast=fast, plain=plain, rel=rel, fast_s=fast_s, plain_s=plain_s), f,
                      indent=1)
    runtime.shutdown()
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
