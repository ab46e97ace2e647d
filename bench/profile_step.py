"""One launch of each decode kernel at a model shape, for a profiler (GPU).

Runs, once each after compilation, the standard and the ReplaySSM step of the
Qwen3.5-4B GDN layer and of the Nemotron-3-Nano-4B Mamba-2 layer at one batch
(replay rows at staggered cursors, bf16 activations and buffers), so that
Nsight Compute sees exactly one launch per kernel:

    ncu --clock-control none -k regex:"gdn|mamba2" -c 8 \\
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \\
        python3 bench/profile_step.py --batch 256 --state-dtype float32 --L 8

Without a profiler it prints each launch's wall time (one launch, not a benchmark).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import bench_args
import kernels as kb  # bench/kernels.py
import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=bench_args.positive_int, default=256)
    p.add_argument("--state-dtype", default="float32", choices=[d.name for d in kb.CHECKPOINT_DTYPES])
    p.add_argument("--L", type=bench_args.positive_int, default=8)
    p.add_argument("--backend", default="pallas", choices=("pallas", "interpret"),
                   help="pallas (GPU) or interpret (a CPU check of the script)")
    p.add_argument("--layers", type=bench_args.subset_of(*kb.BENCHES), default="gdn,mamba2",
                   help="comma-separated: gdn, mamba2")
    p.add_argument("--configs", default="",
                   help="extra replay configs to profile, as bench/kernels.py --replay-configs, e.g. '32x4x4,16x2x5x2'")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    try:
        extra = [kb.parse_config(spec) for spec in filter(None, args.configs.split(","))]
    except (ValueError, TypeError) as e:
        p.error(f"--configs: {e}")
    layers = args.layers
    if args.backend == "pallas" and jax.default_backend() != "gpu":
        sys.exit(f"bench/profile_step.py --backend pallas needs a GPU (JAX default backend is "
                 f"{jax.default_backend()!r}); try --backend interpret")
    for layer in layers:
        bench = kb.make_bench(layer, args.batch, args.state_dtype, rng)
        inp = jax.tree.map(lambda a: a[0], bench.inputs(1))
        state = bench.state()
        runs = [("standard", jax.jit(lambda s, i: bench.step(s, i, args.backend), donate_argnums=0), state)]
        cursor = np.arange(args.batch) % args.L
        for cfg in [None] + extra:
            rs = bench.replay_init(bench.state(), args.L, bench.dtype, cursor)
            fn = jax.jit(lambda s, i, cfg=cfg: bench.replay_step(s, i, "output", args.backend, cfg), donate_argnums=0)
            runs.append((f"replay L={args.L} {cfg.tag() if cfg else 'default'}", fn, rs))
        for name, fn, carry in runs:
            compiled = fn.lower(carry, inp).compile()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(carry, inp))
            print(f"{bench.layer:7s} {name:28s} one launch {1e6 * (time.perf_counter() - t0):9.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
