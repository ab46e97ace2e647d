"""Written before mamba2_entry_cursor.patch landed (`2908a70`); run on GPUs after it (H100 and H200 runs:
../2026-12-06-mamba2-entry-cursor/). With the patch applied, the
Mamba-2 Mosaic GPU routes with the cursor copied at entry by the readout (the patched tree) against the cursor
moved with atomics (`readout_moves_cursor` patched to False in the launch's module): each variant first checked
against the f32 reference (bench/kernels.check), then timed (CUPTI kernel time). Run from the repository root
with PYTHONPATH=$PWD."""
import json, os, sys
import jax, numpy as np
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import mamba2

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
tree = mamba2.readout_moves_cursor
rows = []
for sd in ("bfloat16", "float32"):
    for batch in (64, 256):
        b = kb.make_bench("mamba2", batch, sd, np.random.default_rng(0))
        for name, f in (("entry copy", tree), ("atomics", lambda batch: False)):
            mamba2.readout_moves_cursor = f
            jax.clear_caches()
            ok = kb.check(b, [16])
            for cursors, route in (("in-step", "deferred"), ("staggered", "deferred"), ("lockstep", "output")):
                r = kb.run_variant(b, 16, cursors, opts, route=route)
                ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
                row = dict(state=sd, batch=batch, variant=name, ok=bool(ok["ok"]), cursors=cursors,
                           wall_us=round(r["seconds"] * 1e6, 2), kernel_us=ks.get("(all kernels)"), kernels=ks)
                rows.append(row)
                print(json.dumps(row), flush=True)
        mamba2.readout_moves_cursor = tree
        json.dump(rows, open(f"{OUT}/m2_entry_probe.json", "w"), indent=1)
for r in rows:
    heads = {k: v for k, v in r["kernels"].items() if "heads" in k}
    print(f"mamba2 {r['state']:8s} {r['batch']:4d} {r['cursors']:9s} {r['variant']:11s} ok {r['ok']!s:5s} "
          f"kernels {r['kernel_us']:8.2f} wall {r['wall_us']:8.2f} {heads}")
