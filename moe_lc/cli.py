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
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
