"""How far each measured ReplaySSM step is from its bandwidth bound.

Reads a `bench/kernels.py --profile` JSON (the per-kernel GPU times of each
variant) and a `bench/roofline.py` JSON (the read and in-place-update
bandwidth a Pallas kernel attains), and prints, per replay variant:

- the replay kernel's time against its bytes at the read ceiling (it reads
  the checkpoint and the L-slot buffer tiles, writes one record and the output);
- the flush launch's time against its bytes at the update ceiling (per
  step: 1/L of the checkpoint read and written, 1/L of the buffers read);
- the rest of the step (copies and gaps), kept as measured;
- the speedup over the standard step now, and the bound: the standard step's
  time over the step with both kernels at their ceilings.

    python3 bench/bounds.py bench/results/2026-11-30-direct-route/kernels_b256.json \\
        bench/results/2026-11-30-roofline-bounds/roofline.json

Byte counts come from bench/kernels.py's traffic model. The bound is a
bandwidth bound: it fits large batches, where the kernels stream hundreds of
MB per step. Steps whose replay kernel also flushes (`fused_flush`, the
default at batch 1-4) are latency-bound and left out; at small batches the
standard step itself is far from its bandwidth bound, so the ratio of the two
says little there.
"""

from __future__ import annotations

import argparse
import json
import sys

import kernels as kb  # bench/kernels.py: the layer shapes and the traffic model
import numpy as np


def load_rows(path: str, keys: set, script: str) -> list[dict]:
    """The "rows" of a JSON file written by `script`; ValueError naming the file otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and keys <= r.keys() for r in rows):
        raise ValueError(f"{path}: not a {script} JSON (rows with {', '.join(sorted(keys))})")
    return rows


def ceilings(rows: list[dict]) -> dict:
    """{(kind, dtype): best GB/s} over the tilings of a roofline.py JSON's rows."""
    best = {}
    for r in rows:
        key = (r["kind"], r["dtype"])
        best[key] = max(best.get(key, 0.0), r["gbps"])
    if bad := [f"{kind} {dtype}" for (kind, dtype), gbps in best.items() if not gbps > 0]:
        raise ValueError(f"the roofline JSON has no positive bandwidth for {', '.join(bad)}")
    return best


def step_bytes(bench, L: int) -> tuple[float, float]:
    """(replay kernel bytes, flush launch bytes) per step, from the traffic model."""
    read, written = bench.buffer_bytes(L)
    state = bench.state_bytes()
    return state + read + written + bench.io_bytes(), 2 * state / L + read / L


def bound_rows(kernel_rows: list[dict], best: dict) -> list[dict]:
    """One row per profiled two-launch replay variant with a standard step at its shape."""
    rows = [r for r in kernel_rows if r.get("passed") and r.get("kernels_us")]
    standard = {(r["layer"], r["state_dtype"], r["batch"]): r["seconds"] for r in rows if r["L"] is None}
    out = []
    for r in rows:
        key = (r["layer"], r["state_dtype"], r["batch"])
        if r["L"] is None or key not in standard or r.get("route") == "direct":
            continue  # the direct route writes the state every step: the standard step's traffic
        for kind in ("read", "update"):
            if (kind, r["state_dtype"]) not in best:
                raise ValueError(f"the roofline JSON has no {kind} row for {r['state_dtype']}")
        times = {name: t["us"] for name, t in r["kernels_us"].items()}  # GPU us per step, all launches
        if any("_fused" in name for name in times):
            continue  # the replay kernel also flushes: latency-bound, outside this model
        replay = sum(t for name, t in times.items() if "_replay_" in name and "_flush" not in name)
        flush = sum(t for name, t in times.items() if "_flush" in name)
        if not replay or not flush:
            raise ValueError(f"{r['layer']} {r['state_dtype']} batch {r['batch']} L {r['L']}: the profile has no "
                             f"{'replay kernel' if not replay else 'flush launch'} ({', '.join(times)})")
        step = r["seconds"] * 1e6
        replay_bytes, flush_bytes = step_bytes(kb.make_bench(r["layer"], r["batch"], r["state_dtype"], np.random.default_rng(0)), r["L"])
        replay_bound = replay_bytes / best[("read", r["state_dtype"])] / 1e3  # bytes / (GB/s) -> us
        flush_bound = flush_bytes / best[("update", r["state_dtype"])] / 1e3
        other = step - replay - flush
        out.append(dict(layer=r["layer"], state_dtype=r["state_dtype"], batch=r["batch"], L=r["L"],
                        cursors=r["cursors"], replay_us=replay, replay_bound_us=replay_bound, flush_us=flush,
                        flush_bound_us=flush_bound, other_us=other, speedup=standard[key] * 1e6 / step,
                        bound=standard[key] * 1e6 / (replay_bound + flush_bound + other)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernels_json", help="a bench/kernels.py JSON run with --profile")
    p.add_argument("roofline_json", help="a bench/roofline.py JSON")
    args = p.parse_args(argv)
    try:
        kernel_rows = load_rows(args.kernels_json, {"layer", "state_dtype", "batch", "L"}, "bench/kernels.py")
        best = ceilings(load_rows(args.roofline_json, {"kind", "dtype", "gbps"}, "bench/roofline.py"))
        rows = bound_rows(kernel_rows, best)
    except ValueError as e:
        p.error(str(e))
    if not rows:
        p.error(f"{args.kernels_json}: no two-launch replay variant with kernel times "
                "(run bench/kernels.py with --profile at a batch above 4)")
    print("| layer | state | batch | L | cursors | replay kernel us (bound) | flush us (bound) | other us "
          "| speedup | bound |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['state_dtype']} | {r['batch']} | {r['L']} | {r['cursors']} "
              f"| {r['replay_us']:.1f} ({r['replay_bound_us']:.1f}: {100 * r['replay_bound_us'] / r['replay_us']:.0f}%) "
              f"| {r['flush_us']:.1f} ({r['flush_bound_us']:.1f}: {100 * r['flush_bound_us'] / r['flush_us']:.0f}%) "
              f"| {r['other_us']:.1f} | {r['speedup']:.2f}x | {r['bound']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
