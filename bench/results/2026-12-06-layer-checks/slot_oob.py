import numpy as np, jax, jax.numpy as jnp, warnings; warnings.simplefilter("ignore")
from replayssm_jax import ops
r = np.random.default_rng(0); f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
cap, H, P, N, G, L = 3, 2, 4, 8, 1, 4
A = -jnp.ones(H)
pool = ops.mamba2_replay_init(f(cap, H, P, N), L, G).replace(cursor=jnp.asarray([1, 2, 3], jnp.int32))
args = f(2, H, P), f(2, H), A, f(2, G, N), f(2, G, N)
for bk in ("xla", "pallas"):
    step = jax.jit(lambda st, sl: ops.mamba2_replay_step(st, *args, slots=sl, backend=bk))
    y, new = step(pool, jnp.asarray([7, 0], jnp.int32))
    print(bk, new.cursor.tolist(), np.abs(np.asarray(new.checkpoint - pool.checkpoint))[1:].max(), bool(jnp.isfinite(y[1]).all()))
