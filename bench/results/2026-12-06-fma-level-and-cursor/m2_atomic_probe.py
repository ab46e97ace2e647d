"""Timing only: the Mamba-2 launch after the readout with its cursor's atomic arrivals (the tree) against a racy
store from each row's first head program (an upper bound of what moving the cursor without atomics could save;
its cursors are not those of the tree, so no output is checked). Run from the repository root with PYTHONPATH=$PWD."""
import json, os, sys
import jax, numpy as np
from jax.experimental import pallas as pl
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import mamba2

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
tree = mamba2.advance_cursor


def racy(cursor_ref, cursor, new, programs):
    @pl.when((new != cursor) & (pl.program_id(1) == 0))
    def _():
        cursor_ref[0] = new


rows = []
for batch in (64, 256):
    b = kb.make_bench("mamba2", batch, "bfloat16", np.random.default_rng(0))
    for name, f in (("atomics", tree), ("racy store", racy), ("atomics (again)", tree)):
        mamba2.advance_cursor = f
        jax.clear_caches()
        for cursors, route in (("in-step", "deferred"), ("lockstep", "output")):
            r = kb.run_variant(b, 16, cursors, opts, route=route)
            ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(batch=batch, variant=name, cursors=cursors, wall_us=round(r["seconds"] * 1e6, 2),
                       kernel_us=ks.get("(all kernels)"), kernels=ks)
            rows.append(row)
            print(json.dumps(row), flush=True)
    mamba2.advance_cursor = tree
    json.dump(rows, open(f"{OUT}/m2_atomic_probe.json", "w"), indent=1)
for r in rows:
    heads = {k: v for k, v in r["kernels"].items() if "heads" in k}
    print(f"mamba2 bf16 {r['batch']:4d} {r['cursors']:9s} {r['variant']:16s} kernels {r['kernel_us']:8.2f} "
          f"wall {r['wall_us']:8.2f} {heads}")
