"""Sweep TMAReadoutConfig on the GDN lockstep cycle (kernel us per step, profile)."""
import sys, json, time
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "bench")  # run from the repository root
import kernels as kb
from replayssm_jax import kernels
out = sys.argv[1]
cfgs = [(64, 2, 2), (64, 3, 2), (64, 4, 1), (64, 2, 1), (128, 2, 1), (128, 3, 1), (64, 3, 1), (64, 2, 3)]
rows = []
deadline = time.time() + float(sys.argv[2])
for b, sd in ((256, jnp.float32), (512, jnp.float32), (256, jnp.bfloat16)):
    bench = kb.make_bench("gdn", b, sd, np.random.default_rng(0))
    opts = kb.TimingOptions(repeats=3, profile=True)
    for bv, st, pps in cfgs:
        if time.time() > deadline:
            break
        cfg = kernels.TMAReadoutConfig(bv, st, pps)
        try:
            r = kb.run_variant(bench, 16, "lockstep", opts, config=cfg)
        except Exception as e:  # noqa
            print(f"b{b} {jnp.dtype(sd).name} {bv}x{st}x{pps} failed: {str(e)[:150]}", flush=True)
            continue
        k = r["kernels_us"] or {}
        tma = sum(v["us"] for n, v in k.items() if "gdn_append_tma" in n)
        tot = sum(v["us"] for n, v in k.items() if n != "(idle)")
        rows.append(dict(batch=b, sd=jnp.dtype(sd).name, cfg=[bv, st, pps], wall_us=r["seconds"] * 1e6, kernel_us=tot, tma_us=tma))
        print(f"sweep b{b} {jnp.dtype(sd).name:8s} {bv}x{st}x{pps}: wall {r['seconds']*1e6:8.2f} kernels {tot:8.2f} tma {tma:8.2f} (compile {r['compile_s']:.0f}s)", flush=True)
json.dump(rows, open(out, "w"), indent=1)
