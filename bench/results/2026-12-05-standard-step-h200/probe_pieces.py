"""A/B on the GDN standard step (Qwen3.5-4B layer): the tree's kernel against its state tile in P = 2 or 4
column pieces with the matvecs' products chained as fmas (pieces.py). Kernel us a step (CUPTI), each variant
checked against the f32 reference first."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench"); sys.path.insert(0, os.path.dirname(__file__))
import kernels as kb
import pieces

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)


def ok(b):
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(2)
        s_k = b.state(); s_r = s_k.astype(jnp.float32)
        ys, states = [], []
        for t in range(2):
            x = kb._take(xs, t)
            y_k, s_k = b.step(s_k, x, "pallas", None)
            y_r, s_r = b.step(s_r, x, "xla")
            ys.append((y_k, y_r)); states.append((s_k, s_r))
        return bool(kb._compared(ys, tol)["ok"] and kb._compared(states, tol)["ok"])


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
