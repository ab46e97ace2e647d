"""Probe: the GDN deferred step with the flush's k records copied a step ahead or at the flush
(TMAReadoutConfig.flush_keys_ahead), bf16 and f32 checkpoints, batch 256, L = 16, staggered and in-step
cursors, twice in turn. Kernel us a step of the readout and of the prelude."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import TMAReadoutConfig

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
rows = []
for rnd in (1, 2):
    for sd in ("bfloat16", "float32"):
        b = kb.make_bench("gdn", 256, sd, np.random.default_rng(0))
        for cursors in ("staggered", "in-step"):
            for ahead in (True, False):
                jax.clear_caches()
                r = kb.run_variant(b, 16, cursors, opts, config=TMAReadoutConfig(flush_keys_ahead=ahead),
                                   route="deferred")
                ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
                row = dict(round=rnd, state=sd, cursors=cursors, ahead=ahead, us=round(r["seconds"] * 1e6, 2),
                           kernels=ks)
                rows.append(row)
                print(json.dumps(row), flush=True)
json.dump(rows, open(f"{OUT}/probe_keys.json", "w"), indent=1)
for r in rows:
    print(f"{r['round']} {r['state']:9s} {r['cursors']:9s} ahead={r['ahead']!s:5s} wall {r['us']:8.2f}  "
          + "  ".join(f"{k[:34]}={v}" for k, v in r["kernels"].items()))
