"""Probe: the GDN deferred readout's tiling (TMAReadoutConfig block_v, stages, programs_per_sm) at batch 256,
L = 16, f32 and bf16 checkpoints, in-step and staggered cursors. Kernel us a step."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import TMAReadoutConfig, tma_readout

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
tilings = [(64, 2, 2), (64, 3, 2), (64, 2, 3), (64, 3, 3), (64, 2, 4), (128, 2, 1), (128, 2, 2)]
rows = []
for sd in ("float32", "bfloat16"):
    b = kb.make_bench("gdn", 256, sd, np.random.default_rng(0))
    for bv, st, pps in tilings:
        config = TMAReadoutConfig(block_v=bv, stages=st, programs_per_sm=pps)
        for cursors in ("in-step", "staggered"):
            jax.clear_caches()
            try:
                r = kb.run_variant(b, 16, cursors, opts, config=config, route="deferred")
            except Exception as e:  # noqa: BLE001  (a tiling whose shared memory does not fit)
                print(sd, bv, st, pps, cursors, "refused:", type(e).__name__, str(e)[:160], flush=True)
                continue
            ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(state=sd, tiling=[bv, st, pps], cursors=cursors, us=round(r["seconds"] * 1e6, 2), kernels=ks)
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(f"{OUT}/probe_tiles.json", "w"), indent=1)
for r in rows:
    k = [v for n, v in r["kernels"].items() if "tma" in n][0]
    print(f"{r['state']:9s} {str(r['tiling']):12s} {r['cursors']:9s} readout {k:8.2f} wall {r['us']:8.2f}")
