"""Probe: the GDN deferred readout's flush products on the tensor cores (a WGMMA of the d records, split in
three bf16 parts, times the bf16 keys; `tma_readout.keys_on_tensor_cores`) against f32 outer products (the
same module with `keys_on_tensor_cores` patched to False), batch 64 and 256, L = 16, f32 and bf16 checkpoints,
in-step and staggered cursors, each pair timed in turn. Readout and prelude us a step."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import tma_readout

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
on_tc = tma_readout.keys_on_tensor_cores
rows = []
for sd in ("float32", "bfloat16"):
    for batch in (64, 256):
        b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
        for cursors in ("in-step", "staggered"):
            for rnd in range(1):
                for products in ("wgmma", "fma"):
                    tma_readout.keys_on_tensor_cores = on_tc if products == "wgmma" else (lambda *a: False)
                    jax.clear_caches()
                    r = kb.run_variant(b, 16, cursors, opts, route="deferred")
                    ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
                    row = dict(state=sd, batch=batch, cursors=cursors, round=rnd, products=products,
                               readout=[v for n, v in ks.items() if "tma" in n][0],
                               prelude=[v for n, v in ks.items() if "terms" in n][0], wall=round(r["seconds"] * 1e6, 2))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
tma_readout.keys_on_tensor_cores = on_tc
json.dump(rows, open(f"{OUT}/probe_wgmma.json", "w"), indent=1)
for r in rows:
    print(f"{r['state']:9s} b{r['batch']:<4d} {r['cursors']:9s} {r['round']} {r['products']:6s} readout {r['readout']:8.2f}"
          f" prelude {r['prelude']:6.2f} wall {r['wall']:8.2f}")
