"""Dump the Triton IR of the GDN standard step (Qwen3.5-4B layer, batch 256) for f32/bf16 states, with the update
fused (fma) or plain, as Pallas lowers it (fake sm_90 on a CPU). argv[1]: output folder."""
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import pallas_call_registration as reg, lowering, gpu_info
sys.path.insert(0, "bench")
import kernels as kb
from replayssm_jax.kernels import gdn, tiles

mods = []
real_lower = lowering.lower_jaxpr_to_triton_module
def capture(*a, **k):
    r = real_lower(*a, **k)
    mods.append(r.module.operation.get_asm(enable_debug_info=False))
    return r
reg.lowering.lower_jaxpr_to_triton_module = capture
gpu_info.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
for sd in ("float32", "bfloat16"):
    b = kb.make_bench("gdn", 256, jnp.dtype(sd), np.random.default_rng(0))
    inp = b.random_inputs((b.b,))
    st = jax.ShapeDtypeStruct((256, 32, 128, 128), jnp.dtype(sd))
    for name, f in (("fma", tiles.fma), ("plain", lambda a, b_, c: a * b_ + c)):
        gdn.fma = f
        jax.clear_caches()
        mods.clear()
        jax.jit(lambda s, i: b.kernel_step(s, i)).trace(st, inp).lower(lowering_platforms=("cuda",))
        open(f"{out}/{sd}_{name}.ttir", "w").write(mods[0])
        print(sd, name, "inline_asm" in mods[0])
gdn.fma = tiles.fma
