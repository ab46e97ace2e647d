"""GDN standard step (Qwen3.5-4B layer, batch 256, f32 state): run it a few times (for ncu); with argv[1], also
write its Pallas Triton IR there and try to compile that IR with upstream Triton (PyTorch's), counting the vector
loads and stores in the PTX."""
import re, sys
import jax, jax.numpy as jnp, numpy as np
from jax._src.pallas.triton import pallas_call_registration as reg, lowering
sys.path.insert(0, "bench")
import kernels as kb

mods = []
real_lower = lowering.lower_jaxpr_to_triton_module
def capture(*a, **k):
    r = real_lower(*a, **k)
    mods.append(r.module.operation.get_asm(enable_debug_info=False))
    return r
reg.lowering.lower_jaxpr_to_triton_module = capture
b = kb.make_bench("gdn", 256, jnp.float32, np.random.default_rng(0))
inp = b.random_inputs((b.b,))
rs = b.replay_state(16, jnp.float32, jnp.bfloat16, np.full((b.b,), 5, np.int32))
standard = jax.jit(lambda s, i: b.kernel_step(s, i))
st = rs.checkpoint
for _ in range(4):
    o, st = standard(st, inp)
    jax.block_until_ready(o)
print("ran", len(mods), "modules", flush=True)
if len(sys.argv) > 1:
    path = sys.argv[1]
    open(path, "w").write(mods[0])
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        c = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=1))
        ptx = c.asm["ptx"]
        open(path + ".ptx", "w").write(ptx)
        print("upstream triton:", {op: len(re.findall(re.escape(op) + r"\b", ptx)) for op in
              ("ld.global.v4.b32", "st.global.v4.b32", "ld.global.v2.b32", "ld.global.b32", "st.global.b32")})
    except Exception as e:
        print("upstream compile failed:", type(e).__name__, str(e)[:2000])
