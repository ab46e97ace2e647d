import sys, jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import pallas_call_registration as reg, lowering, gpu_info
from replayssm_jax import kernels
mods, real = [], lowering.lower_jaxpr_to_triton_module
def capture(*a, **k):
    r = real(*a, **k); mods.append(r.module.operation.get_asm(enable_debug_info=False)); return r
reg.lowering.lower_jaxpr_to_triton_module = capture
gpu_info.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
rng = np.random.default_rng(0)
for sd in (jnp.float32, jnp.bfloat16):
  for batch in (1, 256):
    s = jnp.zeros((batch, 32, 128, 128), sd); q = jnp.zeros((batch, 16, 128), jnp.bfloat16); v = jnp.zeros((batch, 32, 128), jnp.bfloat16)
    a = jnp.zeros((batch, 32), jnp.bfloat16); p = jnp.zeros((32,), jnp.float32)
    mods.clear()
    jax.jit(lambda s, q, k, v, a, b: kernels.gdn_step(s, q, k, v, a=a, b=b, A_log=p, dt_bias=p, scale=0.1, use_qk_l2norm=True)).trace(s, q, q, v, a, a).lower(lowering_platforms=("cuda",))
    # the direct route too
    open(f"{sys.argv[1]}/step_{jnp.dtype(sd).name}_{batch}.ttir", "w").write(mods[0])
    cols = jnp.zeros((batch, 4, 8192), jnp.bfloat16); st = jnp.zeros((batch,), jnp.int32); w = jnp.zeros((8192, 4), jnp.float32)
    x = jnp.zeros((batch, 8192), jnp.bfloat16)
    mods.clear()
    jax.jit(lambda x, c, st: kernels.conv_update(x, c, st, w, splits=(2048, 4096))).trace(x, cols, st).lower(lowering_platforms=("cuda",))
    open(f"{sys.argv[1]}/conv_{jnp.dtype(sd).name}_{batch}.ttir", "w").write(mods[0])
