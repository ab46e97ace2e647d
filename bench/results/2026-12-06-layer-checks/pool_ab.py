"""A/B of the pooled launches' slot test (slot >= 0, against 0 <= slot < capacity): the GDN standard step and
replay step (output route) over a pool of 256 slots at batch 256 (slots permuted), Qwen3.5-4B's layer, f32
state; us a step (wall, 200 steps, median of 5 sets), the variants alternated; outputs compared first."""
import time, numpy as np, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from replayssm_jax import ops
from replayssm_jax.kernels import launch
from replayssm_jax.kernels.tiles import SlotView, hoisted_program_ids

new_slot_kernel = launch._slot_kernel


def old_slot_kernel(kernel, squeezed, capacity):
    def run(slots_ref, *args):
        with hoisted_program_ids(3):
            slot = slots_ref[0]
            index = jnp.maximum(slot, 0)
            views = [arg if flags is None else jax.tree.map(lambda ref, sq: SlotView(ref, index, sq), arg, flags)
                     for arg, flags in zip(args, squeezed)]

            @pl.when(slot >= 0)
            def _():
                kernel(*views)
    return run


r = np.random.default_rng(0)
B, H, HV, K, V, L = 256, 16, 32, 128, 128, 16
f = lambda *s, scale=1.0: jnp.asarray(r.standard_normal(s) * scale, jnp.float32)
pool = f(B, HV, V, K, scale=0.1)
q, k, v = f(B, H, K), f(B, H, K), f(B, HV, V)
g, beta = -jnp.asarray(r.uniform(0.05, 1, (B, HV)), jnp.float32), jnp.asarray(r.uniform(0.1, 0.9, (B, HV)), jnp.float32)
slots = jnp.asarray(r.permutation(B), jnp.int32)
replay = ops.gdn_replay_init(pool, L, H).replace(cursor=jnp.asarray(r.integers(0, L, B), jnp.int32))
steps = {
    "standard": lambda: jax.jit(lambda s: ops.gdn_step(s, q, k, v, g, beta, slots=slots, backend="pallas"), donate_argnums=0),
    "replay": lambda: jax.jit(lambda s: ops.gdn_replay_step(s, q, k, v, g, beta, slots=slots, backend="pallas"), donate_argnums=0),
}
states = {"standard": pool, "replay": replay}
for name in steps:
    fns, outs = {}, {}
    for variant, sk in (("old", old_slot_kernel), ("new", new_slot_kernel)):
        launch._slot_kernel = sk
        fns[variant] = steps[name]()
        st = jax.tree.map(jnp.copy, states[name])
        y, st = fns[variant](st); jax.block_until_ready(y)
        outs[variant] = (np.asarray(y), st)
    print(name, "outputs equal:", np.array_equal(outs["old"][0], outs["new"][0]))
    times = {"old": [], "new": []}
    for _ in range(5):
        for variant in ("old", "new"):
            st = outs[variant][1]
            t = time.perf_counter()
            for _ in range(200):
                y, st = fns[variant](st)
            jax.block_until_ready((y, st))
            times[variant].append((time.perf_counter() - t) / 200 * 1e6)
            outs[variant] = (outs[variant][0], st)
    med = {v: float(np.median(t)) for v, t in times.items()}
    print(f"{name}: old {med['old']:.2f} us, new {med['new']:.2f} us, new/old {med['new'] / med['old']:.4f}")
