"""Probe: where the GDN deferred step's prelude (`gdn._head_terms`, one Triton launch, grid (batch, H))
spends its time. bf16 checkpoint, L = 16, the deferred route at its default readout; the prelude's
kernel us a step under source-level variants patched into replayssm_jax.kernels.gdn:
  base      as built (1 warp a program);
  w2, w4    2 or 4 warps a program;
  noatomic  the cursor's move left out (timing only: the cursor then never moves);
  keysall   the k and g records read in full, dead slots zeroed after the load (`load_live`)."""
import functools, json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import gdn, tiles

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
orig = dict(head_work_warps=gdn.head_work_warps, advance_cursor=gdn.advance_cursor,
            load_live_only=gdn.load_live_only)


def keys_all(ref, live, cols=None, dtype=tiles.f32):
    return tiles.load_live(ref, live, ref.shape[0], cols, dtype)


variants = {"base": {}, "w2": dict(head_work_warps=lambda n: 2), "w4": dict(head_work_warps=lambda n: 4),
            "noatomic": dict(advance_cursor=lambda *a, **k: None), "keysall": dict(load_live_only=keys_all)}
runs = [(64, "in-step"), (64, "staggered"), (256, "staggered"), (512, "staggered")]
rows = []
for batch, cursors in runs:
    b = kb.make_bench("gdn", batch, "bfloat16", np.random.default_rng(0))
    for name, patch in variants.items():
        for k, v in orig.items():
            setattr(gdn, k, patch.get(k, v))
        jax.clear_caches()
        r = kb.run_variant(b, 16, cursors, opts, route="deferred")
        ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
        prelude = [v for n, v in ks.items() if "terms" in n][0]
        readout = [v for n, v in ks.items() if "tma" in n][0]
        row = dict(batch=batch, cursors=cursors, variant=name, prelude=prelude, readout=readout,
                   wall=round(r["seconds"] * 1e6, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
for k, v in orig.items():
    setattr(gdn, k, v)
json.dump(rows, open(f"{OUT}/probe_prelude.json", "w"), indent=1)
for r in rows:
    print(f"b{r['batch']:<4d} {r['cursors']:9s} {r['variant']:9s} prelude {r['prelude']:7.2f} readout {r['readout']:7.2f}"
          f" wall {r['wall']:7.2f}")
