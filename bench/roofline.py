"""The HBM bandwidth a Pallas (Triton) kernel attains on this GPU: the ceilings of the decode kernels.

Two streaming kernels over one array of `--mib` MiB, tiled as the decode
kernels tile a state (a program holds `tiles` tiles of [block_v, 128]
elements, one after the other):

- read: each program sums its tiles and writes one number, the traffic of
  the ReplaySSM replay kernel (a read of the checkpoint);
- update: each program scales its tiles in place (aliased), the traffic of
  the standard decode step (the state read and written).

Every kernel's result is checked against NumPy first. It prints GB/s per
kernel and tiling, the best of each kind, and writes JSON (after every row):

    python3 bench/roofline.py --dtypes float32,bfloat16 --configs 64x4x1,64x4x2,16x2x5

On the CPU, `--backend interpret --mib 1` checks the kernels (the timings
then mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import kernels as kb  # noqa: E402  (bench/kernels.py: parse_config)
from replayssm_jax.kernels import ReplayConfig  # noqa: E402
from replayssm_jax.kernels.launch import pallas_call  # noqa: E402
from replayssm_jax.kernels.tiles import load, store  # noqa: E402

COLS = 128  # a state row: K (GDN) or d_state (Mamba-2)


def _tiles(x_ref, config, fn):
    """Run fn(rows) over the program's tiles; returns the f32 sum of fn's results."""

    def body(r, acc):
        return acc + fn(pl.ds(pl.multiple_of(r * config.block_v, config.block_v), config.block_v))

    return jax.lax.fori_loop(0, config.tiles, body, jnp.zeros((), jnp.float32))


def _read_kernel(x_ref, o_ref, *, config):
    o_ref[()] = _tiles(x_ref, config, lambda rows: jnp.sum(load(x_ref.at[rows, :], None)))


def _update_kernel(x_ref, o_ref, *, config):
    def scale(rows):
        store(o_ref.at[rows, :], load(x_ref.at[rows, :], None) * 1.0001, None)
        return jnp.zeros((), jnp.float32)

    _tiles(x_ref, config, scale)


@functools.partial(jax.jit, static_argnames=("kind", "config", "interpret"), donate_argnums=0)
def stream(x, *, kind: str, config: ReplayConfig, interpret: bool = False):
    """One launch over x [programs, block_v * tiles, COLS]: 'read' -> (x, sums f32[programs]),
    'update' -> (x * 1.0001 in place, None)."""
    programs, rows, _ = x.shape
    block = pl.BlockSpec((None, rows, COLS), lambda i: (i, 0, 0))
    call = functools.partial(pallas_call, grid=(programs,), in_specs=[block], interpret=interpret, config=config)
    if kind == "read":
        sums = call(functools.partial(_read_kernel, config=config), out_specs=pl.BlockSpec((None,), lambda i: (i,)),
                    out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32), name=f"read_{config.tag()}")(x)
        return x, sums
    x = call(functools.partial(_update_kernel, config=config), out_specs=block,
             out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0},
             name=f"update_{config.tag()}")(x)
    return x, None


def measure(kind: str, config: ReplayConfig, dtype, mib: int, repeats: int, interpret: bool) -> dict:
    """Median GB/s of `repeats` runs of 10 back-to-back launches, after a checked first launch."""
    rows = config.block_v * config.tiles
    programs = max(1, (mib << 20) // (rows * COLS * jnp.dtype(dtype).itemsize))  # at least one program
    x = jax.random.normal(jax.random.key(0), (programs, rows, COLS), jnp.float32).astype(dtype)
    expected = np.asarray(x, np.float32)
    x, sums = stream(x, kind=kind, config=config, interpret=interpret)
    got = np.asarray(sums if kind == "read" else x, np.float32)
    want = expected.sum(axis=(1, 2)) if kind == "read" else (expected * 1.0001).astype(dtype).astype(np.float32)
    tol = 1e-3 * np.abs(expected).sum(axis=(1, 2)).max() if kind == "read" else 1e-2
    if not np.allclose(got, want, atol=tol, rtol=1e-2):
        raise AssertionError(f"{kind} {config.tag()} {jnp.dtype(dtype).name}: wrong result, "
                             f"max error {np.abs(got - want).max():.3g}")
    nbytes = x.size * x.dtype.itemsize * (1 if kind == "read" else 2)
    times = []
    for _ in range(repeats):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        for _ in range(10):
            x, sums = stream(x, kind=kind, config=config, interpret=interpret)
        jax.block_until_ready((x, sums))
        times.append((time.perf_counter() - t0) / 10)
    seconds = statistics.median(times)
    return dict(kind=kind, config=config.tag(), dtype=jnp.dtype(dtype).name, mib=x.nbytes / (1 << 20),
                programs=programs, us=seconds * 1e6, gbps=nbytes / seconds / 1e9)


DTYPES = ("float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, from {', '.join(DTYPES)}")
    p.add_argument("--configs", default="64x4x1,64x4x2,32x4x1,16x2x5,16x2x1,128x4x1",
                   help="comma-separated BVxWARPSxTILES tilings (bench/kernels.py spec, no flush fields)")
    p.add_argument("--kinds", default="read,update")
    p.add_argument("--mib", type=positive_int, default=512, help="array size (MiB); far above the 50 MiB L2")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--backend", default=None, choices=("pallas", "interpret"),
                   help="default: pallas, which needs a GPU")
    p.add_argument("--out", default=None, help="folder of roofline.json; default: bench/results/DATE-roofline")
    args = p.parse_args(argv)
    try:
        configs = [kb.parse_config(s) for s in args.configs.split(",")]
    except (ValueError, TypeError) as e:
        p.error(f"--configs: {e}")
    if flush := [cfg.tag() for cfg in configs if cfg.fused_flush or cfg.has_flush_tiling]:
        p.error(f"--configs: flush fields mean nothing here (no flush); got {', '.join(flush)}")
    if bad := [k for k in args.kinds.split(",") if k not in ("read", "update")]:
        p.error(f"--kinds: unknown {', '.join(bad)}; choose from read, update")
    if bad := [d for d in args.dtypes.split(",") if d not in DTYPES]:
        p.error(f"--dtypes: unknown {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    if args.backend is None:
        if jax.default_backend() != "gpu":
            p.error(f"the pallas backend needs a GPU (JAX's default backend is {jax.default_backend()!r}); "
                    "on the CPU use --backend interpret --mib 1")
        args.backend = "pallas"
    args.out = args.out or kb.results_folder("roofline")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=str(jax.devices()[0]), jax=jax.__version__, command=" ".join(sys.argv))
    rows = []
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            for config in configs:
                r = measure(kind, config, jnp.dtype(dtype), args.mib, args.repeats, args.backend == "interpret")
                rows.append(r)
                print(f"{kind:6s} {r['dtype']:8s} {r['config']:18s} {r['us']:9.1f} us {r['gbps']:7.0f} GB/s", flush=True)
                with open(os.path.join(args.out, "roofline.json"), "w") as f:  # after every row: a cut run keeps its rows
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("\n| kind | dtype | best tiling | GB/s |\n|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for kind in args.kinds.split(","):
            best = max((r for r in rows if r["kind"] == kind and r["dtype"] == dtype), key=lambda r: r["gbps"])
            print(f"| {kind} | {best['dtype']} | {best['config']} | {best['gbps']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
