import functools, sys, os, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "bench/results/2026-12-02-mosaic-gpu-probe"); sys.path.insert(0, "bench")
from gdn_mgpu import gdn_append, gdn_append_pipelined
import kernels as kb
from replayssm_jax import kernels
B = int(os.environ.get("PB", "2")); L = 16
interp = jax.default_backend() == "cpu"
sd = jnp.dtype(os.environ.get("SD", "float32"))
bench = kb.make_bench("gdn", B, sd, np.random.default_rng(0))
inp = bench.random_inputs((B,))
cur = np.arange(B) * 7 % L
rs = bench.replay_init(bench.state(), L, bench.dtype, cur)
# fill the buffers with live records: random d, k, g
key = jax.random.key(1)
k1, k2, k3 = jax.random.split(key, 3)
rs = rs.replace(d=jax.random.normal(k1, rs.d.shape, rs.d.dtype) * 0.1, k=jax.random.normal(k2, rs.k.shape, rs.k.dtype) * 0.1,
                g=-jax.random.uniform(k3, rs.g.shape) * 0.2)
kw = dict(scale=bench.s.K ** -0.5)
o_ref, rs_ref = kernels.gdn_replay_step(rs, **inp, **kw, use_qk_l2norm=True, route="append", interpret=interp)
o, dnew = (functools.partial(gdn_append_pipelined, blocks=8) if os.environ.get("PIPE") else gdn_append)(rs.checkpoint, rs.d, rs.k, rs.g, rs.cursor, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                     **kw, interpret=interp)
o_ref, o = np.asarray(o_ref, np.float32), np.asarray(o, np.float32)
print("o err", np.abs(o - o_ref).max() / np.abs(o_ref).max())
dd = np.asarray(dnew, np.float32) - np.asarray(rs_ref.d, np.float32)
print("d err", np.abs(dd).max() / np.abs(np.asarray(rs_ref.d, np.float32)).max())
