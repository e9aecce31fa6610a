"""The report's plots (matplotlib, Agg backend) and its text summary.

- loss.png: training loss and learning rate over steps, stage boundaries marked;
- throughput.png: median tokens/s per stage (MFU on the bars) and step time over steps;
- expert_load.png: per-layer expert loads relative to the mean (last logged step and the
  average over the run) as heatmaps, and MaxVio over steps per layer;
- loss_by_position.png: stage-end eval loss by position-in-document bucket, one line per
  stage (a falling line = later tokens profit from longer context), passkey accuracy in
  the legend;
- summary.md / summary.json: the per-stage table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from moe_lc.report.load import RunRecords, load_run, stage_summary


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the report needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _mark_stages(ax, run: RunRecords) -> None:
    starts = run.stage_starts()
    for i, (step, name) in enumerate(starts):
        if i > 0:
            ax.axvline(step - 0.5, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(name, xy=(step - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -12),
                    textcoords="offset points", fontsize=8, color="dimgrey")


def plot_loss(run: RunRecords, path: Path) -> Path:
    plt = _pyplot()
    steps = [r["step"] for r in run.steps]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, [r["loss"] for r in run.steps], marker="." if len(steps) < 60 else None, label="train loss")
    evals = [e for e in run.evals if e.get("loss") is not None]
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "s", color="C3", label="stage-end eval loss")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    _mark_stages(ax, run)
    ax_lr.plot(steps, [r["lr"] for r in run.steps], color="C2")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(f"{run.run_dir.name}: loss over the curriculum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(run: RunRecords, summary: list[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, (ax_bar, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    names = [s["stage"] for s in summary]
    rates = [s["tokens_per_s"] for s in summary]
    bars = ax_bar.bar(names, rates, color="C0")
    for bar, s in zip(bars, summary):
        label = f"seq {s['seq_len']}" + (f"\nMFU {s['mfu']:.1%}" if s["mfu"] is not None else "")
        ax_bar.annotate(label, xy=(bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
    ax_bar.set_ylabel("tokens/s (median over the stage's steps)")
    ax_bar.set_title("throughput per stage")
    ax_bar.margins(y=0.2)
    ax_t.plot([r["step"] for r in run.steps], [r["step_time_s"] for r in run.steps], marker=".")
    ax_t.set_xlabel("optimizer step")
    ax_t.set_ylabel("step time (s)")
    ax_t.set_yscale("log")
    ax_t.grid(alpha=0.3)
    _mark_stages(ax_t, run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def relative_loads(loads: list[list[float]]) -> list[list[float]]:
    """Each layer's loads divided by that layer's mean load (1.0 = perfectly balanced)."""
    out = []
    for row in loads:
        mean = sum(row) / len(row) if row else 0.0
        out.append([x / mean if mean else 0.0 for x in row])
    return out


def average_loads(run: RunRecords) -> Optional[list[list[float]]]:
    logged = [r["expert_loads"] for r in run.steps if r.get("expert_loads")]
    if not logged:
        return None
    layers, experts = len(logged[0]), len(logged[0][0])
    return [[sum(rec[i][j] for rec in logged) / len(logged) for j in range(experts)] for i in range(layers)]


def plot_expert_load(run: RunRecords, path: Path) -> Optional[Path]:
    last = next((r for r in reversed(run.steps) if r.get("expert_loads")), None)
    if last is None:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    for ax, (title, loads) in zip(
        axes[:2], ((f"step {last['step']}", last["expert_loads"]), ("average over logged steps", average_loads(run)))
    ):
        rel = relative_loads(loads)
        hi = max(2.0, max(max(r) for r in rel))
        im = ax.imshow(rel, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=hi, interpolation="nearest")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(len(rel)))
        if len(rel[0]) <= 32:
            ax.set_xticks(range(len(rel[0])))
        ax.set_title(f"load / mean load, {title}", fontsize=9)
        fig.colorbar(im, ax=ax)
    ax = axes[2]
    steps = [r["step"] for r in run.steps]
    per_layer = [r.get("maxvio_per_layer") or [] for r in run.steps]
    n_layers = max((len(v) for v in per_layer), default=0)
    for i in range(n_layers):
        ax.plot(steps, [v[i] if i < len(v) else float("nan") for v in per_layer], linewidth=1, label=f"layer {i}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MaxVio = (max - mean) / mean load")
    ax.set_title("MaxVio per MoE layer", fontsize=9)
    ax.grid(alpha=0.3)
    if n_layers <= 12:
        ax.legend(fontsize=7)
    _mark_stages(ax, run)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss_by_position(run: RunRecords, path: Path) -> Optional[Path]:
    evals = [e for e in run.evals if e.get("buckets")]
    if not evals:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for e in evals:
        pts = [(b["lo"], b["hi"], b["loss"]) for b in e["buckets"] if b.get("loss") is not None]
        if not pts:
            continue
        centers = [max(1.0, (lo + hi) / 2) for lo, hi, _ in pts]
        label = f"{e['stage']} (seq {e['seq_len']}, step {e['step']})"
        if e.get("passkey_accuracy") is not None:
            label += f", passkey acc {e['passkey_accuracy']:.2f}"
        ax.plot(centers, [p[2] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position inside the document (bucket centre, tokens)")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title("loss by token position at each stage end (long-context use)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_markdown(summary: list[dict[str, Any]]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| stage | seq_len | steps | tokens | tokens/s | MFU | loss first -> last | eval loss | passkey acc | max MaxVio | peak mem GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['stage']} | {s['seq_len']} | {s['steps']} | {s['tokens']} | {s['tokens_per_s']:.0f} | "
            f"{f(s['mfu'], '.2%')} | {s['first_loss']:.3f} -> {s['last_loss']:.3f} | {f(s['eval_loss'], '.3f')} | "
            f"{f(s['passkey_accuracy'], '.2f')} | {s['max_maxvio']:.3f} | {s['peak_memory_gib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def render_report(run_dir: Union[str, Path], out_dir: Optional[Union[str, Path]] = None) -> list[Path]:
    """Write the plots and summary of `run_dir` into `out_dir` (default RUN_DIR/report); returns the PNG paths."""
    run = load_run(run_dir)
    if not run.steps:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no step records yet; train first")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = stage_summary(run)
    paths = [plot_loss(run, out / "loss.png"), plot_throughput(run, summary, out / "throughput.png")]
    for extra in (plot_expert_load(run, out / "expert_load.png"), plot_loss_by_position(run, out / "loss_by_position.png")):
        if extra is not None:
            paths.append(extra)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary))
    return paths
