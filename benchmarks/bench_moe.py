"""Time the proxy preset's LatentMoE layer forward+backward on one GPU, per experts/activation backend.

    python benchmarks/bench_moe.py [--preset proxy] [--tokens 8192] [--out moe.json] [--rep 200]

Variants (the same layer, weights, input and routing; only the backends change):

- ``reference loop``: the per-expert Python loop (``grouped_glu`` backend "torch") and SiTU in PyTorch;
- ``grouped + unfused SiTU``: one ``torch._grouped_mm`` per matrix, SiTU in PyTorch;
- ``grouped + fused SiTU``: the grouped GEMMs and the fused Triton SiTU kernels (what "auto" runs).

The activation backend applies to the routed and the shared experts alike. Timing: forward, and
forward+backward, as a training step runs the layer (train mode, so the balancer accumulates its
statistics), and forward+backward in eval mode (no statistics: the difference is their cost), median of ``triton.testing.do_bench`` (CUDA events when Triton is missing), after
warm-up; peak memory: the most allocated above the resident weights, input and output gradient
during one forward+backward. Correctness: with the routing pinned (two experts forced empty),
each variant's output and gradients against the same layer in float64 (norm-wise relative error;
ok below 4 bf16 eps, about the six bf16 roundings of eps/2 on the way to any of them), and against
the bf16 reference loop. Free memory is filled with NaN before each check, so values that a kernel
never writes show up. Also times SiTU alone on the routed experts' [tokens*k, hidden] activation.
Prints a table; ``--out`` writes everything as JSON. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from moe_lc.model.init import build_model
from moe_lc.model.moe import LatentMoE
from moe_lc.ops.grouped_experts import grouped_unsupported_reason
from moe_lc.ops.situ_glu import situ_glu, triton_unsupported_reason
from moe_lc.presets import get_preset

BF16_EPS = torch.finfo(torch.bfloat16).eps
OK_BOUND = 4 * BF16_EPS
VARIANTS = {  # name: (experts backend, activation backend)
    "reference loop": ("torch", "torch"),
    "grouped + unfused SiTU": ("grouped", "torch"),
    "grouped + fused SiTU": ("grouped", "triton"),
}
EMPTY_EXPERTS = (0, 1)  # forced empty in the correctness pass


@dataclass
class Result:
    name: str
    experts_backend: str
    activation_backend: str
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    fwd_bwd_eval_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    error_vs_float64: dict = field(default_factory=dict)
    diff_vs_reference_loop: dict = field(default_factory=dict)
    ok: Optional[bool] = None
    skipped: Optional[str] = None
    failed: Optional[str] = None


def fail(message: str) -> None:
    print(f"bench_moe: {message}", file=sys.stderr)
    sys.exit(2)


def timer(rep_ms: int) -> Callable[[Callable[[], None]], float]:
    """Median milliseconds of fn: triton.testing.do_bench, or CUDA events after a warm-up."""
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")
    except ImportError:
        def with_events(fn: Callable[[], None]) -> float:
            for _ in range(10):
                fn()
            times = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]

        return with_events


def set_backends(moe: LatentMoE, experts_backend: str, activation_backend: str) -> None:
    moe.experts.backend = experts_backend
    moe.experts.activation_backend = activation_backend
    if moe.shared is not None:
        moe.shared.activation_backend = activation_backend


def why_not(moe: LatentMoE, x: torch.Tensor, experts_backend: str, activation_backend: str) -> Optional[str]:
    """Why a variant cannot run here (the op's own reason), or None."""
    e = moe.experts
    latent = torch.empty(1, e.w_gate.shape[2], device=x.device, dtype=x.dtype)
    if experts_backend == "grouped":
        reason = grouped_unsupported_reason(latent, e.w_gate, e.w_in, e.w_out)
        if reason:
            return reason
    if activation_backend == "triton":
        return triton_unsupported_reason(latent, latent)
    return None


def pinned_routing(moe: LatentMoE, x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's own routing of x with EMPTY_EXPERTS forced out, detached (the same for every variant)."""
    saved = moe.balancer.bias.clone()
    moe.balancer.bias[list(EMPTY_EXPERTS)] = -1e4
    with torch.no_grad():
        _, topk_idx, weights = moe.route(moe.router(x_flat))
    moe.balancer.bias.copy_(saved)
    return topk_idx, weights.detach()


def grads_of(moe: LatentMoE, x: torch.Tensor, dy: torch.Tensor, routing) -> dict[str, torch.Tensor]:
    """Output and gradients of one forward+backward with the routing pinned."""
    topk_idx, weights = routing
    weights = weights.to(torch.float64 if x.dtype == torch.float64 else torch.float32)  # as route returns them
    moe.route = lambda x_flat: (None, topk_idx, weights)
    try:
        moe.zero_grad(set_to_none=True)
        xl = x.detach().clone().requires_grad_(True)
        y = moe(xl)
        y.backward(dy)
    finally:
        del moe.route
    out = {"y": y.detach(), "dx": xl.grad}
    for name, p in moe.named_parameters():
        if p.grad is not None and not name.startswith("router"):
            out["d " + name] = p.grad
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def poison_free_memory() -> None:
    """Fill the caching allocator's free memory with NaN (a block of 1 GiB), then give it back."""
    torch.cuda.synchronize()
    block = torch.full((2**28,), float("nan"), device="cuda")
    del block


def peak_mib(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def time_variant(moe: LatentMoE, x: torch.Tensor, dy: torch.Tensor, bench) -> tuple[float, float, float, float]:
    """Forward, forward+backward (train mode), forward+backward in eval mode (no balancer statistics),
    and the peak memory of a train-mode forward+backward."""

    def forward() -> None:
        moe(x)

    def step() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(dy)

    moe.train()
    step()  # compile / autotune / first allocations outside the timed region
    mem = peak_mib(step)
    fwd, fwd_bwd = bench(forward), bench(step)
    moe.eval()
    fwd_bwd_eval = bench(step)
    moe.train()
    return fwd, fwd_bwd, fwd_bwd_eval, mem


def profile(moe: LatentMoE, x: torch.Tensor, dy: torch.Tensor, rows: int) -> str:
    """The ``rows`` ops with the most CUDA time over 5 train-mode forward+backward steps."""
    def step() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(dy)

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def time_situ(shape: tuple[int, int], bench) -> dict:
    """SiTU alone, forward and forward+backward, per backend, on a [tokens*k, hidden] bf16 activation."""
    a = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 10).requires_grad_(True)  # c reaches b2's bend
    dh = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    nbytes = a.numel() * a.element_size()
    out = {"shape": list(shape)}
    for backend in ("torch", "triton"):
        if backend == "triton" and triton_unsupported_reason(a, c):
            out[backend] = {"skipped": triton_unsupported_reason(a, c)}
            continue

        def step() -> None:
            a.grad = c.grad = None
            situ_glu(a, c, backend=backend).backward(dh)

        fwd = bench(lambda: situ_glu(a, c, backend=backend))
        both = bench(step)
        # fewest bytes: forward reads a, c and writes h; backward reads a, c, dh and writes da, dc
        out[backend] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_GBps": 3 * nbytes / fwd / 1e6,
                        "fwd_bwd_GBps": 8 * nbytes / both / 1e6}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="proxy")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rep", type=int, default=200, help="milliseconds of timed repetitions per measurement")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--profile", type=int, default=0, help="print the N ops with the most CUDA time per variant")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (torch.cuda.is_available() is False); run it on the GPU machine")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        fail(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    cfg = get_preset(args.preset)
    if cfg.moe.num_routed <= max(EMPTY_EXPERTS) + cfg.moe.top_k:
        fail(f"preset {args.preset!r} has too few experts ({cfg.moe.num_routed}) for the pinned routing")
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    moe = model.moe_layers()[0]
    del model
    torch.cuda.empty_cache()
    x = torch.randn(1, args.tokens, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    bench = timer(args.rep)
    m = cfg.moe
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, preset=args.preset, tokens=args.tokens,
                d_model=cfg.d_model, num_routed=m.num_routed, top_k=m.top_k, num_shared=m.num_shared,
                latent_dim=m.latent_dim, expert_hidden=m.expert_hidden, activation=m.activation)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    print(json.dumps(info))

    routing = pinned_routing(moe, x.detach().view(-1, cfg.d_model))
    ref64 = copy.deepcopy(moe).double()
    set_backends(ref64, "torch", "torch")
    want = grads_of(ref64, x.double(), dy.double(), routing)
    del ref64
    torch.cuda.empty_cache()

    results, loop_grads, profiles = [], None, {}
    for name in args.variants.split(","):
        experts_backend, activation_backend = VARIANTS[name]
        res = Result(name, experts_backend, activation_backend)
        results.append(res)
        reason = why_not(moe, x, experts_backend, activation_backend)
        if reason:
            res.skipped = reason
            continue
        set_backends(moe, experts_backend, activation_backend)
        try:
            poison_free_memory()
            got = grads_of(moe, x, dy, routing)
            res.error_vs_float64 = {k: rel(v, want[k]) for k, v in got.items()}
            if name == "reference loop":
                loop_grads = got
            elif loop_grads is not None:
                res.diff_vs_reference_loop = {k: rel(v, loop_grads[k]) for k, v in got.items()}
            res.ok = max(res.error_vs_float64.values()) <= OK_BOUND
            res.fwd_ms, res.fwd_bwd_ms, res.fwd_bwd_eval_ms, res.peak_mib = time_variant(moe, x, dy, bench)
            if args.profile:
                profiles[name] = profile(moe, x, dy, args.profile)
        except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
            res.failed = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        moe.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.empty_cache()

    situ = time_situ((args.tokens * m.top_k, m.expert_hidden), bench)

    print(f"\n{args.preset} LatentMoE layer, {args.tokens} tokens, bf16 ({info['device']})")
    for name, table in profiles.items():
        print(f"\n{name}: the ops with the most CUDA time over 5 forward+backward steps\n{table}")
    print(f"{'variant':<24} {'fwd ms':>8} {'fwd+bwd ms':>11} {'(eval)':>8} {'peak MiB':>9} {'max err vs f64':>15} "
          f"{'max diff vs loop':>17}  check")
    for r in results:
        if r.skipped or r.failed:
            print(f"{r.name:<24} {'skipped: ' + r.skipped if r.skipped else 'FAILED: ' + r.failed}")
            continue
        err = max(r.error_vs_float64.values())
        diff = max(r.diff_vs_reference_loop.values()) if r.diff_vs_reference_loop else float("nan")
        print(f"{r.name:<24} {r.fwd_ms:8.3f} {r.fwd_bwd_ms:11.3f} {r.fwd_bwd_eval_ms:8.3f} {r.peak_mib:9.1f} "
              f"{err:15.3e} {diff:17.3e}  "
              f"{'ok' if r.ok else 'FAIL'} (bound {OK_BOUND:.3e})")
    for backend in ("torch", "triton"):
        s = situ[backend]
        if "skipped" in s:
            print(f"SiTU alone {situ['shape']} {backend}: skipped: {s['skipped']}")
        else:
            print(f"SiTU alone {situ['shape']} {backend:<6}: fwd {s['fwd_ms']:.3f} ms ({s['fwd_GBps']:.0f} GB/s), "
                  f"fwd+bwd {s['fwd_bwd_ms']:.3f} ms ({s['fwd_bwd_GBps']:.0f} GB/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=info, variants=[asdict(r) for r in results], situ_alone=situ), f, indent=1)
        print(f"wrote {args.out}")
    if any(r.ok is False or r.failed for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
