"""Probe: the GDN deferred readout's tiling at batch 64 (f32 checkpoint, L = 16, Qwen3.5-4B's layer), in
one process: the default TMAReadoutConfig against other tilings and against a grid of 256 programs (the
SM count patched to 128, so that the 4096 items split evenly: 16 steps a program) instead of 264 (15 or 16
steps). Us a step: the prelude's and the readout's kernels and the step's wall time; in step, staggered
and the lockstep cycle (whose append steps take the config)."""
import json, os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax.kernels import tma_readout
from replayssm_jax.kernels.tma_readout import TMAReadoutConfig as C

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
sms = tma_readout.num_sms
variants = [("default", C(), None), ("sms128", C(), 128), ("p1-st3", C(programs_per_sm=1, stages=3), None),
            ("bv128-p1", C(block_v=128, programs_per_sm=1), None), ("r8", C(record_slots=8), None),
            ("keys-at-flush", C(flush_keys_ahead=False), None), ("default-again", C(), None)]
batch = int(os.environ.get("BATCH", 64))
b = kb.make_bench("gdn", batch, "float32", np.random.default_rng(0))
rows = []
for name, config, n_sms in variants:
    tma_readout.num_sms = (lambda: n_sms) if n_sms else sms
    for cursors in ("in-step", "staggered") + (() if name == "keys-at-flush" else ("lockstep",)):
        jax.clear_caches()
        try:
            route = "output" if cursors == "lockstep" else "deferred"
            r = kb.run_variant(b, 16, cursors, opts, config=config, route=route)
        except Exception as e:  # a tiling the kernel's checks refuse
            print(name, cursors, "refused:", str(e)[:200], flush=True)
            continue
        ks = {k: v["us"] for k, v in (r["kernels_us"] or {}).items()}
        row = dict(variant=name, batch=batch, cursors=cursors,
                   prelude=round(sum(v for n, v in ks.items() if "terms" in n), 2),
                   readout=round(sum(v for n, v in ks.items() if "tma" in n), 2),
                   kernels=round(ks["(all kernels)"], 2), wall=round(r["seconds"] * 1e6, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
tma_readout.num_sms = sms
json.dump(rows, open(f"{OUT}/probe_tiling_b{batch}.json", "w"), indent=1)
for r in rows:
    print(f"{r['variant']:14s} {r['cursors']:9s} prelude {r['prelude']:6.2f} readout {r['readout']:7.2f} "
          f"kernels {r['kernels']:7.2f} wall {r['wall']:7.2f}")
