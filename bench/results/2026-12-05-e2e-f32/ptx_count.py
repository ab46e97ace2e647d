"""Compile the GDN standard step (batch 256, f32) with XLA's dumps on and count the global loads and stores, by
width, in the PTX of each kernel there and of the Triton kernels in Triton's cache (vLLM's, after the harness)."""
import collections, glob, os, re, sys
import jax, jax.numpy as jnp
from replayssm_jax.kernels import gdn_step

B, H, HV, K, V = 256, 16, 32, 128, 128
k = jax.random.split(jax.random.key(0), 6)
S = jax.random.normal(k[0], (B, HV, V, K), jnp.float32)
q = jax.random.normal(k[1], (B, H, K), jnp.bfloat16); kk = jax.random.normal(k[2], (B, H, K), jnp.bfloat16)
v = jax.random.normal(k[3], (B, HV, V), jnp.bfloat16)
g = -jnp.abs(jax.random.normal(k[4], (B, HV), jnp.float32)); be = jax.nn.sigmoid(jax.random.normal(k[5], (B, HV))).astype(jnp.bfloat16)
jax.block_until_ready(jax.jit(lambda *a: gdn_step(*a, scale=K ** -0.5, use_qk_l2norm=True))(S, q, kk, v, g, be))

pat = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9]+)*?(\.v[248])?\.(?:[bfsu](?:8|16|32|64))\b")
def summarize(path):
    text = open(path, errors="replace").read()
    for m in re.finditer(r"\.entry\s+(\w+)", text):
        start = m.end(); end = text.find("\n}", start)
        body = text[start:end]
        c = collections.Counter(f"{a}{w or ''}" for a, w in pat.findall(body))
        c2 = collections.Counter(re.findall(r"\b(?:ld|st)\.global[.\w]*", body))
        print(f"{os.path.basename(path)[:60]:60s} {m.group(1)[:60]:60s} {dict(c)}")
        print("    ", dict(c2.most_common(8)))
for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.ptx"))):
    summarize(p)
for p in sorted(glob.glob(os.path.expanduser("~/.triton/cache/*/*.ptx"))):
    if "packed_decode" in p or "replayssm" in p:
        summarize(p)
