"""Time the TMA readout's Triton prelude launch alone at Qwen3.5-4B's GDN shape, over num_warps."""
import sys, time
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
from replayssm_jax.kernels import gdn
import step_profile
for batch in (256, 512):
    bench = kb.make_bench("gdn", batch, "float32", np.random.default_rng(0))
    rs = bench.replay_init(bench.state(), 16, bench.dtype, np.arange(batch) % 16)
    inp = gdn._f32_decay(gdn.Inputs(**bench._kw(bench.random_inputs((batch,)))))
    rec = gdn.Records(rs.d, rs.k, rs.g)
    for w in (1, 2, 4, 8):
        gdn.TERMS_WARPS = w
        jax.clear_caches()
        f = jax.jit(lambda r, c, i: gdn._head_terms(r, c, i, scale=0.088, use_qk_l2norm=True, interpret=False)[:4])
        jax.block_until_ready(f(rec, rs.cursor, inp))
        n = 50
        trace = step_profile.trace(lambda: [jax.block_until_ready(f(rec, rs.cursor, inp)) for _ in range(n)])
        b = step_profile.decode_breakdown(trace, module="jit_<lambda>", top=4)
        us = {name: ns / n / 1e3 for name, ns, _ in b["top"]} if b else None
        print(f"b{batch} warps {w}: {us}", flush=True)
