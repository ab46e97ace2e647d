"""One line per kernel launch from Nsight Compute's text report.

Reads the report that `ncu` prints (its default "details" page) for a run of
bench/profile_step.py, e.g.

    ncu --clock-control none -k regex:replay --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 bench/profile_step.py --layers mamba2 --L 16 > ncu.txt
    python3 bench/ncu_table.py ncu.txt

and prints, per launch: duration, DRAM bandwidth, registers per thread,
theoretical and achieved occupancy, the blocks per SM the registers allow, and
the warp cycles per issued instruction (the sections that were not collected
print '-').
"""

from __future__ import annotations

import argparse
import os
import re
import sys

# (column, metric name, unit) as ncu's sections print them.
COLUMNS = [
    ("us", "Duration", "us"),
    ("DRAM TB/s", "Memory Throughput", "Tbyte/s"),
    ("DRAM %", "DRAM Throughput", "%"),
    ("regs", "Registers Per Thread", "register/thread"),
    ("occ theo %", "Theoretical Occupancy", "%"),
    ("occ ach %", "Achieved Occupancy", "%"),
    ("blk/SM regs", "Block Limit Registers", "block"),
    ("cyc/issue", "Warp Cycles Per Issued Instruction", "cycle"),
]
_HEADER = re.compile(r"^  (\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
_METRIC = re.compile(r"^\s{4}(\S.*?)\s{2,}(\S+)?\s+([-\d,.]+)\s*$")
_UNIT_SCALE = {("Duration", "ms"): ("us", 1e3), ("Duration", "ns"): ("us", 1e-3), ("Duration", "s"): ("us", 1e6),
               ("Memory Throughput", "Gbyte/s"): ("Tbyte/s", 1e-3)}


def parse(text: str) -> list[dict]:
    """[{kernel, grid, block, metrics: {(name, unit): float}}] in report order."""
    launches = []
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            launches.append(dict(kernel=head.group(1), grid=tuple(map(int, head.group(2, 3, 4))),
                                 block=int(head.group(5)), metrics={}))
            continue
        m = _METRIC.match(line)
        if m and launches:
            name, unit, value = m.group(1), m.group(2) or "", m.group(3).replace(",", "")
            try:
                number = float(value)
            except ValueError:
                continue
            unit, scale = _UNIT_SCALE.get((name, unit), (unit, 1.0))
            launches[-1]["metrics"].setdefault((name, unit), number * scale)
    return launches


def table(launches: list[dict]) -> str:
    width = max([len(x["kernel"]) for x in launches] + [6])
    head = f"{'kernel':{width}s} " + " ".join(f"{c:>11s}" for c, _, _ in COLUMNS)
    lines = [head]
    for x in launches:
        cells = []
        for _, name, unit in COLUMNS:
            v = x["metrics"].get((name, unit))
            cells.append(f"{'-' if v is None else f'{v:.4g}':>11s}")
        lines.append(f"{x['kernel']:{width}s} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="text files of ncu's output")
    args = p.parse_args(argv)
    for path in args.reports:
        if not os.path.isfile(path):
            p.error(f"report {path!r}: no such file")
        with open(path) as f:
            launches = parse(f.read())
        if not launches:
            print(f"{path}: no kernel launches found", file=sys.stderr)
            return 1
        print(f"== {path}")
        print(table(launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
