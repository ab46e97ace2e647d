import sys, json, os
sys.path.insert(0, "bench")
import numpy as np, jax
import kernels as kb
kb.PROFILE = True
tree = sys.argv[1]
rows = []
rng = np.random.default_rng(0)
for layer in ("gdn", "mamba2"):
    for sd in ("float32", "bfloat16"):
        bench = kb.GDNBench(kb.GDNShape(), 256, sd, rng) if layer == "gdn" else kb.Mamba2Bench(kb.Mamba2Shape(), 256, sd, rng)
        for cur in ("staggered", "in-step"):
            r = kb.run_variant(bench, "replay-L16", 16, cur, 3)
            ks = r["kernels_us"]
            rep = sum(v["us"] for k, v in ks.items() if "replay_output" in k)
            fl = sum(v["us"] for k, v in ks.items() if "flush" in k)
            row = dict(tree=tree, layer=layer, sd=sd, cursors=cur, step_us=r["seconds"] * 1e6, replay_us=rep, flush_us=fl)
            rows.append(row)
            print(f"{tree:7s} {layer:7s} {sd:9s} {cur:10s} step {row['step_us']:7.1f} replay {rep:7.1f} flush {fl:6.1f}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"ab_{tree}.json"), "w"), indent=1)
