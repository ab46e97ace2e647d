"""Probe: the GDN deferred readout's flush products (`tma_readout._flush_tile`) with each record buffer's loop
unrolled by 1 (as built), 2 or all R slots, batch 256, L = 16, f32 and bf16 checkpoints, in-step and staggered
cursors. Kernel us a step; lowering seconds."""
import inspect, json, os, sys, textwrap, time
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import tma_readout

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
base = tma_readout._flush_tile
loop = "S = lax.fori_loop(0, R, adder(c), S)"
assert loop in inspect.getsource(base)
rows = []
for unroll in (1, 2, 4):
    src = textwrap.dedent(inspect.getsource(base)).replace(loop, loop[:-1] + f", unroll={unroll})")
    ns = dict(vars(tma_readout))
    exec(compile(src, "<flush_tile>", "exec"), ns)
    tma_readout._flush_tile = ns["_flush_tile"]
    for sd in ("float32", "bfloat16"):
        b = kb.make_bench("gdn", 256, sd, np.random.default_rng(0))
        for cursors in ("in-step", "staggered"):
            jax.clear_caches()
            r = kb.run_variant(b, 16, cursors, opts, route="deferred")
            ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(unroll=unroll, state=sd, cursors=cursors, us=round(r["seconds"] * 1e6, 2),
                       compile_s=round(r["compile_s"], 1), kernels=ks)
            rows.append(row)
            print(json.dumps(row), flush=True)
tma_readout._flush_tile = base
json.dump(rows, open(f"{OUT}/probe_unroll.json", "w"), indent=1)
for r in rows:
    k = [v for n, v in r["kernels"].items() if "tma" in n][0]
    print(f"unroll {r['unroll']} {r['state']:9s} {r['cursors']:9s} readout {k:8.2f} wall {r['us']:8.2f} compile {r['compile_s']}")
