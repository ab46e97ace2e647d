import sys, json, os
sys.path.insert(0, "bench")
import numpy as np, jax
import kernels as kb
kb.PROFILE = True
tree, batch = sys.argv[1], int(sys.argv[2])
rows = []
rng = np.random.default_rng(0)
for layer in ("gdn", "mamba2"):
    for sd in ("float32",):
        bench = kb.GDNBench(kb.GDNShape(), batch, sd, rng) if layer == "gdn" else kb.Mamba2Bench(kb.Mamba2Shape(), batch, sd, rng)
        for kind, L, route in (("standard", None, "output"), ("replay-L16", 16, "output"), ("replay-L16", 16, "state"), ("replay-L32", 32, "output")):
            r = kb.run_variant(bench, kind, L, "staggered", 5, route=route)
            ks = r["kernels_us"]
            kern = {k: round(v["us"], 2) for k, v in ks.items() if v["us"] > 0.3}
            row = dict(tree=tree, batch=batch, layer=layer, sd=sd, kind=kind, route=route, step_us=r["seconds"] * 1e6, kernels=kern)
            rows.append(row)
            print(f"{tree:7s} b{batch} {layer:7s} {kind:11s} {route:6s} step {row['step_us']:7.2f}  {kern}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"ab_{tree}_b{batch}.json"), "w"), indent=1)
