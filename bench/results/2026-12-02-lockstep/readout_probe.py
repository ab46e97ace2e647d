"""Probe: GDN replay readout with the original's loop structure (grid per row tile, loop over K chunks,
dot per chunk, few warps, pipelining stages) against our replay kernel, batch 256 f32 state, L = 16.
Replay readout only (no flush); kernel times from the profiler."""
import functools, json, os, sys, time
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import kernels as kb
from replayssm_jax.kernels.replay_math import rank_update, replay_weights
from replayssm_jax.kernels.tiles import lane_ids
from replayssm_jax.kernels.config import ReplayConfig

f32 = jnp.float32
OUT = os.environ.get("OUT", "/tmp/out")
B = int(os.environ.get("PB", "256"))
L = 16


def stream_kernel(ck, d, kr, gr, cur, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, dout, *, BKT, NK, route, scale,
                  K, unroll=False):
    """Cursor-independent work first: the checkpoint and key chunks against raw q and k."""
    BL, BV = gr.shape[0], ck.shape[0]

    def body(kk, acc):
        sq, sk, aq, ak, qq, kk_, qk = acc
        start = kk * BKT if isinstance(kk, int) else pl.multiple_of(kk * BKT, BKT)
        cols = pl.ds(start, BKT)
        Sc = plgpu.load(ck.at[:, cols]).astype(f32)
        qc = plgpu.load(q_ref.at[cols]).astype(f32)
        kc = plgpu.load(k_ref.at[cols]).astype(f32)
        Kf = plgpu.load(kr.at[:, cols]).astype(f32)
        return (sq + jnp.sum(Sc * qc[None, :], 1), sk + jnp.sum(Sc * kc[None, :], 1),
                aq + jnp.sum(Kf * qc[None, :], 1), ak + jnp.sum(Kf * kc[None, :], 1),
                qq + jnp.sum(qc * qc), kk_ + jnp.sum(kc * kc), qk + jnp.sum(qc * kc))

    z, zl, z0 = jnp.zeros((BV,), f32), jnp.zeros((BL,), f32), jnp.zeros((), f32)
    acc = (z, z, zl, zl, z0, z0, z0)
    if unroll or NK == 1:
        for i in range(NK):
            acc = body(i, acc)
    else:
        acc = jax.lax.fori_loop(0, NK, body, acc)
    sq, sk, aq, ak, qq, kk_, qk = acc
    rq = jax.lax.rsqrt(qq + 1e-6) * scale
    rk = jax.lax.rsqrt(kk_ + 1e-6)
    count = cur[()]
    live = lane_ids(BL) < count
    total, w = replay_weights(jnp.where(live, gr[...], 0.0), count)
    U = jnp.where(live[:, None], plgpu.load(d).astype(f32), 0.0)
    carried = jnp.exp(total)
    aq = jnp.where(live, w * aq, 0.0)
    ak = jnp.where(live, w * ak, 0.0)
    sq = rq * (carried * sq + jnp.sum(aq[:, None] * U, 0))
    sk = rk * (carried * sk + jnp.sum(ak[:, None] * U, 0))
    kq = qk * rq * rk
    decay = jnp.exp(g_ref[()])
    beta = beta_ref[()].astype(f32)
    v = plgpu.load(v_ref).astype(f32)
    dcur = beta * (v - decay * sk)
    o = decay * sq + kq * dcur
    plgpu.store(o_ref, o.astype(o_ref.dtype))
    plgpu.store(dout.at[jnp.minimum(count, L - 1)], dcur.astype(dout.dtype), mask=jnp.broadcast_to(count < L, (BV,)))


def kernel(ck, d, kr, gr, cur, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, dout, *, BKT, NK, route, scale, K):
    if route.startswith("stream"):
        return stream_kernel(ck, d, kr, gr, cur, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, dout, BKT=BKT, NK=NK,
                             route=route, scale=scale, K=K, unroll=route == "stream-unroll")
    count = cur[()]
    BL = gr.shape[0]
    live = lane_ids(BL) < count
    total, w = replay_weights(jnp.where(live, gr[...], 0.0), count)
    U = jnp.where(live[:, None], plgpu.load(d).astype(f32), 0.0)
    Uw = U * w[:, None]
    qf = plgpu.load(q_ref).astype(f32)
    kf = plgpu.load(k_ref).astype(f32)
    rq = jax.lax.rsqrt(jnp.sum(qf * qf) + 1e-6) * scale
    rk = jax.lax.rsqrt(jnp.sum(kf * kf) + 1e-6)
    carried = jnp.exp(total)
    BV = ck.shape[0]

    def body(kk, acc):
        sq, sk, aq, ak, kq = acc
        start = kk * BKT if isinstance(kk, int) else pl.multiple_of(kk * BKT, BKT)
        cols = pl.ds(start, BKT)
        Sc = plgpu.load(ck.at[:, cols]).astype(f32)
        qc = plgpu.load(q_ref.at[cols]).astype(f32) * rq
        kc = plgpu.load(k_ref.at[cols]).astype(f32) * rk
        kq = kq + jnp.sum(qc * kc)
        if route == "read":
            return sq + jnp.sum(Sc, axis=1), sk, aq, ak, kq
        Kb = jnp.where(live[:, None], plgpu.load(kr.at[:, cols]), jnp.zeros((), kr.dtype))
        if route == "state":
            S = rank_update(carried * Sc, Uw, Kb, f32)
            return sq + jnp.sum(S * qc[None, :], 1), sk + jnp.sum(S * kc[None, :], 1), aq, ak, kq
        Kf = Kb.astype(f32)
        return (sq + jnp.sum(Sc * qc[None, :], 1), sk + jnp.sum(Sc * kc[None, :], 1),
                aq + jnp.sum(Kf * qc[None, :], 1), ak + jnp.sum(Kf * kc[None, :], 1), kq)

    z = jnp.zeros((BV,), f32)
    zl = jnp.zeros((BL,), f32)
    acc = (z, z, zl, zl, jnp.zeros((), f32))
    acc = jax.lax.fori_loop(0, NK, body, acc) if NK > 1 else body(0, acc)
    sq, sk, aq, ak, kq = acc
    if route == "output":
        sq = carried * sq + jnp.sum((w * aq)[:, None] * U, 0)
        sk = carried * sk + jnp.sum((w * ak)[:, None] * U, 0)
    decay = jnp.exp(g_ref[()])
    beta = beta_ref[()].astype(f32)
    v = plgpu.load(v_ref).astype(f32)
    dcur = beta * (v - decay * sk)
    o = decay * sq + kq * dcur
    plgpu.store(o_ref, o.astype(o_ref.dtype))
    plgpu.store(dout.at[jnp.minimum(count, L - 1)], dcur.astype(dout.dtype), mask=jnp.broadcast_to(count < L, (BV,)))


@functools.partial(jax.jit, static_argnames=("BV", "NK", "warps", "stages", "route", "order", "interpret"), donate_argnums=(0,))
def probe_step(rs, inp, *, BV, NK, warps, stages, route, order, interpret=False):
    ck, d, kr, gr, cur = rs.checkpoint, rs.d, rs.k, rs.g, rs.cursor
    Bn, HV, V, K = ck.shape
    H = kr.shape[1]
    group = HV // H
    NV = V // BV
    if order == "mem":  # row tiles fastest
        grid = (NV, HV, Bn)
        im = lambda f: (lambda j, h, b: f(b, h, j))
    else:
        grid = (Bn, HV, NV)
        im = lambda f: (lambda b, h, j: f(b, h, j))
    spec = lambda shape, f: pl.BlockSpec(shape, im(f))
    in_specs = [
        spec((None, None, BV, K), lambda b, h, j: (b, h, j, 0)),
        spec((None, None, L, BV), lambda b, h, j: (b, h, 0, j)),
        spec((None, None, L, K), lambda b, h, j: (b, h // group, 0, 0)),
        spec((None, None, L), lambda b, h, j: (b, h, 0)),
        spec((None,), lambda b, h, j: (b,)),
        spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
        spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
        spec((None, None, BV), lambda b, h, j: (b, h, j)),
        spec((None, None), lambda b, h, j: (b, h)),
        spec((None, None), lambda b, h, j: (b, h)),
    ]
    out_specs = [spec((None, None, BV), lambda b, h, j: (b, h, j)),
                 spec((None, None, L, BV), lambda b, h, j: (b, h, 0, j))]
    o, d = pl.pallas_call(
        functools.partial(kernel, BKT=K // NK, NK=NK, route=route, scale=K ** -0.5, K=K),
        grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(inp["v"].shape, inp["v"].dtype), jax.ShapeDtypeStruct(d.shape, d.dtype)],
        input_output_aliases={1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
    )(ck, d, kr, gr, cur, inp["q"], inp["k"], inp["v"], inp["g"].astype(f32), inp["beta"])
    return o, rs.replace(d=d)


VARIANTS = [(64, 2, 1, 1, "output", "mem"), (64, 2, 1, 1, "stream", "mem"), (64, 2, 1, 1, "stream-unroll", "mem"),
            (64, 4, 1, 1, "stream", "mem"), (64, 2, 2, 1, "stream", "mem"), (64, 1, 2, 1, "stream", "mem"),
            (64, 1, 4, 1, "stream", "mem"), (32, 1, 1, 1, "stream", "mem"), (32, 2, 1, 1, "stream", "mem"),
            (32, 1, 2, 1, "stream", "mem"), (128, 1, 4, 1, "stream", "mem"), (128, 2, 4, 1, "stream", "mem"),
            (64, 2, 1, 1, "stream", "b"), (16, 1, 1, 1, "stream", "mem"), (64, 4, 2, 1, "stream-unroll", "mem"),
            (64, 1, 4, 1, "read", "mem")]
if os.environ.get("PV"):
    VARIANTS = [tuple(int(x) if x.isdigit() else x for x in v.split(":")) for v in os.environ["PV"].split(",")]


def main():
    rng = np.random.default_rng(0)
    bench = kb.make_bench("gdn", B, "float32", rng)
    opts = kb.TimingOptions(repeats=3, profile=True)
    inp = bench.random_inputs((B,))
    rows = []
    # ours: default (output route), and the state route default tiling
    for route in ("output",):
        r = kb.run_variant(bench, L, "staggered", opts, route=route)
        rows.append(dict(name=f"ours-{route}", us=r["seconds"] * 1e6, kernels=r["kernels_us"]))
        print(rows[-1]["name"], f"{rows[-1]['us']:.1f}", {k: round(v["us"], 1) for k, v in (r["kernels_us"] or {}).items()}, flush=True)
    n = kb.n_sets_for(bench, opts)
    variants = [dict(BV=bv, NK=nk, warps=w, stages=s, route=rt, order=o) for (bv, nk, w, s, rt, o) in VARIANTS]
    for v in variants:
        name = "probe-" + "-".join(f"{k}{val}" for k, val in v.items())
        try:
            cur = np.arange(B) % L
            carries = tuple(bench.replay_state(L, f32, jnp.bfloat16, cur) for _ in range(n))
            err = check(bench, inp, v)
            step = lambda c, x, v=v: probe_step(c, x, **v)
            t, spread, cs, prof = kb.time_cycle(step, carries, inp, L, opts)
            rows.append(dict(name=name, us=t * 1e6, kernels=prof, err=err, **v))
            print(name, f"{t*1e6:.1f}", f"err {err:.2e}", {k: round(val["us"], 1) for k, val in (prof or {}).items()}, flush=True)
        except Exception as e:  # noqa
            print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(rows, open(f"{OUT}/kchunk_probe_b{B}.json", "w"), indent=1, default=str)


def check(bench, inp, v, interpret=False):
    """max |o_probe - o_ours| / max |o_ours| on one state (staggered cursors); the read route: nan."""
    if v["route"] == "read":
        return float("nan")
    from replayssm_jax import kernels
    rs = bench.replay_state(L, f32, jnp.bfloat16, np.arange(bench.b) % (L - 1))
    o_ref, _ = kernels.gdn_replay_step(rs, **inp, scale=bench.s.K ** -0.5, use_qk_l2norm=True, route="output",
                                       interpret=interpret)
    o, _ = probe_step(rs, inp, **v, interpret=interpret)
    o_ref, o = np.asarray(o_ref, np.float32), np.asarray(o, np.float32)
    return float(np.abs(o - o_ref).max() / np.abs(o_ref).max())


if __name__ == "__main__":
    main()
