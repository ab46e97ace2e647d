"""Drive the GDN deferred (staggered cursors) and append preludes a few times for ncu, batch 256 f32 L16."""
import sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb

b = kb.make_bench("gdn", 256, "float32", np.random.default_rng(0))
L = 16
inp = b.random_inputs((b.b,))
stag = b.replay_init(b.state(), L, b.dtype, np.arange(b.b) % L)
half = b.replay_init(b.state(), L, b.dtype, np.arange(b.b) % (L - 1))
deferred = jax.jit(lambda c, i: b.replay_step(c, i, "deferred", "pallas", None))
append = jax.jit(lambda c, i: b.replay_step(c, i, "append", "pallas", None))
for _ in range(3):
    jax.block_until_ready(deferred(stag, inp))
    jax.block_until_ready(append(half, inp))
print("done", flush=True)
