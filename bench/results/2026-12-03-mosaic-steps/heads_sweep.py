# Run 2 of bench/results/2026-12-03-mosaic-steps ran this on an earlier state of ff0e673, whose mamba2 module had
# HEADS_PER_PROGRAM (heads a program of the launch after the readout) and used load_live; this script patched both.
"""Time the Mamba-2 append route's two launches alone at Nemotron-3-Nano-4B's layer, batch 256, f32 checkpoint,
L = 16, staggered cursors: the launch after the readout over heads a program, warps and dead-slot loads; the
Mosaic GPU readout over tilings."""
import sys, functools
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
import step_profile
from replayssm_jax.kernels import mamba2 as mk, tma_readout as t, tiles

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
bench = kb.make_bench("mamba2", batch, "float32", np.random.default_rng(0))
rs = bench.replay_init(bench.state(), 16, bench.dtype, np.arange(batch) % 16)
raw = bench.random_inputs((batch,))
kw = bench._kernel_args(raw)
inputs = mk._with_defaults(mk.Inputs(*(kw[n] for n in mk.Inputs._fields)))
readout = jnp.asarray(np.random.default_rng(1).standard_normal((batch, 96, 80)), jnp.float32)
records = mk.Records(rs.x, rs.dt, rs.B)
orig_load_live, orig_warps, orig_hpp = mk.load_live, mk.head_work_warps, mk.HEADS_PER_PROGRAM


def live_only(ref, live, L, cols=None, dtype=jnp.float32):  # the dead slots not loaded at all
    slots = tiles.lane_mask(ref.shape[0], L)
    mask = live if slots is None else live & slots
    if len(ref.shape) == 2:
        mask = tiles.tile_mask(mask, cols, tuple(ref.shape))
    return tiles.load(ref, mask, dtype)


def timed(name, f, *args, n=30):
    try:
        jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    trace = step_profile.trace(lambda: [jax.block_until_ready(f(*args)) for _ in range(n)])
    b = step_profile.decode_breakdown(trace, module="jit", top=6)
    us = {k: round(ns / n / 1e3, 2) for k, ns, _ in b["top"]} if b else None
    print(f"{name}: {us}", flush=True)


for hpp in (1, 4):
    for warps in (1, 2, 4):
        for dead in ("all", "live"):
            mk.HEADS_PER_PROGRAM, mk.head_work_warps = hpp, (lambda e, w=warps: w)
            mk.load_live = orig_load_live if dead == "all" else live_only
            jax.clear_caches()
            f = jax.jit(functools.partial(mk._after_readout, dt_softplus=True, dt_limit=(0.0, float("inf")),
                                          interpret=False))
            timed(f"heads hpp{hpp} w{warps} {dead}", f, readout, records, rs.cursor, inputs)
mk.load_live, mk.head_work_warps, mk.HEADS_PER_PROGRAM = orig_load_live, orig_warps, orig_hpp
for cfg in (t.TMAReadoutConfig(), t.TMAReadoutConfig(programs_per_sm=3), t.TMAReadoutConfig(stages=3)):
    f = jax.jit(functools.partial(t.mamba2_readout_tma, config=cfg))
    timed(f"readout {cfg}", f, rs.checkpoint, raw["C"])
