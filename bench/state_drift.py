"""The drift study of 8-bit replay checkpoints: how far outputs and logits move from an f32 run.

A replay checkpoint is rounded at every flush (once per L steps) and the
rounding error is carried by the recurrence from then on. Against a run
with a float32 checkpoint, this script measures, for bfloat16, int8 and
float8_e4m3fn checkpoints, round-to-nearest and stochastic rounding, and
buffer lengths L in {8, 16, 32}:

1. Layers: random-weight layers of both types (Mamba-2, GDN) decoding
   random inputs on the replay step's output route, the f32 and the
   rounded run side by side in one `lax.scan`; the relative error
   ||y - y_f32|| / ||y_f32|| of the layer output, averaged over the 32 steps
   up to 256, 1024 and 4096 steps. The decays are slow (log decay about
   -0.02 per step: a memory of ~50 steps, as the long-memory heads of real
   checkpoints), where the rounding error lives longest. The direct route
   (which rounds at every step) is measured too for int8.
2. Fixtures (tests/data/*, the tiny checkpoints): logits of a decode
   teacher-forced on the f32 run's greedy tokens, relative error at the
   same steps (up to the fixture's length), and the greedy-token agreement
   of free-running decodes over 512 tokens (the fraction of positions with
   the f32 run's token, and the first position that differs).

Writes state_drift.json and state_drift.png (layer output error against
steps, per layer type) to --out, and prints the tables. Runs on the CPU
with the xla backend (the layers at the CPU test shapes with --quick, the
fixtures), or on a GPU (the model layer shapes of replayssm_jax.testing at
batch 4, backend pallas); --model-shapes takes the model layer shapes on
the CPU too (the reference's math, which the kernels' tests hold the
kernels to).

Usage:  python3 bench/state_drift.py [--quick] [--out DIR] [--backend xla|pallas] [--model-shapes] [--batch B] [--lengths 8,16,32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_args  # bench/bench_args.py (this folder leads sys.path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after a tree put first on PYTHONPATH, as the other bench scripts

from replayssm_jax import ops  # noqa: E402
from replayssm_jax.testing import GDN_CASES, MAMBA2_CASES  # noqa: E402

f32 = jnp.float32
# (name, checkpoint dtype, rounding, route) of the compared runs.
CONFIGS = [
    ("bf16", jnp.bfloat16, "nearest", "output"),
    ("int8", jnp.int8, "nearest", "output"),
    ("int8-sr", jnp.int8, "stochastic", "output"),
    ("fp8", jnp.float8_e4m3fn, "nearest", "output"),
    ("fp8-sr", jnp.float8_e4m3fn, "stochastic", "output"),
    ("int8-direct", jnp.int8, "nearest", "direct"),
]
FIXTURES = ("nemotron_h_tiny", "mamba2_tiny", "qwen3_5_tiny", "qwen3_next_tiny")
WINDOW = 32  # steps averaged into one error figure


# ---------------------------------------------------------------------------
# Layers


def _layer_inputs(layer: str, shape, key):
    """One step's random inputs of a layer at `shape`, drawn from `key` (slow decays)."""
    ks = jax.random.split(key, 6)
    b = shape.batch
    if layer == "gdn":
        return dict(q=jax.random.normal(ks[0], (b, shape.H, shape.K)), k=jax.random.normal(ks[1], (b, shape.H, shape.K)),
                    v=jax.random.normal(ks[2], (b, shape.HV, shape.V)),
                    g=-jnp.exp(-4.0 + jax.random.normal(ks[3], (b, shape.HV))),
                    beta=jax.nn.sigmoid(jax.random.normal(ks[4], (b, shape.HV))))
    inp = dict(x=jax.random.normal(ks[0], (b, shape.H, shape.P)), dt=jax.random.normal(ks[1], (b, shape.H)),
               B=jax.random.normal(ks[2], (b, shape.G, shape.N)), C=jax.random.normal(ks[3], (b, shape.G, shape.N)))
    if shape.gated:
        inp["z"] = jax.random.normal(ks[4], (b, shape.H, shape.P))
    return inp


def _layer_params(layer: str, shape, key):
    """Fixed layer parameters: Mamba-2 A = -exp(N(-0.25, 0.45)), D, dt_bias = N(-4, 0.5) (dt ~ 0.02); GDN none."""
    if layer == "gdn":
        return {}
    ks = jax.random.split(key, 3)
    return dict(A=-jnp.exp(-0.25 + 0.45 * jax.random.normal(ks[0], (shape.H,))), D=jax.random.normal(ks[1], (shape.H,)),
                dt_bias=-4.0 + 0.5 * jax.random.normal(ks[2], (shape.H,)), dt_limit=shape.dt_limit)


def layer_drift(layer: str, shape, L: int, config, steps: int, backend: str, seed: int = 0) -> np.ndarray:
    """Per-step relative output error f32[steps] of `config` against the f32 checkpoint, one layer."""
    _, dtype, rounding, route = config
    key = jax.random.key(seed)
    params = _layer_params(layer, shape, jax.random.fold_in(key, 1))
    step = getattr(ops, f"{layer}_replay_step")
    init = getattr(ops, f"{layer}_replay_init")
    heads, rows, cols = (shape.HV, shape.V, shape.K) if layer == "gdn" else (shape.H, shape.P, shape.N)
    groups = shape.H if layer == "gdn" else shape.G
    S0 = jnp.zeros((shape.batch, heads, rows, cols), f32)
    ref = init(S0, L, groups)
    test = init(S0, L, groups, checkpoint_dtype=dtype, rounding=rounding)

    def body(carry, t):
        ref, test = carry
        inp = dict(_layer_inputs(layer, shape, jax.random.fold_in(key, t + 2)), **params)
        y_ref, ref = step(ref, **inp, route="output", backend=backend)
        y, test = step(test, **inp, route=route, backend=backend)
        err = jnp.linalg.norm((y - y_ref).astype(f32)) / jnp.maximum(jnp.linalg.norm(y_ref.astype(f32)), 1e-30)
        return (ref, test), err

    run = jax.jit(lambda ref, test: jax.lax.scan(body, (ref, test), jnp.arange(steps))[1])
    return np.asarray(run(ref, test))


def at_steps(errors: np.ndarray, marks) -> dict:
    """The mean error over the WINDOW steps up to each mark (marks past the run are left out)."""
    return {int(m): float(np.mean(errors[max(0, m - WINDOW):m])) for m in marks if m <= len(errors)}


# ---------------------------------------------------------------------------
# Fixtures


def _decode_fns(model, L, backend, dtype, rounding, route, max_len, prompt):
    from flax import nnx

    graphdef, params = nnx.split(model)

    def start():
        m = nnx.merge(graphdef, params)
        return m.prefill(prompt, max_len, replay_buffer_len=L, backend=backend, last_logits_only=True,
                         checkpoint_dtype=dtype, checkpoint_rounding=rounding)

    def forced(cache, tokens):
        m = nnx.merge(graphdef, params)

        def body(cache, token):
            logits, cache = m.decode(token, cache, route=route, backend=backend)
            return cache, logits

        return jax.lax.scan(body, cache, tokens)[1]

    def free(cache, first, n):
        m = nnx.merge(graphdef, params)

        def body(carry, _):
            cache, token = carry
            logits, cache = m.decode(token, cache, route=route, backend=backend)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (cache, nxt), token

        return jax.lax.scan(body, (cache, first), None, length=n)[1]

    return jax.jit(start), jax.jit(forced), jax.jit(free, static_argnums=2)


def fixture_drift(name: str, L: int, configs, tokens: int, marks, backend: str) -> list[dict]:
    """Rows of one fixture: logits error (teacher-forced) and greedy agreement (free-running) per config."""
    from models import load_model

    model = load_model(os.path.join(ROOT, "tests", "data", name))
    prompt = jnp.asarray([[1, 17, 42, 99, 7, 3, 250, 64]], jnp.int32) % model.config.vocab_size
    max_len = prompt.shape[1] + tokens + 1
    start, forced, free = _decode_fns(model, L, backend, None, "nearest", "output", max_len, prompt)
    logits0, cache = start()
    first = jnp.argmax(logits0, axis=-1).astype(jnp.int32)
    greedy = free(cache, first, tokens)  # [tokens, batch]: the f32 run's tokens
    ref_logits = forced(cache, greedy)
    rows = []
    for config in configs:
        cname, dtype, rounding, route = config
        start_q, forced_q, free_q = _decode_fns(model, L, backend, dtype, rounding, route, max_len, prompt)
        _, cache_q = start_q()
        logits = forced_q(cache_q, greedy)
        err = np.asarray(jnp.linalg.norm(logits - ref_logits, axis=-1) / jnp.linalg.norm(ref_logits, axis=-1))[:, 0]
        tokens_q = np.asarray(free_q(cache_q, first, tokens))[:, 0]
        same = tokens_q == np.asarray(greedy)[:, 0]
        differ = np.flatnonzero(~same)
        rows.append(dict(fixture=name, L=L, config=cname, logits_rel_error=at_steps(err, marks),
                         agreement=float(same.mean()), first_difference=int(differ[0]) if differ.size else None,
                         tokens=tokens, bytes_per_sequence=int(cache_q.bytes_per_sequence),
                         f32_bytes_per_sequence=int(cache.bytes_per_sequence)))
    return rows


# ---------------------------------------------------------------------------


def plot(layer_rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    layers = sorted({r["layer"] for r in layer_rows})
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4.5), squeeze=False)
    for ax, layer in zip(axes[0], layers):
        for r in layer_rows:
            if r["layer"] != layer:
                continue
            e = np.asarray([np.nan if v is None else v for v in r["curve"]], float)
            x = np.arange(1, len(e) + 1)
            keep = np.isfinite(e)
            color = f"C{[c[0] for c in CONFIGS].index(r['config'])}"  # a colour per config, a dash per L
            style = {8: ":", 16: "-", 32: "--"}.get(r["L"], "-.")
            ax.loglog(x[keep], np.maximum(e[keep], 1e-12), style, color=color, label=f"{r['config']} L{r['L']}",
                      lw=0.9)
        ax.set_title(f"{layer}: output error against the f32 checkpoint")
        ax.set_xlabel("decode step")
        ax.set_ylabel("relative error (running mean)")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _smooth(e: np.ndarray, points: int = 200) -> list[float]:
    """A running mean over WINDOW steps, sampled at about `points` steps (for the plot)."""
    c = np.cumsum(np.concatenate([[0.0], e]))
    mean = (c[WINDOW:] - c[:-WINDOW]) / WINDOW if len(e) >= WINDOW else np.asarray([e.mean()])
    idx = np.unique(np.geomspace(1, len(mean), points).astype(int) - 1)
    out = np.full(len(e), np.nan)
    out[idx + min(WINDOW, len(e)) - 1] = mean[idx]
    return [None if np.isnan(v) else float(v) for v in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small CPU run: CPU test shapes, 512 layer steps, L 8 and "
                                                        "16; two fixtures, L 16 (or --lengths), 128 tokens")
    p.add_argument("--backend", default=None, choices=bench_args.BACKENDS,
                   help="xla (default on the CPU) or pallas (default on a GPU)")
    p.add_argument("--model-shapes", action="store_true",
                   help="the layers at the model shapes also with backend xla (the default on a GPU)")
    p.add_argument("--lengths", type=bench_args.positive_ints, default=None,
                   help="buffer lengths L of the layers and the fixtures, e.g. 16,32 (default 8,16,32; with "
                        "--quick 8,16 for the layers and 16 for the fixtures)")
    p.add_argument("--batch", type=bench_args.positive_int, default=None,
                   help="rows of the model-shape layers (default 4 on a GPU, else 1)")
    p.add_argument("--out", default=None, help="output folder (default bench/results/DATE-state-drift)")
    args = p.parse_args(argv)
    backend = args.backend or ("pallas" if jax.default_backend() == "gpu" else "xla")
    lengths = args.lengths or ((8, 16) if args.quick else (8, 16, 32))
    steps = 512 if args.quick else 4096
    marks = (64, 256, 512) if args.quick else (256, 1024, 4096)
    tokens = 128 if args.quick else 512
    fixture_marks = (32, 64, 128) if args.quick else marks
    fixtures = FIXTURES[::2] if args.quick else FIXTURES
    fixture_lengths = (16,) if args.quick and args.lengths is None else lengths  # given lengths hold everywhere
    real = backend == "pallas" or args.model_shapes
    batch = args.batch or (4 if backend == "pallas" else 1)
    shapes = {"mamba2": MAMBA2_CASES.model.with_batch(batch) if real else MAMBA2_CASES.cpu[0],
              "gdn": GDN_CASES.model.with_batch(batch) if real else GDN_CASES.cpu[0]}
    out = args.out or os.path.join(ROOT, "bench", "results", f"{datetime.date.today()}-state-drift")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()

    layer_rows = []
    for layer, shape in shapes.items():
        for L in lengths:
            for config in CONFIGS:
                if config[3] == "direct" and L != lengths[-1]:
                    continue  # the direct route rounds every step: its L does not matter
                e = layer_drift(layer, shape, L, config, steps, backend)
                layer_rows.append(dict(layer=layer, shape=str(shape), L=L, config=config[0],
                                       rel_error=at_steps(e, marks), curve=_smooth(e)))
    print(f"layer output error against the f32 checkpoint (mean over {WINDOW} steps up to each step), {backend}:")
    print(f"{'layer':7} {'config':12} {'L':>3} " + " ".join(f"{m:>9}" for m in marks))
    for r in layer_rows:
        print(f"{r['layer']:7} {r['config']:12} {r['L']:>3} "
              + " ".join(f"{r['rel_error'].get(m, float('nan')):9.2e}" for m in marks))

    fixture_rows = []
    for name in fixtures:
        for L in fixture_lengths:
            fixture_rows += fixture_drift(name, L, CONFIGS, tokens, fixture_marks, "xla")
    print(f"\nfixtures: logits error (teacher-forced on the f32 greedy tokens) and greedy agreement over {tokens} "
          "tokens:")
    print(f"{'fixture':16} {'config':12} {'L':>3} " + " ".join(f"{m:>9}" for m in fixture_marks)
          + f" {'agree':>6} {'first':>5} {'B/seq':>7}")
    for r in fixture_rows:
        first = "-" if r["first_difference"] is None else r["first_difference"]
        print(f"{r['fixture']:16} {r['config']:12} {r['L']:>3} "
              + " ".join(f"{r['logits_rel_error'].get(m, float('nan')):9.2e}" for m in fixture_marks)
              + f" {r['agreement']:6.3f} {first:>5} {r['bytes_per_sequence']:>7}")

    result = dict(date=str(datetime.date.today()), device=jax.devices()[0].device_kind, backend=backend,
                  shapes={layer: str(shape) for layer, shape in shapes.items()},
                  jax=jax.__version__, quick=args.quick, steps=steps, marks=list(marks), window=WINDOW,
                  layers=layer_rows, fixtures=fixture_rows, seconds=time.time() - t0)
    with open(os.path.join(out, "state_drift.json"), "w") as f:
        json.dump(result, f, indent=1)
    if plot(layer_rows, os.path.join(out, "state_drift.png")):
        print(f"\nwrote {out}/state_drift.json and state_drift.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
