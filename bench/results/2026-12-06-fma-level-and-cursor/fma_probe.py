"""Kernel time of the standard and replay steps under this process's XLA_FLAGS (argv[1]: a tag). Each shape is
first checked against the f32 reference (bench/kernels.check). Run from the repository root with PYTHONPATH=$PWD."""
import json, os, sys, time
import jax, numpy as np
sys.path.insert(0, "bench")
import kernels as kb

OUT = os.environ.get("OUT", "/tmp")
tag = sys.argv[1]
opts = kb.TimingOptions(repeats=3, profile=True)
# (layer, state, batch, variants): variant (name, L, cursors, route)
STD = ("standard", None, None, None)
SHAPES = [
    ("gdn", "float32", 64, [STD]), ("gdn", "float32", 256, [STD]), ("gdn", "float32", 512, [STD]),
    ("gdn", "bfloat16", 64, [STD]), ("gdn", "bfloat16", 256, [STD]), ("gdn", "bfloat16", 512, [STD]),
    ("mamba2", "bfloat16", 64, [STD, ("in-step-deferred", 16, "in-step", "deferred"), ("lockstep", 16, "lockstep", "output")]),
    ("gdn", "float32", 64, [("in-step-deferred", 16, "in-step", "deferred"), ("lockstep", 16, "lockstep", "output")]),
]


def standard_ok(b):
    """Two standard steps of bench `b` on the compiled kernels against the f32 reference."""
    import jax.numpy as jnp
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
        import hashlib
        digest = hashlib.sha1(np.asarray(ys[-1][0]).tobytes() + np.asarray(s_k).tobytes()).hexdigest()[:12]
        print("digest", b.layer, b.sd, b.b, digest, flush=True)  # differs between processes where the code does
        return bool(kb._compared(ys, tol)["ok"] and kb._compared(states, tol)["ok"])


rows = []
t0 = time.time()
for layer, sd, batch, vs in SHAPES:
    b = kb.make_bench(layer, batch, sd, np.random.default_rng(0))
    ok = kb.check(b, [16])["ok"] if any(v[1] for v in vs) else standard_ok(b)
    for name, L, cursors, route in vs:
        r = kb.run_variant(b, L, cursors, opts, route=route or "output")
        ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
        row = dict(tag=tag, layer=layer, state=sd, batch=batch, variant=name, ok=ok, wall_us=round(r["seconds"] * 1e6, 2),
                   kernel_us=ks.get("(all kernels)"), kernels=ks)
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(f"{OUT}/fma_probe_{tag}.json", "w"), indent=1)
print(f"{tag}: {time.time() - t0:.0f} s")
for r in rows:
    print(f"{tag:8s} {r['layer']:6s} {r['state']:8s} {r['batch']:4d} {r['variant']:17s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['wall_us']:8.2f}")
