"""Where a KDA kernel's instructions come from, without a GPU: compile it for sm_90, disassemble
with source line info, and count SASS instructions per source line, overall and inside each loop.

    python kernels/bench/sass_lines.py --kernel kside [--tuning 'score_prec=tf32x3'] [--top 25]

The key-side backward is bound by how many instructions it issues (ncu, kernels/NOTES.md session 5),
so a static count per warp is a fair proxy for its time: a loop body runs once per key block, and
the loops are listed with their bodies' counts. Inlined helpers report their own lines; Triton's
library functions (tl.sum, tl.cumsum, tl.sigmoid) report the line that called them.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass

from compile_report import SASS_LINE, compile_kernel, cubin_tool, launches

from moe_lc_kernels import kda as kda_mod

LINE_INFO = re.compile(r'//## File "[^"]+", line \d+')
FRAME = re.compile(r'"(?P<file>[^"]+)", line (?P<line>\d+)')
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


@dataclass
class Instruction:
    address: int
    opcode: str
    operands: str
    source: tuple[str, int] | None


def disassemble(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions with their source lines, and label -> address."""
    instructions, labels, pending, source = [], {}, [], None
    for line in text.splitlines():
        if LINE_INFO.search(line):  # innermost frame outside Triton's own library (tl.sum, tl.sigmoid, ...)
            frames = [(f.group("file"), int(f.group("line"))) for f in FRAME.finditer(line)]
            source = next((f for f in frames if "/triton/" not in f[0]), frames[0])
        elif m := LABEL.match(line):
            pending.append(m.group(1))
        elif m := SASS_LINE.match(line):
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append(Instruction(address, m.group(2), m.group(3), source))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) addresses of every backward branch's range, i.e. the loop bodies."""
    found = []
    for ins in instructions:
        if ins.opcode.startswith("BRA") and (m := re.search(r"\.L_x_\d+", ins.operands)):
            target = labels.get(m.group(0))
            if target is not None and target < ins.address:
                found.append((target, ins.address))
    return found


def summary(instructions: list[Instruction], top: int, sources: dict[str, list[str]]) -> list[str]:
    per_line = collections.Counter(ins.source for ins in instructions)
    opcodes = collections.defaultdict(collections.Counter)
    for ins in instructions:
        opcodes[ins.source][ins.opcode.split(".")[0]] += 1
    rows = []
    for source, count in per_line.most_common(top):
        text = ""
        if source is not None:
            lines = sources.setdefault(source[0], open(source[0]).read().splitlines())
            text = lines[source[1] - 1].strip()[:70] if source[1] <= len(lines) else ""
        ops = " ".join(f"{op}:{n}" for op, n in opcodes[source].most_common(4))
        where = f"{source[0].rsplit('/', 1)[-1]}:{source[1]}" if source else "?"
        rows.append(f"{count:6d}  {where:22s} {text:70s} | {ops}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", default="kside", help="prep, scores, inverse, wu, state_fwd, state_bwd, vside, kside, ktile or kgate")
    p.add_argument("--tuning", default="", help="TUNING overrides, 'key=value,...'")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    tuning = {**kda_mod.TUNING, **kda_mod.parse_tuning(args.tuning)}
    compiled, _ = compile_kernel(*launches(tuning)[args.kernel])
    instructions, labels = disassemble(cubin_tool(compiled, "nvdisasm", "--print-line-info-inline", "-c"))
    sources: dict[str, list[str]] = {}
    opcodes = collections.Counter(ins.opcode.split(".")[0] for ins in instructions)
    print(f"{args.kernel} (sm_90, tuning overrides: {args.tuning or 'none'}): {len(instructions)} SASS instructions "
          f"per warp; " + " ".join(f"{op}:{n}" for op, n in opcodes.most_common(12)))
    print(*summary(instructions, args.top, sources), sep="\n")
    for first, last in loops(instructions, labels):
        body = [ins for ins in instructions if first <= ins.address <= last]
        print(f"\nloop {first:#x}-{last:#x}: {len(body)} instructions per iteration")
        print(*summary(body, min(args.top, 12), sources), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
