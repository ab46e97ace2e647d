"""Where a timed cycle's wall time over its kernel time goes (bench/RESULTS.md, 2026-12-04): chains of 1, 4 and 16
calls of 32 and 128 layer-steps a call, and a trace of a chain of 4 calls. Run from the repository root on a GPU."""
import json, statistics, sys, time
import numpy as np, jax
sys.path.insert(0, "bench")
import kernels as K, step_profile

def build(layer, batch, L, cursors, route, sets=2, steps_mult=1):
    rng = np.random.default_rng(0)
    import jax.numpy as jnp
    bench = K.make_bench(layer, batch, jnp.float32, rng)
    if L is None:
        carries = tuple(bench.state() for _ in range(sets))
        step = lambda c, inp: bench.step(c, inp, "pallas", None)
        steps = 16 * steps_mult
    else:
        cur = np.arange(bench.b) % L if cursors == "staggered" else np.zeros(bench.b)
        carries = tuple(bench.replay_init(bench.state(), L, bench.dtype, cur) for _ in range(sets))
        step = lambda c, inp: bench.replay_step(c, inp, route, "pallas", None)
        steps = L * steps_mult
    inputs = tuple(bench.random_inputs((bench.b,)) for _ in range(steps))
    def cycle(carries, inp):
        for t in range(steps):
            new = []
            for c in carries:
                y, c = step(c, inp[t]); new.append(c)
            carries = tuple(new)
        return carries, y
    return jax.jit(cycle, donate_argnums=0), carries, inputs, steps * sets

def chain(f, carries, inp, n):
    t0 = time.perf_counter()
    for _ in range(n):
        carries, y = f(carries, inp)
    jax.block_until_ready((carries, y))
    return time.perf_counter() - t0, carries

def traced(f, carries, inp, n):
    box = []
    prof = step_profile.trace(lambda: box.append(chain(f, carries, inp, n)))
    wins, ks = [], []
    for p in prof.planes:
        if not p.name.startswith("/device:GPU"): continue
        for line in p.lines:
            if line.name == "XLA Modules": wins += [(e.start_ns, e.end_ns) for e in line.events if "jit_cycle" in e.name]
            elif line.name.startswith("Stream"): ks += [(e.start_ns, e.end_ns, e.name) for e in line.events]
    wins.sort(); ks.sort()
    gaps_between = [b[0] - a[1] for a, b in zip(wins, wins[1:])]
    kin = sum(e - s for s, e, _ in ks)
    span = ks[-1][1] - ks[0][0]
    kgaps = [b[0] - a[1] for a, b in zip(ks, ks[1:])]
    big = sorted(kgaps)[-6:]
    return dict(n_windows=len(wins), window_us=[round((e - s) / 1e3, 1) for s, e in wins], gaps_between_us=[round(g / 1e3, 1) for g in gaps_between],
                kernels_us=kin / 1e3, span_us=span / 1e3, host_s=box[0][0], n_kernels=len(ks), largest_kernel_gaps_us=[round(g / 1e3, 1) for g in big],
                mean_kernel_gap_us=statistics.mean(kgaps) / 1e3 if kgaps else 0), box[0][1]

out = []
cases = [("gdn", 64, None, None, None), ("gdn", 256, None, None, None), ("gdn", 256, 16, "in-step", "deferred"),
         ("mamba2", 256, None, None, None), ("gdn", 512, 16, "staggered", "deferred")]
for layer, b, L, cur, route in cases:
    for mult in (1, 4):
        f, carries, inp, per = build(layer, b, L, cur, route, steps_mult=mult)
        carries, y = f(carries, inp); jax.block_until_ready(carries)
        row = dict(layer=layer, batch=b, L=L, cursors=cur, route=route, steps_per_call=per)
        for n in (1, 4, 16):
            ts = []
            for _ in range(5):
                t, carries = chain(f, carries, inp, n); ts.append(t)
            row[f"wall_us_per_step_chain{n}"] = statistics.median(ts) / n / per * 1e6
        tr, carries = traced(f, carries, inp, 4)
        row["trace4"] = {k: (v / (4 * per) if k in ("kernels_us", "span_us") else v) for k, v in tr.items()}
        row["trace4"]["host_us_per_step"] = tr["host_s"] / (4 * per) * 1e6
        print(json.dumps(row), flush=True)
        out.append(row)
        del f, carries, inp
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "wall_probe.json"), "w"), indent=1)
print("\nlayer batch L cursors route per | chain1 chain4 chain16 | trace: kernels span host  gaps_between(us)")
for r in out:
    t = r["trace4"]
    print(r["layer"], r["batch"], r["L"], r["cursors"], r["route"], r["steps_per_call"], "|",
          *(f"{r[f'wall_us_per_step_chain{n}']:.1f}" for n in (1, 4, 16)), "|", f"{t['kernels_us']:.1f} {t['span_us']:.1f} {t['host_us_per_step']:.1f}", t["gaps_between_us"], t["largest_kernel_gaps_us"])
