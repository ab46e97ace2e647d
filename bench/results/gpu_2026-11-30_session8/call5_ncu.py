"""One standard and one direct-route step per layer at batch 1 (f32 state), for ncu."""
import sys
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
rng = np.random.default_rng(0)
for layer in ("gdn", "mamba2"):
    bench = kb.make_bench(layer, 1, "float32", rng)
    inp = kb._take(bench.inputs(1), 0)
    state = bench.state()
    y, s = jax.jit(lambda s, i: bench.step(s, i, "pallas"))(state, inp)
    rs = bench.replay_init(bench.state(), 16, np.zeros(1))
    y, rs = jax.jit(lambda r, i: bench.replay_step(r, i, "direct", "pallas"))(rs, inp)
    jax.block_until_ready((y, s, rs))
