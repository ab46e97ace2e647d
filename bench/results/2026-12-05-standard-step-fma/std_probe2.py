"""GDN standard step (Qwen3.5-4B layer, batch 256, f32 state) on the tiling argv[1] (ROWSxWARPS), four steps."""
import sys
import jax, jax.numpy as jnp, numpy as np
from replayssm_jax.kernels import StepConfig, gdn_step
sys.path.insert(0, "bench")
import kernels as kb

rows, warps = map(int, sys.argv[1].split("x"))
b = kb.make_bench("gdn", 256, jnp.float32, np.random.default_rng(0))
inp = b.random_inputs((b.b,))
st = b.replay_state(16, jnp.float32, jnp.bfloat16, np.full((b.b,), 5, np.int32)).checkpoint
cfg = StepConfig(block_v=rows, num_warps=warps)
step = jax.jit(lambda s, i: gdn_step(s, **b._kw(i), scale=b.s.K ** -0.5, use_qk_l2norm=True, config=cfg))
for _ in range(4):
    o, st = step(st, inp)
    jax.block_until_ready(o)
print("ran", cfg)
