"""The `moe-lc` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3f}{unit}"
    return f"{n:.0f}"


def cmd_info(args: argparse.Namespace) -> int:
    """Layer pattern, parameters by component, totals and FLOPs per token of a preset."""
    from moe_lc.config import ConfigError
    from moe_lc.model.accounting import count_parameters, training_flops_per_token
    from moe_lc.presets import get_preset

    try:
        cfg = get_preset(args.preset)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rep = count_parameters(cfg)
    flops = training_flops_per_token(cfg, args.seq_len)
    info = {
        "preset": cfg.name,
        "layer_pattern": cfg.pattern,
        "num_layers": cfg.num_layers,
        "kda_layers": cfg.pattern.count("K"),
        "mla_layers": cfg.pattern.count("M"),
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size,
        "total_params": rep.total,
        "active_params": rep.active,
        "params_by_component": dict(rep.by_component),
        "active_params_by_component": dict(rep.active_by_component),
        "seq_len": args.seq_len,
        "train_flops_per_token": flops,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"preset           {cfg.name}")
    print(f"layers           {cfg.num_layers} ({info['kda_layers']} KDA + {info['mla_layers']} MLA)")
    print(f"layer pattern    {cfg.pattern}")
    print(f"d_model          {cfg.d_model}   vocab {cfg.vocab_size} (padded {cfg.padded_vocab_size})")
    print("parameters by component            total        active")
    for name, total in rep.by_component.items():
        print(f"  {name:<28} {_human(total):>10}  {_human(rep.active_by_component[name]):>10}")
    print(f"  {'TOTAL':<28} {_human(rep.total):>10}  {_human(rep.active):>10}")
    print(f"training FLOPs/token at seq_len {args.seq_len}: {flops:.4g}")
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Tokenize text / JSONL files into a Megatron .bin/.idx data source."""
    from moe_lc.data.prepare import prepare_data

    try:
        stats = prepare_data(args.inputs, args.output_prefix, args.tokenizer, args.json_key, args.eod_token)
    except (OSError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(stats.summary())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Validate every stage of a recipe and print its plan, or with --gpus the recommended layouts."""
    from moe_lc.plan.hardware import ClusterRequest
    from moe_lc.train.main import run_plan_cli

    if args.gpus is None:
        given = [flag for flag, value in (("--gpu-memory", args.gpu_memory), ("--gpu", args.gpu)) if value is not None]
        if given:
            print(f"error: {' and '.join(given)} describe a cluster to plan for; give its size with --gpus N",
                  file=sys.stderr)
            return 2
        return run_plan_cli(args.recipe, args.overrides)
    cluster = ClusterRequest(args.gpus, args.gpu_memory, args.gpu, args.gpus_per_node, args.interconnect, args.margin)
    return run_plan_cli(args.recipe, args.overrides, cluster, args.runners_up)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from moe_lc.plan.hardware import DEFAULT_MARGIN, GPUS, NETWORKS

    p.add_argument("recipe", help="a recipe name, e.g. k3-8k (moe-lc train --list shows them)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. layout.tp=4")
    p.add_argument("--gpus", type=int, default=None,
                   help="recommend a layout per stage for this many GPUs (without it: the recipe's own layouts)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU (default: the GPU's datasheet size)")
    p.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help="the GPU's speeds (default: h100 for 80 GiB or less, else h200)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink (default 8)")
    p.add_argument("--interconnect", default="ib400", choices=sorted(NETWORKS),
                   help="the network between nodes, per GPU (default ib400)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"share of the memory to keep free (default {DEFAULT_MARGIN})")
    p.add_argument("--runners-up", type=int, default=3, help="layouts shown after the best (default 3)")


def plan_parser() -> argparse.ArgumentParser:
    """`moe-lc plan`'s own parser: options may follow the recipe and its overrides."""
    p = argparse.ArgumentParser(prog="moe-lc plan", description=cmd_plan.__doc__)
    add_plan_arguments(p)
    return p


def cmd_report(args: argparse.Namespace) -> int:
    """Render a run's plots and per-stage summary to PNG/Markdown."""
    try:
        from moe_lc.report import render_report

        paths = render_report(args.run_dir, args.out)
    except (OSError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    print(path.parent / "summary.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-lc", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter and FLOP accounting of a model preset")
    info.add_argument("preset", help="tiny | proxy | kimi-linear-48b | k3")
    info.add_argument("--seq-len", type=int, default=8192, help="sequence length for FLOPs/token (default 8192)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=cmd_info)
    prep = sub.add_parser("prepare-data", help="tokenize text/JSONL files into Megatron .bin/.idx")
    prep.add_argument("inputs", nargs="+", help="text files (one document each), .jsonl files (one per line), or directories")
    prep.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    prep.add_argument("--tokenizer", default="byte", help="'byte' (default) or a Hugging Face tokenizer.json path")
    prep.add_argument("--json-key", default="text", help="JSONL field holding the text (default: text)")
    prep.add_argument("--eod-token", default=None, help="end-of-document token of a tokenizer.json, if not standard")
    prep.set_defaults(func=cmd_prepare_data)
    # listed for --help only: main() hands everything after `train` to Hydra before argparse sees it
    train = sub.add_parser("train", help="train a recipe: moe-lc train [recipe=NAME] [key=value ...] (Hydra)")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="recipe=NAME and Hydra overrides")
    plan = sub.add_parser("plan", help="validate a recipe and print its plan; with --gpus N the recommended "
                          "layout of every stage")
    add_plan_arguments(plan)  # main() parses `plan` with plan_parser(), which lets options follow the overrides
    plan.set_defaults(func=cmd_plan)
    # listed for --help only: main() hands everything after `bench` to its own parser
    bench = sub.add_parser("bench", help="time a recipe's stage here: tokens/s, MFU, memory, time per component")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="RECIPE [key=value ...] [--steps N] [--warmup W] "
                       "[--stage NAME] [--json PATH] [--profile]")
    report = sub.add_parser("report", help="plots (PNG) and a per-stage summary of a training run")
    report.add_argument("run_dir", help="the run_dir of a `moe-lc train` run (holds metrics.jsonl)")
    report.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # everything after `train` is Hydra's (flags like --cfg included)
        from moe_lc.train.main import run_train_cli

        return run_train_cli(argv[1:])
    if argv and argv[0] == "bench":
        from moe_lc.train.main import run_bench_cli

        return run_bench_cli(argv[1:])
    if argv and argv[0] == "plan":
        return cmd_plan(plan_parser().parse_intermixed_args(argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
