import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "bench/results/2026-12-02-mosaic-gpu-probe")
from gdn_mgpu import gdn_append, gdn_append_pipelined
B, H, HV, K, V, L = 4, 4, 8, 128, 128, 16
bf = jnp.bfloat16
sds = jax.ShapeDtypeStruct
sd = jnp.dtype(sys.argv[1] if len(sys.argv) > 1 else "float32")
args = (sds((B, HV, V, K), sd), sds((B, HV, L, V), bf), sds((B, H, L, K), bf), sds((B, HV, L), jnp.float32),
        sds((B,), jnp.int32), sds((B, H, K), bf), sds((B, H, K), bf), sds((B, HV, V), bf), sds((B, HV), jnp.float32),
        sds((B, HV), bf))
f = jax.jit(lambda *a: (gdn_append_pipelined if "pipe" in sys.argv else gdn_append)(*a, scale=K ** -0.5, **({"blocks": 7} if "pipe" in sys.argv else {})))
lo = f.trace(*args).lower(lowering_platforms=("cuda",))
print("lowered ok", len(lo.as_text()))
