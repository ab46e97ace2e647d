"""Standard GDN / Mamba-2 step, bf16 and f32 state, default tiling against alternatives, batches 64-512."""
import json, os, sys
sys.path.insert(0, os.getcwd())
sys.path.append(os.path.join(os.getcwd(), "bench"))
import numpy as np
import kernels as kb
from replayssm_jax.kernels import Config
rng, rows = np.random.default_rng(0), []
for layer, sd, alts in (("gdn", "bfloat16", [Config(32, 4), Config(64, 4)]), ("gdn", "float32", [Config(32, 4), Config(16, 4)]),
                        ("mamba2", "bfloat16", [Config(16, 2), Config(16, 4)])):
    for batch in (64, 128, 256, 512):
        bench = kb.make_bench(layer, batch, sd, rng)
        out = []
        for rep in range(2):
            for cfg in alts:
                r = kb.run_variant(bench, "standard", None, None, 5, cfg)
                out.append((cfg.tag(), r["seconds"] * 1e6))
        rows.append(dict(layer=layer, state=sd, batch=batch, times=out))
        print(layer, sd, batch, "  ".join(f"{t} {us:.1f}" for t, us in out), flush=True)
json.dump(rows, open(os.path.join(os.environ["OUT"], "std_sweep.json"), "w"), indent=1)
