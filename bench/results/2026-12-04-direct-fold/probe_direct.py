"""Probe: the GDN lockstep cycle (L = 16: 15 append steps on the Mosaic GPU readout, then the direct step
that flushes every row) with its direct step on the Triton kernel (the default) against the Mosaic GPU
direct step, whose fold runs on the tensor cores (`tma_readout.fold_tile`), 3 stages, one program an SM; Qwen3.5-4B's
layer, bf16 records. In one process, each pair alternated twice. Us a step of the cycle: the direct
step's kernels (prelude and step) and all kernels, and the wall time."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import tma_step

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
variants = [("triton", None), ("tma-st3-p1", tma_step.STEP_CONFIG)]
shapes = [(64, "float32"), (256, "float32"), (512, "float32"), (64, "bfloat16"), (256, "bfloat16")]
rows = []
for batch, dtype in shapes:
    b = kb.make_bench("gdn", batch, dtype, np.random.default_rng(0))
    for rep in range(2):
        for name, config in variants:
            jax.clear_caches()
            r = kb.run_variant(b, 16, "lockstep", opts, direct_config=config)
            ks = {k: v["us"] for k, v in (r["kernels_us"] or {}).items()}
            row = dict(batch=batch, dtype=dtype, direct=name, rep=rep,
                       direct_us=round(sum(v for n, v in ks.items() if "direct" in n), 2),
                       kernels=round(ks["(all kernels)"], 2), wall=round(r["seconds"] * 1e6, 2), names=sorted(ks))
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(f"{OUT}/probe_direct.json", "w"), indent=1)
for r in rows:
    print(f"b{r['batch']:<4d} {r['dtype']:8s} {r['direct']:11s} direct {r['direct_us']:6.2f} (x16 {16 * r['direct_us']:7.1f}) "
          f"kernels {r['kernels']:7.2f} wall {r['wall']:7.2f}")
