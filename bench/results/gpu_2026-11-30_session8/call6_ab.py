"""A/B at batch 1: standard and direct-route steps of two code trees (argv[1] names the tree)."""
import json, os, sys
sys.path.insert(0, "bench")
import numpy as np
import kernels as kb
kb.PROFILE = True
tree, rows = sys.argv[1], []
rng = np.random.default_rng(0)
for layer in ("gdn", "mamba2"):
    for sd in ("float32", "bfloat16"):
        bench = kb.make_bench(layer, 1, sd, rng)
        for kind, L, cursors, route in (("standard", None, None, None), ("direct", 16, "empty", "direct")):
            r = kb.run_variant(bench, kind, L, cursors, 7, route=route)
            kern = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items() if v["us"] > 0.3}
            rows.append(dict(tree=tree, layer=layer, sd=sd, kind=kind, step_us=r["seconds"] * 1e6, kernels=kern))
            print(f"{tree:5s} {layer:7s} {sd:9s} {kind:9s} step {r['seconds'] * 1e6:6.2f} us  {kern}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"ab_{tree}.json"), "w"), indent=1)
