"""The Mamba-2 launch after the Mosaic GPU readout (Nemotron-3-Nano-4B layer, L = 16): heads a program and warps.
Each variant first checked against the f32 reference (the deferred route from in-step cursors over L + 1 steps,
and a lockstep cycle on the append route and its direct step), then timed on the deferred route in step and
on the lockstep cycle. Kernel us a step (CUPTI)."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax import kernels
from replayssm_jax.kernels import mamba2 as m

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
ORIG = m.after_readout_heads  # with heads_a_program.patch applied
L = 16


def ok(b, backend="pallas", tma=True):
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(L + 2)
        good = True
        for routes, cfg in ((["deferred"] * (L + 1) + ["direct"], None), (["append"] * (L - 1) + ["direct"], kernels.TMAReadoutConfig() if tma else None)):
            state = b.state()
            rs = b.replay_init(state, L, b.dtype, np.zeros(b.b))
            s_r, ys = state.astype(jnp.float32), []
            for t, route in enumerate(routes):
                y_k, rs = b.replay_step(rs, kb._take(xs, t), route, backend, cfg if route == "append" else None)
                y_r, s_r = b.step(s_r, kb._take(xs, t), "xla")
                ys.append((y_k, y_r))
            good &= bool(kb._compared(ys, tol)["ok"] and kb._compared([(rs.checkpoint, s_r)], tol)["ok"])
        return good


if sys.argv[1:] == ["cpu"]:
    print(ok(kb.make_bench("mamba2", 2, "float32", np.random.default_rng(0)), "interpret", False)); sys.exit()
rows = []
for sd, batch in (("bfloat16", 64), ("bfloat16", 256), ("bfloat16", 512), ("float32", 64)):
    b = kb.make_bench("mamba2", batch, sd, np.random.default_rng(0))
    for hb, warps in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (1, 1)):
        m.after_readout_heads = lambda H, group, dt_offset, hb=hb, warps=warps: (hb, warps)
        jax.clear_caches()
        good = ok(b)
        for cursors in ("in-step", "lockstep"):
            r = kb.run_variant(b, L, cursors, opts, route="deferred" if cursors == "in-step" else "output")
            ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(batch=batch, state=sd, heads=hb, warps=warps, cursors=cursors, ok=good,
                       us=round(r["seconds"] * 1e6, 2), kernel_us=ks.get("(all kernels)"),
                       launch_us=ks.get("mamba2_append_heads_L16"))
            rows.append(row)
            print(json.dumps(row), flush=True)
        json.dump(rows, open(f"{OUT}/probe_heads.json", "w"), indent=1)
m.after_readout_heads = ORIG
print()
for r in rows:
    print(f"mamba2 {r['batch']:4d} {r['state']:9s} {r['cursors']:8s} heads {r['heads']} w{r['warps']} ok {r['ok']!s:5s} "
          f"kernels {r['kernel_us']:8.2f} launch {r['launch_us']:7.2f} wall {r['us']:8.2f}")
