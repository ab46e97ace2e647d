"""GDN lockstep: the readout's d-record copies of R slots (dead copies from the L2); the prelude's warps."""
import os, sys, json
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax import kernels
from replayssm_jax.kernels import gdn as kg
B = int(os.environ.get("B", 256))
SD = os.environ.get("SD", "float32")
opts = kb.TimingOptions.dry_run() if os.environ.get("DRY") else kb.TimingOptions(repeats=3, profile=True)
HW = kg.head_work_warps
rows = []
for name in sys.argv[1].split(","):
    kg.head_work_warps = HW
    if name.startswith("w"):
        kg.head_work_warps = lambda e, w=int(name[1:]): w
        cfg = kernels.TMAReadoutConfig()
    else:
        cfg = kernels.TMAReadoutConfig(record_slots=int(name[1:]))
    jax.clear_caches()
    bench = kb.make_bench("gdn", B, SD, np.random.default_rng(0))
    r = kb.run_variant(bench, 16, "lockstep", opts, config=None if os.environ.get("DRY") else cfg)
    ks = {k: round(v["us"] / max(v["launches_per_step"], 1e-9), 2) for k, v in (r["kernels_us"] or {}).items()}
    kern = sum(v["us"] for k, v in (r["kernels_us"] or {}).items() if not k.startswith("("))
    rows.append(dict(variant=name, state=SD, us=r["seconds"] * 1e6, kernel_us=kern, per_launch_us=ks))
    print(f"gdn {SD} {name:6s} wall {r['seconds']*1e6:8.2f} kernels {kern:8.2f} us/step {ks}", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/probe2_{SD}.json", "w"), indent=1)
