"""Probe: the direct route's fold of a full buffer (lockstep's flush step), loop vs unrolled, batch 256 f32."""
import os, sys, json
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
from replayssm_jax.kernels import gdn as kg, mamba2 as km

OUT = os.environ.get("OUT", "/tmp/out")


def fold_unrolled(S, count, record, finish, n=16):
    for i in range(n):
        lg, u, k = record(jnp.int32(i))
        S = jnp.where(i < count, jnp.exp(lg) * S + u[:, None] * k[None, :], S)
    finish(S)


LOOP = kg.fold_live_records
STEP = kg._step_kernel

from jax.experimental import pallas as pl
from replayssm_jax.kernels.cursor import advance_cursor, read_cursor
from replayssm_jax.kernels.tiles import (load, load_scalar, matvec, row_mask, store, store_checkpoint, tile_mask)


def step_kernel_dot(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, scale,
                    use_qk_l2norm, programs):
    """GDN direct route with the fold as one rank-L dot (the flush's `_materialize`)."""
    if records is None:
        return STEP(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, V=V, K=K,
                    scale=scale, use_qk_l2norm=use_qk_l2norm, programs=programs)
    count = read_cursor(cursor_ref)
    BV, BK = state_ref.shape
    vmask = row_mask(BV, V)
    kmask, q, k = kg._load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    tmask = tile_mask(vmask, kmask, (BV, BK))
    S = kg._materialize(state_ref, records, count, pl.ds(0, BV), vmask, kmask, tmask, records.g.shape[0])
    decay, v, beta = jnp.exp(load_scalar(inputs.g)), load(inputs.v, vmask), load_scalar(inputs.beta)
    S = S * decay
    d = beta * (v - matvec(S, k))
    S = S + d[:, None] * k[None, :]
    store(o_ref, matvec(S, q), vmask)
    store_checkpoint(state_ref, state_out_ref, None, S, tmask, vmask, None, K)
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


def main():
  rows = []
  opts = kb.TimingOptions(repeats=3, profile=True)
  for layer in ("gdn", "mamba2"):
      bench = kb.make_bench(layer, 256, "float32", np.random.default_rng(0))
      for name in (("loop", "dot") if layer == "gdn" else ("loop",)):
          kg._step_kernel = step_kernel_dot if name == "dot" else STEP
          jax.clear_caches()
          r = kb.run_variant(bench, 16, "lockstep", opts)
          ks = {k: round(v["us"] / max(v["launches_per_step"], 1e-9), 1) for k, v in (r["kernels_us"] or {}).items()}
          rows.append(dict(layer=layer, fold=name, us=r["seconds"] * 1e6, per_launch_us=ks))
          print(layer, name, f"{r['seconds']*1e6:.1f} us/step", ks, flush=True)
  os.makedirs(OUT, exist_ok=True)
  json.dump(rows, open(f"{OUT}/fold_probe.json", "w"), indent=1)


if __name__ == '__main__':
    main()
