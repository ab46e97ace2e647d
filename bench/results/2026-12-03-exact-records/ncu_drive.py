"""Drive one layer's kernels a few times for ncu: direct step (cursor 15, full records), standard step, append step."""
import sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import kernels as kb

layer = sys.argv[1]
BK = sys.argv[2] if len(sys.argv) > 2 else "pallas"
b = kb.make_bench(layer, int(sys.argv[3]) if len(sys.argv) > 3 else 256, "float32", np.random.default_rng(0))
L = 16
inp = b.random_inputs((b.b,))
full = b.replay_init(b.state(), L, b.dtype, np.full(b.b, 15))
direct = jax.jit(lambda c, i: b.replay_step(c, i, "direct", BK, None))
append = jax.jit(lambda c, i: b.replay_step(c, i, "append", BK, None))
std = jax.jit(lambda c, i: b.step(c, i, BK, None))
s = b.state()
half = b.replay_init(b.state(), L, b.dtype, np.full(b.b, 7))
for _ in range(3):
    jax.block_until_ready(direct(full, inp))
    jax.block_until_ready(std(s, inp))
    jax.block_until_ready(append(half, inp))
print("done", layer, flush=True)
