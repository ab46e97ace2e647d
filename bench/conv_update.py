"""The conv update of one decode step, its XLA form against its kernel (`ops.conv_update`), on a GPU.

One SSM layer's short causal conv at the models' conv_dim (Qwen3.5-4B's GDN: C = 2 H K + HV V = 8192, no
bias; Nemotron-3-Nano-4B's Mamba-2: C = d_inner + 2 G N = 9728, with bias), W = 4, bf16 inputs and ring,
`CausalConv1d.step` on backend "xla" (a gather of the live columns, the conv, a select over the whole ring)
and on "pallas" (one launch): the step's wall time per layer step (bench/kernels.py's timing: an unrolled,
donated cycle of 16 steps over enough windows to exceed the L2 (at most 16), each step's input the step before's output,
as layers follow each other: XLA fuses the same step of independent windows into one launch), with --profile the traced kernels per step, and the bytes per step of each form at the device's
copy bandwidth measured in the run. Both forms are first checked against each other (y within bf16
rounding, the ring equal).

Usage (GPU): python3 bench/conv_update.py [--batches 1,64,256,512] [--profile] [--out DIR]
             python3 bench/conv_update.py --dry-run   (CPU: interpret mode, numbers meaningless)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_args  # noqa: E402
import device_rates  # noqa: E402
import kernels as kb  # noqa: E402

from replayssm_jax.layers.cache import ConvWindow  # noqa: E402
from replayssm_jax.layers.conv import CausalConv1d  # noqa: E402

SHAPES = {"qwen3.5-4b-gdn": (8192, False), "nemotron3-nano-4b": (9728, True)}
W = 4
STEPS = 16


def make(C: int, bias: bool, batch: int, rng):
    """(conv, window, x): a conv of C channels with random weights (and bias), a bf16 ring of random live
    inputs at random starts, and a step's bf16 inputs."""
    conv = CausalConv1d(C, W, bias=bias, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    if bias:
        conv.bias[...] = jnp.asarray(rng.standard_normal(C), jnp.float32)
    window = ConvWindow.from_conv_state(jnp.asarray(rng.standard_normal((batch, C, W - 1)), jnp.bfloat16))
    window = window.replace(columns=jnp.asarray(rng.standard_normal(window.columns.shape), jnp.bfloat16),
                            start=jnp.asarray(rng.integers(0, window.slots, batch), jnp.int32))
    return conv, window, jnp.asarray(rng.standard_normal((batch, C)), jnp.bfloat16)


def check(conv, window, x, backend: str) -> dict:
    """The kernel's step against the XLA form's: y's largest difference (bf16) and the ring's equality."""
    y_x, w_x = conv.step(x, window, backend="xla")
    y_k, w_k = conv.step(x, window, backend=backend)
    err = float(jnp.max(jnp.abs(y_k.astype(jnp.float32) - y_x.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(y_x.astype(jnp.float32))))
    ring = bool(jnp.array_equal(w_k.columns, w_x.columns)) and bool(jnp.array_equal(w_k.start, w_x.start))
    return dict(max_abs_err=err, ok=ring and err <= 8e-3 * max(scale, 1.0), ring_equal=ring)


def bytes_per_step(batch: int, C: int, S: int, form: str) -> int:
    """Traffic model (bf16): "pallas" reads x and the W - 1 live columns and writes y and one column; "xla"
    reads x and the live columns and writes y, then reads and writes the whole ring (S columns)."""
    column = 2 * batch * C
    return column * ((W - 1) + 1 + 1 + 1) if form == "pallas" else column * ((W - 1) + 1 + 1 + 2 * S)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=bench_args.positive_ints, default="1,64,256,512")
    p.add_argument("--repeats", type=bench_args.positive_int, default=7)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU: interpret mode, batch 2, one repeat, 2 steps")
    args = p.parse_args(argv)
    steps = STEPS
    if args.dry_run:  # interpret mode, two steps a cycle
        options, batches, kernel = kb.TimingOptions.dry_run(profile=args.profile), [2], "interpret"
        steps = 2
    else:
        if jax.default_backend() != "gpu":
            sys.exit("bench/conv_update.py needs a GPU (or --dry-run)")
        # At most 16 windows: a cycle of 16 chained steps over 64 windows at batch 1 compiled, for the XLA
        # form, for over a minute (1024 steps of several fusions each).
        options = kb.TimingOptions(repeats=args.repeats, profile=args.profile, max_sets=16)
        batches, kernel = args.batches, "pallas"
    out = args.out or (tempfile.mkdtemp(prefix="conv_dry_run_") if args.dry_run else kb.results_folder("conv"))
    os.makedirs(out, exist_ok=True)
    copy_bw = max(device_rates.copy_bandwidth(nbytes=(1 << 20) if args.dry_run else (2 << 30)).values())
    rng = np.random.default_rng(0)
    rows = []
    for name, (C, bias) in SHAPES.items():
        for batch in batches:
            conv, window, x = make(C, bias, batch, rng)
            chk = check(conv, window, x, kernel)
            row = dict(shape=name, C=C, batch=batch, check=chk)
            if not chk["ok"]:
                print(f"FAILED check {name} b{batch}: {chk}", flush=True)
                rows.append(row)
                continue
            per = window.columns.nbytes
            sets = int(min(options.max_sets, max(options.min_sets, -(-options.l2_target_bytes // per))))
            for form in ("xla", kernel):
                windows = tuple(make(C, bias, batch, rng)[1] for _ in range(sets))

                def step(w, x, form=form):
                    y, w = conv.step(x, w, backend=form)
                    return y, w

                timing = kb.time_cycle(step, windows, x, steps, options, chain=True)
                row[form] = kb.timed_form(f"{name:18s} b{batch:<4d} {form:9s}", timing,
                                          bytes_per_step(batch, C, window.slots, "xla" if form == "xla" else "pallas"),
                                          sets, copy_bw)
            rows.append(row)
    return kb.report_against_xla(out, "conv_update", rows, options, copy_bw, argv, kernel)

if __name__ == "__main__":
    sys.exit(main())
