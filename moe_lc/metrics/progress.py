"""Console progress: one live line on a terminal (carriage return), plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Optional, TextIO

BAR_WIDTH = 20


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_rate(tokens_per_s: float) -> str:
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if tokens_per_s >= div:
            return f"{tokens_per_s / div:.1f}{unit}"
    return f"{tokens_per_s:.0f}"


class Progress:
    """`update` after each step; `message` for anything else (it keeps the live line intact).

    mode: "bar" (live line), "lines" (a line every `every` steps), "none" (no step updates), or
    "auto" (bar on a terminal, lines otherwise).
    """

    def __init__(self, total_steps: int, mode: str = "auto", every: int = 1, stream: Optional[TextIO] = None):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.every, self.total = mode, max(1, every), max(1, total_steps)
        self._live = 0  # width of the live line currently shown

    def line(self, step: int, stage: str, loss: float, tokens_per_s: float, eta_s: Optional[float]) -> str:
        done = min(1.0, step / self.total)
        bar = "#" * int(done * BAR_WIDTH) + "-" * (BAR_WIDTH - int(done * BAR_WIDTH))
        return (
            f"[{stage}] step {step}/{self.total} |{bar}| loss {loss:.4f}  "
            f"{format_rate(tokens_per_s)} tok/s  ETA {format_duration(eta_s)}"
        )

    def update(self, step: int, stage: str, loss: float, tokens_per_s: float, eta_s: Optional[float], force: bool = False) -> None:
        """Show step `step` (1-based count of finished steps)."""
        if self.mode == "none":
            return
        text = self.line(step, stage, loss, tokens_per_s, eta_s)
        if self.mode == "bar":
            pad = max(0, self._live - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._live = len(text)
        elif force or step % self.every == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (printed in every mode; "none" only silences the per-step updates)."""
        if self._live:
            self.stream.write("\r" + " " * self._live + "\r")
            self._live = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._live:
            self.stream.write("\n")
            self.stream.flush()
            self._live = 0
