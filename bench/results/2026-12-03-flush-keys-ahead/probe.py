"""Probe: where the GDN deferred step's time goes (prelude variants, flush variants) and the standard
step's tilings, at batch 256 f32 L16. Source-patched variants time parts left out; their outputs are wrong."""
import inspect, json, os, sys, textwrap
sys.path.insert(0, "bench")
import jax, numpy as np
import kernels as kb
from replayssm_jax import kernels
from replayssm_jax.kernels import gdn, tma_readout, tma_step
from replayssm_jax.kernels.config import StepConfig

OUT = os.environ.get("OUT", "/tmp")
which = sys.argv[1:] or ["prelude", "flush", "standard"]
opts = kb.TimingOptions(repeats=3, profile=True)
b = kb.make_bench("gdn", 256, "float32", np.random.default_rng(0))
rows = []


def patched(module, name, edits, base):
    src = textwrap.dedent(inspect.getsource(base))
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new)
    ns = dict(vars(module))
    exec(compile(src, f"<{name}>", "exec"), ns)
    return ns[name]


def run(tag, L, cursors, route, config=None):
    jax.clear_caches()
    r = kb.run_variant(b, L, cursors, opts, config=config, route=route)
    ks = {k: round(v["us"] if isinstance(v, dict) else v, 2) for k, v in (r["kernels_us"] or {}).items()}
    row = dict(tag=tag, us=round(r["seconds"] * 1e6, 2), kernels=ks)
    rows.append(row)
    print(json.dumps(row), flush=True)


def variants(module, name, table):
    base = getattr(module, name)
    for tag, edits, args in table:
        setattr(module, name, patched(module, name, edits, base) if edits else base)
        try:
            run(tag, *args)
        except Exception as e:  # noqa: BLE001
            print(tag, "failed", type(e).__name__, str(e)[:300], flush=True)
    setattr(module, name, base)


if "prelude" in which:
    stash = ("if deferred:  # the full row's slot-0 key, read before this step's record replaces it", "if False:")
    fw = ("if deferred:  # the full row's L slots, its flush's decay weights (zeros for other rows)", "if False:")
    variants(gdn, "_terms_kernel", [
        ("deferred-stag", [], (16, "staggered", "deferred")),
        ("deferred-stag-nostash", [stash], (16, "staggered", "deferred")),
        ("deferred-stag-noflushw", [fw], (16, "staggered", "deferred")),
        ("deferred-stag-neither", [stash, fw], (16, "staggered", "deferred")),
        ("append-lockstep", [], (16, "lockstep", "output")),
    ])

if "warps" in which:
    from replayssm_jax.kernels import launch
    base_warps = gdn.head_work_warps
    for w in (1, 2, 4):
        gdn.head_work_warps = lambda elements, w=w: w
        run(f"deferred-stag-w{w}", 16, "staggered", "deferred")
        run(f"append-lockstep-w{w}", 16, "lockstep", "output")
    gdn.head_work_warps = base_warps

if "flush" in which:
    nomath = ("S_s[...] = lax.fori_loop(0, L, add, S).astype(S_s.dtype)", "S_s[...] = S.astype(S_s.dtype)")
    half = ("lax.fori_loop(0, L, add, S)", "lax.fori_loop(0, L // 4, add, S)")
    variants(tma_readout, "_flush_tile", [
        ("instep-deferred", [], (16, "in-step", "deferred")),
        ("instep-flush-nomath", [nomath], (16, "in-step", "deferred")),
        ("instep-flush-quarter", [half], (16, "in-step", "deferred")),
    ])
    nod = [("plgpu.copy_gmem_to_smem(d_ref.at[b, h, :, pl.ds(j * BV, BV)], df_smem, barrier.at[1])", "pass"),
           ("for i in (1, 2, 3):", "for i in (2, 3):")]
    nocopy = nod + [("plgpu.copy_gmem_to_smem(keys, kf_smem.at[pl.ds(1, L - 1)], barrier.at[2])", "pass"),
                    ("plgpu.copy_gmem_to_smem(k0_ref.at[b, h // group], kf_smem.at[0], barrier.at[3])", "pass"),
                    ("for i in (2, 3):", "for i in ():")]
    nowait = [("plgpu.wait_smem_to_gmem(0, wait_read_only=True)", "pass")]
    variants(tma_readout, "_readout_kernel", [
        ("instep-no-dcopy", nod, (16, "in-step", "deferred")),
        ("instep-no-copies", nocopy, (16, "in-step", "deferred")),
        ("instep-no-storewait", nowait, (16, "in-step", "deferred")),
        ("stag-deferred", [], (16, "staggered", "deferred")),
    ])

if "deferred" in which:
    run("deferred-stag", 16, "staggered", "deferred")
    run("deferred-instep", 16, "in-step", "deferred")

if "stdsweep" in which:
    sweep = {"gdn": [None, StepConfig(32, 1), StepConfig(16, 1), StepConfig(16, 2)],
             "mamba2": [None, StepConfig(16, 1), StepConfig(8, 1), StepConfig(8, 2), StepConfig(32, 2)]}
    for layer, cfgs in sweep.items():
        for sd in ("float32", "bfloat16"):
            for batch in (64, 256, 512):
                b = kb.make_bench(layer, batch, sd, np.random.default_rng(0))
                for cfg in cfgs:
                    try:
                        run(f"{layer}-{sd}-b{batch}-{cfg and (cfg.block_v, cfg.num_warps)}", None, "staggered", "output", cfg)
                    except Exception as e:  # noqa: BLE001
                        print(cfg, "failed", type(e).__name__, str(e)[:300], flush=True)

if "standard" in which:
    for cfg in [None, StepConfig(32, 1), StepConfig(32, 2), StepConfig(32, 1, 3), StepConfig(16, 1), StepConfig(16, 2),
                StepConfig(64, 4), StepConfig(64, 8), StepConfig(32, 8), StepConfig(128, 8)]:
        try:
            run(f"std-{cfg}", None, "staggered", "output", cfg)
        except Exception as e:  # noqa: BLE001
            print(cfg, "failed", type(e).__name__, str(e)[:300], flush=True)
    for cfg in [tma_step.STEP_CONFIG, tma_readout.TMAReadoutConfig(block_v=32, stages=3, programs_per_sm=2),
                tma_readout.TMAReadoutConfig(block_v=64, stages=2, programs_per_sm=1),
                tma_readout.TMAReadoutConfig(block_v=32, stages=4, programs_per_sm=1),
                tma_readout.TMAReadoutConfig(block_v=32, stages=2, programs_per_sm=2),
                tma_readout.TMAReadoutConfig(block_v=32, stages=2, programs_per_sm=3)]:
        try:
            run(f"stdtma-{cfg}", None, "staggered", "output", cfg)
        except Exception as e:  # noqa: BLE001
            print(cfg, "failed", type(e).__name__, str(e)[:300], flush=True)

json.dump(rows, open(f"{OUT}/probe_{'_'.join(which)}.json", "w"), indent=1)
for r in rows:
    print(f"{r['tag'][:70]:70s} {r['us']:8.2f}  " + "  ".join(f"{k[:28]}={v}" for k, v in r["kernels"].items()))
