"""Direct route vs standard step at batch 1 over tilings (one layer, f32 state)."""
import json, os, sys
sys.path.insert(0, "bench")
import numpy as np
import kernels as kb
from replayssm_jax.kernels import Config
kb.PROFILE = True
rows = []
rng = np.random.default_rng(0)
CONFIGS = [(4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4)]
for layer in ("gdn", "mamba2"):
    bench = kb.make_bench(layer, 1, "float32", rng)
    for bv, w in CONFIGS:
        cfg = Config(block_v=bv, num_warps=w)
        for kind, L, cursors, route in (("standard", None, None, None), ("direct", 16, "empty", "direct")):
            r = kb.run_variant(bench, kind, L, cursors, 5, cfg, route=route)
            kern = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items() if v["us"] > 0.3}
            rows.append(dict(layer=layer, config=f"{bv}x{w}", kind=kind, step_us=r["seconds"] * 1e6, kernels=kern))
            print(f"{layer:7s} {bv:3d}x{w} {kind:9s} step {r['seconds'] * 1e6:6.2f} us  {kern}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "sweep_direct_b1.json"), "w"), indent=1)
