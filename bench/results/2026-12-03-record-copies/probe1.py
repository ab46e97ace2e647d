"""Run 1: the GDN and Mamba-2 direct steps in column chunks (chunk_direct.py) and, for the GDN layer, advance_cursor without its atomic add (the prelude's and the direct step's cursor moves; timing only: racy), patched in at run time; lockstep cycle, batch 256, f32."""
import os, sys, json
sys.path.insert(0, "bench"); sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
import kernels as kb
from replayssm_jax.kernels import gdn as kg
from replayssm_jax.kernels.tiles import program_id
import chunk_direct as cd
B = int(os.environ.get("B", 256))
opts = kb.TimingOptions.dry_run() if os.environ.get("DRY") else kb.TimingOptions(repeats=3, profile=True)
ADV = kg.advance_cursor


def racy_advance(cursor_ref, cursor, new, programs):
    @pl.when((new != cursor) & (program_id(1) == 0))
    def _():
        cursor_ref[0] = new


def setup(name):
    cd.uninstall_both(); kg.advance_cursor = ADV
    if name.startswith("chunk"):
        cd.install_both(int(name[5:]))
    if name == "prelude-noatomic":
        kg.advance_cursor = racy_advance
    jax.clear_caches()


rows = []
for lname in sys.argv[1].split(","):
  layer, name = lname.split(":")
  if True:
    setup(name)
    bench = kb.make_bench(layer, B, "float32", np.random.default_rng(0))
    r = kb.run_variant(bench, 16, "lockstep", opts)
    ks = {k: round(v["us"] / max(v["launches_per_step"], 1e-9), 2) for k, v in (r["kernels_us"] or {}).items()}
    rows.append(dict(layer=layer, variant=name, us=r["seconds"] * 1e6, kernel_us=sum(v["us"] for v in (r["kernels_us"] or {}).values()), per_launch_us=ks))
    print(f"{layer} {name:18s} {r['seconds']*1e6:8.2f} us/step {ks}", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/probe1.json", "w"), indent=1)
