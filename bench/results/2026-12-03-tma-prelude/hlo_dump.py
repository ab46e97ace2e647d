"""Dump the optimized HLO of the GDN append step (TMA default) at b256 f32: one step and a 4-step unrolled cycle."""
import os, sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
out = os.environ.get("OUT", "/tmp")
bench = kb.make_bench("gdn", int(sys.argv[1]) if len(sys.argv) > 1 else 256, "float32", np.random.default_rng(0))
L = 16
c = bench.replay_init(bench.state(), L, bench.dtype, np.zeros(bench.b))
inp = bench.random_inputs((bench.b,))
one = jax.jit(lambda c, inp: bench.replay_step(c, inp, "append", "pallas", None), donate_argnums=0)
txt = one.lower(c, inp).compile().as_text()
open(f"{out}/append_step.hlo.txt", "w").write(txt)
def cycle(c, inps):
    ys = []
    for t in range(4):
        y, c = bench.replay_step(c, jax.tree.map(lambda a: a[t], inps), "append", "pallas", None)
        ys.append(y)
    return c, ys
inps = bench.random_inputs((4, bench.b))
txt = jax.jit(cycle, donate_argnums=0).lower(c, inps).compile().as_text()
open(f"{out}/append_cycle4.hlo.txt", "w").write(txt)
print("dumped", flush=True)
