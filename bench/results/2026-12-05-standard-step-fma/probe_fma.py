"""Probe: the GDN standard step (Qwen3.5-4B layer) as built and with its arithmetic rewritten: the state update as
one fused multiply-add (PTX fma.rn.f32 by inline asm: XLA's Triton path contracts none), and the output from the
loaded tile (o = decay * S q + d (k . q): both reductions on the loaded tile, side by side), with and without the
fma. Kernel us a step (CUPTI), each variant first checked against the f32 reference; as built first and last."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas import triton as plgpu
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn
from replayssm_jax.kernels import tiles

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
base_kernel = gdn._step_kernel
f32 = jnp.float32


def fma(a, b, c):
    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    args = [jnp.broadcast_to(x.astype(f32), shape) for x in (a, b, c)]
    [r] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=args, constraints="=f,f,f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(shape, f32)])
    return r


def variant_kernel(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
                   use_qk_l2norm, dot_fold, programs, use_fma, split):
    assert records is None
    BV, BK = state_ref.shape
    vmask = tiles.row_mask(BV, V)
    kmask, q, k = gdn._load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    tmask = tiles.tile_mask(vmask, kmask, (BV, BK))
    S = tiles.load_checkpoint(state_ref, None, tmask, vmask)
    g, beta = gdn._gates(inputs)
    decay, v = jnp.exp(g), tiles.load(inputs.v, vmask)
    if split:
        Sk, Sq = tiles.matvec(S, k), tiles.matvec(S, q)
        d = beta * (v - decay * Sk)
        o = decay * Sq + d * jnp.sum(k * q)
        S = fma(S, decay, d[:, None] * k[None, :]) if use_fma else S * decay + d[:, None] * k[None, :]
    else:
        S = S * decay
        d = beta * (v - tiles.matvec(S, k))
        S = fma(d[:, None], k[None, :], S) if use_fma else S + d[:, None] * k[None, :]
        o = tiles.matvec(S, q)
    tiles.store(o_ref, o, vmask)
    tiles.store_checkpoint(state_ref, state_out_ref, None, S, tmask, vmask, None, K)


VARIANTS = {"as built": None, "fma update": dict(use_fma=True, split=False),
            "split reductions": dict(use_fma=False, split=True), "split + fma": dict(use_fma=True, split=True)}
rows = []


def standard_ok(b):
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(2)
        s_k = b.state(); s_r = s_k.astype(f32)
        ys, states = [], []
        for t in range(2):
            x = kb._take(xs, t)
            y_k, s_k = b.step(s_k, x, "pallas", None)
            y_r, s_r = b.step(s_r, x, "xla")
            ys.append((y_k, y_r)); states.append((s_k, s_r))
        c = kb._compared(ys, tol), kb._compared(states, tol)
        return bool(c[0]["ok"] and c[1]["ok"]), c[0].get("max_abs"), c[1].get("max_abs")


for batch, sd in [(256, "float32"), (64, "float32"), (256, "bfloat16"), (512, "float32")]:
    b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
    for name in list(VARIANTS) + ["as built (again)"]:
        flags = VARIANTS.get(name)
        gdn._step_kernel = base_kernel if flags is None else functools.partial(variant_kernel, **flags)
        jax.clear_caches()
        ok = standard_ok(b)
        r = kb.run_variant(b, None, None, opts)
        ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
        row = dict(batch=batch, state=sd, variant=name, ok=ok, us=round(r["seconds"] * 1e6, 2),
                   kernel_us=ks.get("(all kernels)"), kernels=ks)
        rows.append(row)
        print(json.dumps(row), flush=True)
    gdn._step_kernel = base_kernel
    json.dump(rows, open(f"{OUT}/probe_fma.json", "w"), indent=1)
print()
for r in rows:
    print(f"{r['batch']:4d} {r['state']:9s} {r['variant']:20s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
