"""Probe: a bf16 checkpoint's GDN readout on tiles of 128 rows at more stages and programs an SM (TMAReadoutConfig
block_v, stages, programs_per_sm), batch 256, L = 16: the deferred route (in-step and staggered cursors) and the
lockstep cycle's append steps. Kernel us a step."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import TMAReadoutConfig

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
tilings = [(128, 2, 2), (128, 3, 2), (128, 2, 3), (128, 3, 1), (128, 4, 1)]
runs = [("deferred", "in-step"), ("deferred", "staggered"), ("output", "lockstep")]
rows = []
b = kb.make_bench("gdn", 256, "bfloat16", np.random.default_rng(0))
for bv, st, pps in tilings:
    config = TMAReadoutConfig(block_v=bv, stages=st, programs_per_sm=pps)
    for route, cursors in runs:
        jax.clear_caches()
        try:
            r = kb.run_variant(b, 16, cursors, opts, config=config, route=route)
        except Exception as e:  # noqa: BLE001  (a tiling whose shared memory does not fit)
            print(bv, st, pps, route, cursors, "refused:", type(e).__name__, str(e)[:160], flush=True)
            continue
        ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
        row = dict(tiling=[bv, st, pps], route=route, cursors=cursors, us=round(r["seconds"] * 1e6, 2), kernels=ks,
                   kernel_us=ks.get("(all kernels)"))
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(f"{OUT}/probe_tiles.json", "w"), indent=1)
for r in rows:
    print(f"{str(r['tiling']):14s} {r['route']:9s} {r['cursors']:9s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
