"""Time the Mosaic GPU append readout against our Triton append kernel, one GPU run."""
import sys, os, json, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "bench/results/2026-12-02-mosaic-gpu-probe"); sys.path.insert(0, "bench")
from gdn_mgpu import gdn_append, gdn_append_pipelined, gdn_append_pre
import kernels as kb
L = 16
OUT = os.environ.get("OUT", "/tmp/out")
rows = []
for sdn in os.environ.get("SDS", "float32,bfloat16").split(","):
    for B in [int(x) for x in os.environ.get("PBS", "256").split(",")]:
        sd = jnp.dtype(sdn)
        bench = kb.make_bench("gdn", B, sd, np.random.default_rng(0))
        opts = kb.TimingOptions(repeats=3, profile=True)
        inp = bench.random_inputs((B,))
        n = kb.n_sets_for(bench, opts)
        kw = dict(scale=bench.s.K ** -0.5)
        def ours(c, x):
            return bench.replay_step(c, x, "append", "pallas", None)
        def probe(c, x, bv):
            o, d = gdn_append(c.checkpoint, c.d, c.k, c.g, c.cursor, x["q"], x["k"], x["v"], x["g"], x["beta"], **kw, block_v=bv)
            return o, c.replace(d=d, cursor=jnp.minimum(c.cursor + 1, L))
        def pipe(c, x, bv, st, bl, mode="full"):
            if mode == "one":  # one item per program (stages and programs unused)
                return probe(c, x, bv)
            if mode == "pre":
                o, d = gdn_append_pre(c.checkpoint, c.d, c.k, c.g, c.cursor, x["q"], x["k"], x["v"], x["g"],
                                      x["beta"], **kw, block_v=bv, stages=st, blocks=bl)
                return o, c.replace(d=d, cursor=jnp.minimum(c.cursor + 1, L))
            o, d = gdn_append_pipelined(c.checkpoint, c.d, c.k, c.g, c.cursor, x["q"], x["k"], x["v"], x["g"],
                                        x["beta"], **kw, block_v=bv, stages=st, blocks=bl, mode=mode)
            return o, c.replace(d=d, cursor=jnp.minimum(c.cursor + 1, L))
        PV = os.environ.get("PV_" + sdn, "read:64:2:264,read:64:4:132,read:128:2:132,noslots:64:2:264")
        variants = [("ours-append", ours)] + [
            (f"pipe-{m}-bv{bv}-st{st}-bl{bl}", lambda c, x, bv=bv, st=st, bl=bl, m=m: pipe(c, x, bv, st, bl, m))
            for m, bv, st, bl in ((v.split(":")[0], *map(int, v.split(":")[1:])) for v in PV.split(","))]
        # correctness on one state with live records (staggered cursors < L)
        cur = np.arange(B) % (L - 1)
        rs = bench.replay_init(bench.state(), L, bench.dtype, cur)
        k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
        rs = rs.replace(d=jax.random.normal(k1, rs.d.shape, rs.d.dtype) * 0.1,
                        k=jax.random.normal(k2, rs.k.shape, rs.k.dtype) * 0.1, g=-jax.random.uniform(k3, rs.g.shape) * 0.2)
        o_ref, rs_ref = ours(rs, inp)
        o_ref, d_ref = np.asarray(o_ref, np.float32), np.asarray(rs_ref.d, np.float32)
        for name, f in variants:
            try:
                o, r2 = jax.jit(f)(rs, inp)
                err = float(np.abs(np.asarray(o, np.float32) - o_ref).max() / np.abs(o_ref).max())
                derr = float(np.abs(np.asarray(r2.d, np.float32) - d_ref).max() / np.abs(d_ref).max())
                carries = tuple(bench.replay_init(bench.state(), L, bench.dtype, np.zeros(B)) for _ in range(n))
                t, spread, cs, prof = kb.time_cycle(f, carries, inp, L - 1, opts)
                ker = {k: round(v["us"], 1) for k, v in (prof or {}).items()}
                rows.append(dict(name=name, state=sdn, batch=B, us=t * 1e6, err=err, derr=derr, kernels=ker))
                print(f"{sdn} b{B} {name:14s} wall {t*1e6:7.1f} us  err {err:.1e} d {derr:.1e}  {ker}", flush=True)
            except Exception as e:
                print(f"{sdn} b{B} {name} FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
os.makedirs(OUT, exist_ok=True)
json.dump(rows, open(f"{OUT}/mgpu_probe.json", "w"), indent=1)
