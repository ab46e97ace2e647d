"""GDN lockstep cycle at b256 f32: the prelude's record loads as load_live (all slots) vs load_live_only."""
import os, sys, json
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
from replayssm_jax.kernels import gdn as kg, tiles

ORIG = kg._terms_kernel
BK = sys.argv[1] if len(sys.argv) > 1 else "pallas"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 256


def live_only(*a, **k):
    old = kg.load_live
    kg.load_live = lambda ref, live, L, cols=None, dtype=jnp.float32: tiles.load_live_only(ref, live, cols, dtype)
    try:
        return ORIG(*a, **k)
    finally:
        kg.load_live = old


opts = kb.TimingOptions(repeats=3, profile=BK == "pallas") if BK == "pallas" else kb.TimingOptions.dry_run()
rows = []
for name, fn in (("all-slots", ORIG), ("live-only", live_only), ("all-slots-again", ORIG)):
    kg._terms_kernel = fn
    jax.clear_caches()
    bench = kb.make_bench("gdn", B, "float32", np.random.default_rng(0))
    r = kb.run_variant(bench, 16, "lockstep", opts)
    ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
    rows.append(dict(variant=name, us=r["seconds"] * 1e6, kernels=ks))
    print(f"{name:16s} {r['seconds']*1e6:8.2f} us/step {ks}", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/prelude_liveonly.json", "w"), indent=1)
