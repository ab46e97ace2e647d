"""The GDN standard step (Qwen3.5-4B layer): its state update as a * b + c ("plain") or `tiles.fma`, on the
default 16 x 1 tile, on 32 x 1 and on 8 x 1. argv[1] "fma" (run 1): plain, fma, fma on 32 x 1 (f32 only),
plain; f32 at batch 64-512, bf16 at 64 and 256. "tiles" (run 2): the tree's default (fma on an f32 state,
plain on bf16), plain and fma on 8 x 1, the default again; both dtypes at batch 64-512. Kernel us a step
(CUPTI), each variant first checked against the f32 reference. Run from the repository root with
PYTHONPATH=$PWD."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn, tiles
from replayssm_jax.kernels.config import StepConfig

OUT = os.environ.get("OUT", "/tmp")
opts = kb.TimingOptions(repeats=3, profile=True)
plain = lambda a, b, c: a * b + c  # noqa: E731
tiling = lambda rows: StepConfig(block_v=rows, num_warps=1, num_stages=1)  # noqa: E731


def ok(b, config=None):
    """Two standard steps of bench `b` on the compiled kernels (tiling `config`) against the f32 reference."""
    with jax.default_matmul_precision("highest"):
        tol = kb.tolerance_dtype(b.dtype, b.sd)
        xs = b.inputs(2)
        s_k = b.state(); s_r = s_k.astype(jnp.float32)
        ys, states = [], []
        for t in range(2):
            x = kb._take(xs, t)
            y_k, s_k = b.step(s_k, x, "pallas", config)
            y_r, s_r = b.step(s_r, x, "xla")
            ys.append((y_k, y_r)); states.append((s_k, s_r))
        return bool(kb._compared(ys, tol)["ok"] and kb._compared(states, tol)["ok"])


def variants(sd):
    if sys.argv[1] == "fma":
        extra = [("fma 32x1", tiles.fma, tiling(32))] if sd == "float32" else []
        return [("plain", plain, None), ("fma", tiles.fma, None)] + extra + [("plain (again)", plain, None)]
    default = tiles.fma if sd == "float32" else plain
    return [("16x1 default", default, None), ("8x1 plain", plain, tiling(8)), ("8x1 fma", tiles.fma, tiling(8)),
            ("16x1 default (again)", default, None)]


if __name__ == "__main__":
    shapes = [("float32", 64), ("float32", 256), ("float32", 512), ("bfloat16", 64), ("bfloat16", 256)]
    if sys.argv[1] == "tiles":
        shapes.append(("bfloat16", 512))
    rows = []
    for sd, batch in shapes:
        b = kb.make_bench("gdn", batch, sd, np.random.default_rng(0))
        for name, f, config in variants(sd):
            gdn.fma = f
            jax.clear_caches()
            good = ok(b, config)
            r = kb.run_variant(b, None, None, opts, config=config)
            ks = {k: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items()}
            row = dict(layer="gdn", batch=batch, state=sd, variant=name, ok=good, us=round(r["seconds"] * 1e6, 2),
                       kernel_us=ks.get("(all kernels)"))
            rows.append(row)
            print(json.dumps(row), flush=True)
        gdn.fma = tiles.fma
        json.dump(rows, open(f"{OUT}/probe_std_tiles.json", "w"), indent=1)
    print()
    for r in rows:
        print(f"gdn {r['batch']:4d} {r['state']:9s} {r['variant']:20s} ok {r['ok']!s:5s} kernels {r['kernel_us']:8.2f} "
              f"wall {r['us']:8.2f}")
