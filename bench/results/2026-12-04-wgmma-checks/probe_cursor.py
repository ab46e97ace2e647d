"""Probe: the GDN deferred step with its cursor moved by the readout (as built at batch % 4 == 0,
`tma_readout.readout_moves_cursor`) against the prelude's atomic move (the function patched to False), in
one process, alternated twice a shape; L = 16, the deferred route at its default readout; us a step:
the prelude's and the readout's kernels and the wall time of the step in the timed loop."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import gdn, tma_readout

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
built = tma_readout.readout_moves_cursor
variants = {"readout": built, "prelude": lambda batch: False}
runs = [(64, "bfloat16", "staggered"), (64, "bfloat16", "in-step"), (64, "float32", "in-step"),
        (256, "bfloat16", "in-step")]
rows = []
for batch, dtype, cursors in runs:
    b = kb.make_bench("gdn", batch, dtype, np.random.default_rng(0))
    for rep in range(2):
        for name, fn in variants.items():
            gdn.readout_moves_cursor = tma_readout.readout_moves_cursor = fn
            jax.clear_caches()
            r = kb.run_variant(b, 16, cursors, opts, route="deferred")
            ks = {k: v["us"] for k, v in (r["kernels_us"] or {}).items()}
            row = dict(batch=batch, dtype=dtype, cursors=cursors, moved_by=name, rep=rep,
                       prelude=round(sum(v for n, v in ks.items() if "terms" in n), 2),
                       readout=round(sum(v for n, v in ks.items() if "tma" in n), 2),
                       kernels=round(ks["(all kernels)"], 2), wall=round(r["seconds"] * 1e6, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
gdn.readout_moves_cursor = tma_readout.readout_moves_cursor = built
json.dump(rows, open(f"{OUT}/probe_cursor.json", "w"), indent=1)
for r in rows:
    print(f"b{r['batch']:<4d} {r['dtype']:8s} {r['cursors']:9s} {r['moved_by']:7s} prelude {r['prelude']:6.2f} "
          f"readout {r['readout']:7.2f} kernels {r['kernels']:7.2f} wall {r['wall']:7.2f}")
