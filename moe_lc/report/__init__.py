"""`moe-lc report RUN_DIR`: PNG plots and a per-stage summary from a run's metrics.

Reads `metrics.jsonl` (one record per optimizer step) and `eval.jsonl` (one per stage end)
written by the trainer; needs matplotlib (rendered with the non-interactive Agg backend).
"""

from moe_lc.report.load import RunRecords, load_run, stage_summary
from moe_lc.report.render import render_report

__all__ = ["RunRecords", "load_run", "render_report", "stage_summary"]
