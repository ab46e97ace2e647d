"""A/B on the GDN standard step (Qwen3.5-4B layer): the tree's kernel against the output formed from the loaded
tile (o = decay S q + d (k . q), both matvecs on the loaded tile side by side, the update fused), on 16 x 1 and
8 x 1 tiles. Kernel us a step (CUPTI), each variant checked against the f32 reference first; the tree first and
last."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn, tiles
from replayssm_jax.kernels.config import StepConfig

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
base_kernel = gdn._step_kernel
f32 = jnp.float32


def split_kernel(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
                 use_qk_l2norm, dot_fold, programs, conv=None):
    assert records is None and conv is None
    BV, BK = state_ref.shape
    vmask = tiles.row_mask(BV, V)
    kmask, q, k = gdn._load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    tmask = tiles.tile_mask(vmask, kmask, (BV, BK))
    S = tiles.load_checkpoint(state_ref, None, tmask, vmask)
    g, beta = gdn._gates(inputs)
    decay, v = jnp.exp(g), tiles.load(inputs.v, vmask)
    Sk, Sq = tiles.matvec(S, k), tiles.matvec(S, q)
    d = beta * (v - decay * Sk)
    o = decay * Sq + d * jnp.sum(k * q)
    upd = d[:, None] * k[None, :]
    S = tiles.fma(S, jnp.broadcast_to(decay, S.shape), upd) if state_ref.dtype == f32 else S * decay + upd
    tiles.store(o_ref, o, vmask)
    tiles.store_checkpoint(state_ref, state_out_ref, None, S, tmask, vmask, None, K)


def ok(b, config):
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(2)
        s_k = b.state(); s_r = s_k.astype(f32)
        ys, states = [], []
        for t in range(2):
            x = kb._take(xs, t)
            y_k, s_k = b.step(s_k, x, "pallas", config)
            y_r, s_r = b.step(s_r, x, "xla")
            ys.append((y_k, y_r)); states.append((s_k, s_r))
        return bool(kb._compared(ys, tol)["ok"] and kb._compared(states, tol)["ok"])


c8 = StepConfig(block_v=8, num_warps=1, num_stages=1)
VARIANTS = [("16x1 tree", None, None), ("16x1 split", split_kernel, None), ("8x1 tree", None, c8),
            ("8x1 split", split_kernel, c8), ("16x1 tree (again)", None, None)]
rows = []
for sd, batch in [("float32", 256), ("float32", 64), ("float32", 512), ("bfloat16", 256)]:
    b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
    for name, kernel, config in VARIANTS:
        gdn._step_kernel = kernel or base_kernel
        jax.clear_caches()
        good = ok(b, config)
        r = kb.run_variant(b, None, None, opts, config=config)
        ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
        row = dict(batch=batch, state=sd, variant=name, ok=good, us=round(r["seconds"] * 1e6, 2),
                   kernel_us=ks.get("(all kernels)"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    gdn._step_kernel = base_kernel
    json.dump(rows, open(f"{OUT}/split_output_probe.json", "w"), indent=1)
print()
for r in rows:
    print(f"{r['batch']:4d} {r['state']:9s} {r['variant']:18s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
