"""Probe: the GDN standard step, Qwen3.5-4B's layer, f32 and bf16 state, batch 64 and 256: the Triton kernel
as built, with its state tile loaded first, with evict-first / .cg cache hints on the state, and the Mosaic GPU
step on several tilings. Kernel us a step; the default timed first and last."""
import functools, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas import triton as plgpu
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn, TMAReadoutConfig
from replayssm_jax.kernels import tiles

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
base_kernel = gdn._step_kernel


def variant_kernel(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
                   use_qk_l2norm, dot_fold, programs, first, evict, cache, store_evict):
    if records is not None:
        return base_kernel(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, V=V, K=K,
                           L=L, scale=scale, use_qk_l2norm=use_qk_l2norm, dot_fold=dot_fold, programs=programs)
    load_S = lambda: plgpu.load(state_ref, eviction_policy=evict, cache_modifier=cache).astype(jnp.float32)
    if first:
        S = load_S()
    _, q, k = gdn._load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    if not first:
        S = load_S()
    decay, v, beta = jnp.exp(tiles.load_scalar(inputs.g)), tiles.load(inputs.v, None), tiles.load_scalar(inputs.beta)
    S = S * decay
    d = beta * (v - tiles.matvec(S, k))
    S = S + d[:, None] * k[None, :]
    tiles.store(o_ref, tiles.matvec(S, q), None)
    plgpu.store(state_out_ref, S.astype(state_out_ref.dtype), eviction_policy=store_evict)


TRITON = {"as built": None,
          "copy of as built": dict(first=False, evict=None, cache=None, store_evict=None),
          "state first": dict(first=True, evict=None, cache=None, store_evict=None),
          "evict_first load": dict(first=False, evict="evict_first", cache=None, store_evict=None),
          "evict_first load+store": dict(first=False, evict="evict_first", cache=None, store_evict="evict_first"),
          ".cg load": dict(first=False, evict=None, cache=".cg", store_evict=None),
          "state first, evict_first": dict(first=True, evict="evict_first", cache=None, store_evict="evict_first")}
TMA = {"float32": [(64, 2, 1), (64, 3, 1)], "bfloat16": [(64, 3, 1), (64, 4, 1), (64, 2, 2), (64, 3, 2), (128, 2, 1),
                                                         (128, 3, 1)]}
rows = []


def standard_ok(b, config):
    """Two standard steps against the f32 reference (the benchmark's tolerance): True if within it."""
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(2)
        state = b.state()
        s_k, s_r = state, state.astype(jnp.float32)
        ys, states = [], []
        for t in range(2):
            x = kb._take(xs, t)
            y_k, s_k = b.step(s_k, x, "pallas", config)
            y_r, s_r = b.step(s_r, x, "xla")
            ys.append((y_k, y_r)); states.append((s_k, s_r))
        return bool(kb._compared(ys, tol)["ok"] and kb._compared(states, tol)["ok"])


def record(batch, sd, name, r, ok):
    ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
    row = dict(batch=batch, state=sd, variant=name, ok=ok, us=round(r["seconds"] * 1e6, 2), kernel_us=ks.get("(all kernels)"),
               kernels=ks)
    rows.append(row)
    print(json.dumps(row), flush=True)


for batch in tuple(int(x) for x in os.environ.get("PROBE_BATCHES", "256,64").split(",")):
    for sd in ("float32", "bfloat16"):
        b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
        names = [n for n in os.environ.get("PROBE_TRITON", ",".join(TRITON)).split(",") if n] + ["as built (again)"]
        for name in names:
            flags = TRITON.get(name)
            gdn._step_kernel = base_kernel if flags is None else functools.partial(variant_kernel, **flags)
            jax.clear_caches()
            ok = standard_ok(b, None)
            record(batch, sd, name, kb.run_variant(b, None, None, opts), ok)
        gdn._step_kernel = base_kernel
        jax.clear_caches()
        for bv, st_, p in TMA[sd]:
            try:
                config = TMAReadoutConfig(block_v=bv, stages=st_, programs_per_sm=p)
                ok = standard_ok(b, config)
                r = kb.run_variant(b, None, None, opts, config=config)
            except Exception as e:  # noqa: BLE001 (a tiling whose shared memory does not fit)
                print("tma", bv, st_, p, "refused:", type(e).__name__, str(e)[:160], flush=True)
                continue
            record(batch, sd, f"mosaic {bv}x{st_}st x{p}", r, ok)
        json.dump(rows, open(f"{OUT}/probe_std.json", "w"), indent=1)
print()
for r in rows:
    print(f"{r['batch']:4d} {r['state']:9s} {r['variant']:28s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} wall {r['us']:8.2f}")
