"""Compile the GDN and Mamba-2 standard step and direct route at batch 1 with XLA's dump on."""
import os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
sys.path.append(os.path.join(os.getcwd(), "bench"))
import kernels as kb  # bench/kernels.py
rng = np.random.default_rng(0)
for layer in ("gdn", "mamba2"):
    b = kb.make_bench(layer, 1, "float32", rng)
    st = b.state(); xs = b.inputs(1); inp = jax.tree.map(lambda a: a[0], xs)
    f = jax.jit(lambda s, i: b.step(s, i, "pallas"))
    jax.block_until_ready(f(st, inp))
    rs = b.replay_init(b.state(), 16, np.zeros(1))
    g = jax.jit(lambda r, i: b.replay_step(r, i, "direct", "pallas"))
    jax.block_until_ready(g(rs, inp))
print("done")
