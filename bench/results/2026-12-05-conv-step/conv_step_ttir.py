"""Write the Triton IR of the GDN standard step and of the fused conv step (Qwen3.5-4B layer, default tiling)
at batch 1, 64 and 256, f32 and bf16 state, lowered on a CPU for sm_90 (usage: conv_step_ttir.py DIR)."""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import pallas_call_registration as reg, lowering, gpu_info
sys.path.insert(0, "bench")  # run from the repository root
import conv_step as cs
from replayssm_jax import kernels

mods, real = [], lowering.lower_jaxpr_to_triton_module
def capture(*a, **k):
    r = real(*a, **k)
    mods.append(r.module.operation.get_asm(enable_debug_info=False))
    return r
reg.lowering.lower_jaxpr_to_triton_module = capture
gpu_info.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
folder = sys.argv[1]
rng = np.random.default_rng(0)
for sd in (jnp.float32, jnp.bfloat16):
    for batch in (1, 64, 256):
        (x, a, b), p = cs.make_inputs(batch, rng)
        state, columns, start = cs.make_carry(batch, sd, rng)
        kw = dict(a=a, b=b, A_log=p["A_log"], dt_bias=p["dt_bias"], scale=128 ** -0.5, use_qk_l2norm=True)
        for form in cs.FORMS:
            mods.clear()
            if form == "fused":
                f = lambda s, x, c, st: kernels.gdn_conv_step(s, x, c, st, p["weight"], **kw)
            else:
                def f(s, x, c, st):
                    (q, k, v), c = kernels.conv_update(x, c, st, p["weight"], splits=(2048, 4096))
                    return kernels.gdn_step(s, q.reshape(batch, 16, 128), k.reshape(batch, 16, 128), v.reshape(batch, 32, 128), **kw)
            jax.jit(f).trace(state, x, columns, start).lower(lowering_platforms=("cuda",))
            for i, m in enumerate(mods):
                tag = "fused" if form == "fused" else ("conv" if "conv" in m[:3000] and i == 0 else "step")
                name = f"{folder}/{jnp.dtype(sd).name}_b{batch}_{'fused' if form == 'fused' else ('conv' if i == 0 else 'step')}.ttir"
                open(name, "w").write(m)
            print(sd.__name__ if hasattr(sd, '__name__') else sd, batch, form, len(mods), flush=True)
