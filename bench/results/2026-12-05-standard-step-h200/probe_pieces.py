"""A/B on the GDN standard step (Qwen3.5-4B layer): the tree's kernel against its state tile in P = 2 or 4
column pieces with the matvecs' products chained as fmas (pieces.py). Kernel us a step (CUPTI), each variant
checked against the f32 reference first."""
import json, os, sys
import jax, numpy as np
sys.path.insert(0, "bench"); sys.path.insert(0, os.path.dirname(__file__))
import kernels as kb
import pieces
from probe_std_tiles import ok

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)

rows = []
for sd in ("float32", "bfloat16"):
    for batch in (64, 256, 512):
        b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
        for name, P in (("tree", 0), ("pieces 4", 4), ("pieces 2", 2), ("tree (again)", 0)):
            pieces.patch(P)
            jax.clear_caches()
            good = ok(b)
            r = kb.run_variant(b, None, None, opts)
            ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(batch=batch, state=sd, variant=name, ok=good, us=round(r["seconds"] * 1e6, 2),
                       kernel_us=ks.get("(all kernels)"))
            rows.append(row)
            print(json.dumps(row), flush=True)
        json.dump(rows, open(f"{OUT}/probe_pieces.json", "w"), indent=1)
pieces.patch(0)
print()
for r in rows:
    print(f"gdn {r['batch']:4d} {r['state']:9s} {r['variant']:14s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
