"""The buffer-length study: ReplaySSM decode-step time against L, on a GPU.

For each layer (the Qwen3.5-4B GDN and Nemotron-3-Nano-4B Mamba-2 shapes of
bench/kernels.py), state dtype and batch, the standard step and the
ReplaySSM step at every L are timed over whole flush cycles (rows at
staggered cursors, flushes included) with the method of bench/kernels.py,
after the same-run correctness check of that shape. Beside each time: the
traffic model's bytes per step and the speedup it predicts,

    standard 2|S| + io    against    |S| (1 + 2/L) + L records read + 1 written + io,

so that the gap between model and measurement is visible per L. The best L
per shape is reported, and two plots are written: speedup against L (a
line per batch) and speedup against batch (a line per L).

Usage (GPU):  python3 bench/buffer_length.py [--layers gdn,mamba2] [--batches 1,64,256]
                  [--lengths 1,2,4,8,16,32,64] [--state-dtypes float32,bfloat16]
CPU check of the script: python3 bench/buffer_length.py --dry-run
Writes buffer_length.json and buffer_length_{vs_L,vs_batch}.png to --out
(default bench/results/DATE-buffer-length), again after every batch, so a run
cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile

import jax
import numpy as np

import bench_args
import kernels as kb  # bench/kernels.py: shapes, traffic model, timing


# A dry run times tiny shapes in interpret mode: it checks the script, and its speedups mean nothing.
DRY_RUN_NOTE = "dry run: interpret mode on tiny shapes, the timings and speedups are not measurements"


def predicted_speedup(bench, L) -> float:
    """Standard bytes over ReplaySSM bytes per step, from the traffic model."""
    return kb.standard_bytes(bench) / kb.replay_bytes(bench, L)


def study(layer, shape, state_dtype, batches, lengths, options, rng, log, rows, save):
    """Append the rows of one layer and state dtype to `rows`, timed with `options` (a
    kb.TimingOptions); save() after each batch."""
    for batch in batches:
        bench = kb.make_bench(layer, batch, state_dtype, rng, shape)
        check = kb.check(bench, [L for L in lengths if L <= 32] or lengths[:1], options.backend)
        if not check["ok"]:
            log(f"FAILED correctness {layer} {state_dtype} batch {batch}: {check}")
            rows.append(dict(layer=layer, state_dtype=state_dtype, batch=batch, passed=False, check=check))
            save()
            continue
        std = kb.run_variant(bench, None, None, options)
        for L in lengths:
            r = kb.run_variant(bench, L, "staggered", options)
            row = dict(layer=layer, state_dtype=state_dtype, batch=batch, L=L, passed=True,
                       standard_s=std["seconds"], replay_s=r["seconds"], speedup=std["seconds"] / r["seconds"],
                       predicted=predicted_speedup(bench, L), replay_bytes=r["bytes"], standard_bytes=std["bytes"],
                       replay_gbps=r["gbps"], standard_gbps=std["gbps"], n_sets=r["n_sets"])
            rows.append(row)
            log(f"{layer:7s} {state_dtype:9s} b{batch:<4d} L={L:<3d} standard {std['seconds'] * 1e6:8.2f} us  "
                f"replay {r['seconds'] * 1e6:8.2f} us  x{row['speedup']:.2f} (model x{row['predicted']:.2f})")
        save()


def best_lengths(rows):
    best = {}
    for r in rows:
        if r.get("passed"):
            key = (r["layer"], r["state_dtype"], r["batch"])
            if key not in best or r["speedup"] > best[key]["speedup"]:
                best[key] = r
    return best


def plot(rows, out_dir, note=None):
    """The speedups against L and against batch, one panel per (layer, state dtype); `note` (a dry
    run's warning, or None) heads each figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("passed")]
    shapes = sorted({(r["layer"], r["state_dtype"]) for r in ok})
    paths = {}
    for name, x_key, line_key in (("vs_L", "L", "batch"), ("vs_batch", "batch", "L")):
        fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.8), squeeze=False)
        for ax, (layer, sd) in zip(axes[0], shapes):
            sub = [r for r in ok if r["layer"] == layer and r["state_dtype"] == sd]
            for value in sorted({r[line_key] for r in sub}):
                line = sorted((r for r in sub if r[line_key] == value), key=lambda r: r[x_key])
                ax.plot([r[x_key] for r in line], [r["speedup"] for r in line], marker="o", label=f"{line_key} {value}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{layer}, {sd} state")
            ax.set_xlabel("buffer length L" if x_key == "L" else "batch")
            ax.set_ylabel("ReplaySSM speedup over standard")
            ax.legend(fontsize=7)
        if note:
            fig.suptitle(note, color="firebrick", fontsize=9)
        fig.tight_layout()
        paths[name] = os.path.join(out_dir, f"buffer_length_{name}.png")
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=bench_args.subset_of("gdn", "mamba2"), default="gdn,mamba2")
    p.add_argument("--batches", type=bench_args.positive_ints, default=None, help="default 1,64,256 (--dry-run: 2)")
    p.add_argument("--lengths", type=bench_args.positive_ints, default=None,
                   help="default 1,2,4,8,16,32,64 (--dry-run: 1,2)")
    p.add_argument("--state-dtypes", type=bench_args.subset_of(*(d.name for d in kb.CHECKPOINT_DTYPES)),
                   default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None,
                   help="default: bench/results/DATE-buffer-length (with --dry-run: a new temporary folder)")
    p.add_argument("--dry-run", action="store_true", help="interpret mode on any device, tiny settings")
    args = p.parse_args(argv)
    try:  # the plots at the end: refuse before the study runs, not after
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plots need matplotlib: install the bench extra (pip install -e '.[bench]')")
    batches, lengths = args.batches or [1, 64, 256], args.lengths or [1, 2, 4, 8, 16, 32, 64]
    if max(lengths) > kb.kernels.MAX_BUFFER_LEN:
        p.error(f"argument --lengths: the kernels take L <= {kb.kernels.MAX_BUFFER_LEN}; got {max(lengths)}")
    shapes = {layer: kb.CASE_TABLES[layer].model for layer in ("gdn", "mamba2")}
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="buffer_length_dry_run_") if args.dry_run else kb.results_folder("buffer-length")
    try:
        options = kb.TimingOptions(repeats=args.repeats)
    except ValueError as e:
        p.error(f"--repeats: {e}")
    if args.dry_run:
        options = kb.TimingOptions.dry_run(standard_steps=2)
        shapes = {"gdn": kb.GDNShape(name="tiny-gdn", H=1, HV=2, K=16, V=16),
                  "mamba2": kb.Mamba2Shape(name="tiny-mamba2", H=2, P=8, N=16, G=1)}
        # one batch: the dry run checks the script, not a trend (sizes given still count)
        batches, lengths = args.batches or [2], args.lengths or [1, 2]
    elif jax.default_backend() != "gpu":
        sys.exit(f"bench/buffer_length.py needs a GPU (JAX default backend is {jax.default_backend()!r}); try --dry-run")
    rng = np.random.default_rng(0)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                argv=sys.argv[1:] if argv is None else list(argv), backend=options.backend,
                timing=dataclasses.asdict(options), timings_meaningful=not args.dry_run)
    note = DRY_RUN_NOTE if args.dry_run else None
    if note:
        meta["note"] = note

    def save():
        """JSON and plots of the rows so far: a run cut short keeps what it measured."""
        with open(os.path.join(args.out, "buffer_length.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return plot(rows, args.out, note)

    for layer in args.layers:
        for sd in args.state_dtypes:
            study(layer, shapes[layer], sd, batches, lengths, options, rng, lambda s: print(s, flush=True),
                  rows, save)
    paths = save()
    print(f"\n{meta['date']} {meta['device']}: best L per shape (measured speedup; traffic model's at that L)")
    if note:
        print(f"** {note} **")
    print("| layer | state | batch | best L | speedup | model |")
    print("|---|---|---|---|---|---|")
    for (layer, sd, b), r in sorted(best_lengths(rows).items()):
        print(f"| {layer} | {sd} | {b} | {r['L']} | {r['speedup']:.2f} | {r['predicted']:.2f} |")
    print("plots:", ", ".join(paths.values()))
    print("JSON:", os.path.join(args.out, "buffer_length.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
