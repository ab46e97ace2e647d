"""A/B (run 4): the standard step of each layer (Qwen3.5-4B GDN, Nemotron-3-Nano-4B Mamba-2) with its state update as one
fused multiply-add (tiles.fma, the tree as built) and as a product and a sum (the kernels' `fma` replaced by
a * b + c). Kernel us a step (CUPTI), each variant checked against the f32 reference first; plain, fma, plain."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn, mamba2, tiles

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
MODULES = dict(gdn=gdn, mamba2=mamba2)
plain = lambda a, b, c: a * b + c  # noqa: E731


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
shapes = [(l, sd, bt) for l in ("gdn", "mamba2") for sd in ("float32", "bfloat16") for bt in (64, 256)]
shapes += [("gdn", "float32", 512), ("mamba2", "float32", 512)]
for layer, sd, batch in shapes:
    b = kb.make_bench(layer, batch, sd, np.random.default_rng(0))
    for name in ("plain", "fma", "plain (again)"):
        MODULES[layer].fma = tiles.fma if name == "fma" else plain
        jax.clear_caches()
        good = ok(b)
        r = kb.run_variant(b, None, None, opts)
        ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
        row = dict(layer=layer, batch=batch, state=sd, variant=name, ok=good, us=round(r["seconds"] * 1e6, 2),
                   kernel_us=ks.get("(all kernels)"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    MODULES[layer].fma = tiles.fma
    json.dump(rows, open(f"{OUT}/probe_fma2.json", "w"), indent=1)
print()
for r in rows:
    print(f"{r['layer']:6s} {r['batch']:4d} {r['state']:9s} {r['variant']:14s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
