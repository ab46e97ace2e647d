"""The decode attention of one step, XLA's two products against the kernel (`ops.attention_decode`), on a GPU.

One attention layer at the models' shapes (Qwen3.5-4B: 16 query heads, 4 KV heads, head_dim 256;
Nemotron-3-Nano-4B: 32, 8, 128), bf16 queries and KV cache of `--max-len` positions, each row live to
`--live` of them (a decode loop's cache is allocated for the whole generation and filled as it goes):
`ops.attention_decode` on backend "xla" (the attention layers' math: masked scores over all max_len
positions, XLA's products) and on "pallas" (one launch over the live positions; flash decoding's parts
where the rows are few). Per layer step: the wall time (bench/kernels.py's timing: an unrolled, donated
cycle of 16 steps over enough caches to exceed the L2, at most 16, each step's queries the step before's
output, as layers follow each other), with --profile the traced kernels, and the bytes of the live
positions (K and V, the queries and outputs) at the device's copy bandwidth measured in the run. Both
forms are first checked against each other (within bf16 rounding).

Usage (GPU): python3 bench/attention.py [--batches 1,64,256,512] [--max-len 192] [--live 160]
                 [--tilings 32:8:2,64:4:2] [--profile] [--out DIR]
             python3 bench/attention.py --dry-run   (CPU: interpret mode, numbers meaningless)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_args  # noqa: E402
import device_rates  # noqa: E402
import kernels as kb  # noqa: E402

from replayssm_jax import kernels, ops  # noqa: E402

SHAPES = {"qwen3.5-4b": (16, 4, 256), "nemotron3-nano-4b": (32, 8, 128)}  # (query heads, KV heads, head_dim)
STEPS = 16
TOLERANCE = 2e-2  # bf16: the probabilities rounded in another place (tests/test_attention_decode.py)


def make(shape: str, batch: int, max_len: int, live: int, rng):
    """(cache, q): a bf16 KV cache (k, v [batch, max_len, HK, D], every row live to `live`) and queries."""
    HQ, HK, D = SHAPES[shape]

    def normal(dims):
        return jnp.asarray(rng.standard_normal(dims), jnp.bfloat16)

    cache = (normal((batch, max_len, HK, D)), normal((batch, max_len, HK, D)), jnp.full((batch,), live, jnp.int32))
    return cache, normal((batch, HQ, D))


def check(cache, q, backend: str, config=None) -> dict:
    """The kernel's output (with `config`) against XLA's: the largest difference, relative to the outputs' scale."""
    got = ops.attention_decode(q, *cache, backend=backend, config=config).astype(jnp.float32)
    want = ops.attention_decode(q, *cache, backend="xla").astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)))
    scale = max(float(jnp.max(jnp.abs(want))), 1.0)
    return dict(max_abs_err=err, ok=err <= TOLERANCE * scale)


def bytes_per_step(batch: int, shape: str, positions: int) -> int:
    """Traffic model (bf16): K and V of `positions` positions a row, the queries read and the outputs written."""
    HQ, HK, D = SHAPES[shape]
    return 2 * batch * D * (2 * positions * HK + 2 * HQ)


def parse_tilings(text: str) -> list[tuple[int, int, int]]:
    """"BT:WARPS:STAGES,..." -> [(positions per block, num_warps, num_stages), ...] (argparse type)."""
    try:
        tilings = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]
    except ValueError:
        tilings = [()]
    if any(len(t) != 3 for t in tilings):
        raise argparse.ArgumentTypeError(f"expected BT:WARPS:STAGES[,...] (e.g. 32:8:2); got {text!r}")
    return tilings


def variants(kernel: str, tilings, batch: int, shape: str, max_len: int) -> list[tuple[str, str, object]]:
    """(key, backend, config) of each timed form: XLA's products, the kernel's default tiling, and each of
    `tilings` (with the default's parts)."""
    HQ, HK, D = SHAPES[shape]
    default = kernels.default_attention_config(batch, HK, max_len, D)
    extra = [kernels.AttentionConfig(block_v=bt, num_warps=w, num_stages=st, parts=default.parts)
             for bt, w, st in tilings]
    return [("xla", "xla", None), (kernel, kernel, None)] + [(f"{kernel} {c.tag()}", kernel, c) for c in extra]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=bench_args.positive_ints, default="1,64,256,512")
    p.add_argument("--max-len", type=bench_args.positive_int, default=192, help="cache positions (prompt + new)")
    p.add_argument("--live", type=bench_args.positive_int, default=160, help="live positions of every row")
    p.add_argument("--repeats", type=bench_args.positive_int, default=7)
    p.add_argument("--tilings", type=parse_tilings, default=[],
                   help="kernel tilings timed besides the default, BT:WARPS:STAGES,... (positions per block, warps, "
                        "pipelining stages; the default's parts)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU: interpret mode, batch 2, 40 positions, 2 steps")
    args = p.parse_args(argv)
    steps, max_len, live = STEPS, args.max_len, args.live
    if args.dry_run:
        options, batches, kernel = kb.TimingOptions.dry_run(profile=args.profile), [2], "interpret"
        steps, max_len, live = 2, 40, 33
    else:
        if jax.default_backend() != "gpu":
            sys.exit("bench/attention.py needs a GPU (or --dry-run)")
        options = kb.TimingOptions(repeats=args.repeats, profile=args.profile, max_sets=16)
        batches, kernel = args.batches, "pallas"
    if live > max_len:
        sys.exit(f"--live ({live}) must be <= --max-len ({max_len})")
    out = args.out or (tempfile.mkdtemp(prefix="attention_dry_run_") if args.dry_run else kb.results_folder("attention"))
    os.makedirs(out, exist_ok=True)
    copy_bw = max(device_rates.copy_bandwidth(nbytes=(1 << 20) if args.dry_run else (2 << 30)).values())
    rng = np.random.default_rng(0)
    rows = []
    for shape in SHAPES:
        for batch in batches:
            cache, q = make(shape, batch, max_len, live, rng)
            forms = variants(kernel, args.tilings, batch, shape, max_len)
            checks = {key: check(cache, q, backend, config) for key, backend, config in forms[1:]}
            chk = dict(ok=all(c["ok"] for c in checks.values()),
                       max_abs_err=max(c["max_abs_err"] for c in checks.values()))
            row = dict(shape=shape, batch=batch, max_len=max_len, live=live, check=chk)
            rows.append(row)
            if not chk["ok"]:
                print(f"FAILED check {shape} b{batch}: {checks}", flush=True)
                continue
            per = sum(a.nbytes for a in cache)
            sets = int(min(options.max_sets, max(options.min_sets, -(-options.l2_target_bytes // per))))
            for key, backend, config in forms:
                caches = tuple(make(shape, batch, max_len, live, rng)[0] for _ in range(sets))  # donated per form

                def step(c, q, backend=backend, config=config):
                    return ops.attention_decode(q, *c, backend=backend, config=config), c

                t, spread, compile_s, profile = kb.time_cycle(step, caches, q, steps, options, chain=True)
                nbytes = bytes_per_step(batch, shape, live if backend != "xla" else max_len)
                row[key] = dict(us=t * 1e6, spread_us=spread * 1e6, compile_s=compile_s, sets=sets, bytes=nbytes,
                                at_copy_us=nbytes / copy_bw / 1e3, kernels_us=profile)
                print(f"{shape:18s} b{batch:<4d} {key:28s} {t * 1e6:8.2f} us  (its bytes at the copy rate "
                      f"{nbytes / copy_bw / 1e3:6.2f} us)", flush=True)
                kb.print_kernel_times(profile)
    print(f"\nmax_len {max_len}, live {live}; bytes: XLA's of max_len positions, the kernel's of the live ones")
    status = kb.report_against_xla(out, "attention", rows, options, copy_bw, argv, kernel)
    if args.tilings:
        print("\n| shape | batch | tiling | kernel us | XLA / kernel |\n|---|---|---|---|---|")
        for r in rows:
            for key in (k for k in r if k.startswith(f"{kernel} ")):
                print(f"| {r['shape']} | {r['batch']} | {key.split()[1]} | {r[key]['us']:.2f} | "
                      f"{r['xla']['us'] / r[key]['us']:.2f} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
