"""The direct step (lockstep flush) at b256 f32: rank-L update accumulated onto S, and step inputs loaded after the fold."""
import os, sys, json
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
import kernels as kb
from replayssm_jax.kernels import gdn as kg, mamba2 as km, replay_math as rm
from replayssm_jax.kernels.cursor import advance_cursor, read_cursor
from replayssm_jax.kernels.tiles import (load, load_scalar, load_checkpoint, matvec, row_ids, row_mask, stochastic,
                                         store, store_checkpoint, tile_mask, lane_mask)

BK = sys.argv[1] if len(sys.argv) > 1 else "pallas"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 256
f32 = jnp.float32
RANK, GSTEP, MSTEP = rm.rank_update, kg._step_kernel, km._step_kernel


def rank_onto_S(S, Uw, Kb, state_dtype):
    dims = (((0,), (0,)), ((), ()))
    if rm.fits_dot(*Uw.shape, Kb.shape[1]):
        if Kb.dtype == jnp.bfloat16:
            acc = S
            for part in rm.split_bf16(Uw, rm.split_parts(state_dtype)):
                acc = acc + jax.lax.dot_general(part, Kb, dims, preferred_element_type=f32)
            return acc
        return S + jax.lax.dot_general(Uw, Kb.astype(f32), dims, precision=rm.dot_precision(state_dtype),
                                       preferred_element_type=f32)
    return RANK(S, Uw, Kb, state_dtype)


def gdn_late(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
             use_qk_l2norm, dot_fold, programs):
    if records is None:
        return GSTEP(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, V=V, K=K, L=L,
                     scale=scale, use_qk_l2norm=use_qk_l2norm, dot_fold=dot_fold, programs=programs)
    count = read_cursor(cursor_ref)
    BV, BKK = state_ref.shape
    vmask = row_mask(BV, V)
    kmask = lane_mask(BKK, K)
    tmask = tile_mask(vmask, kmask, (BV, BKK))
    S = load_checkpoint(state_ref, None, tmask, vmask)

    def finish(S):
        _, q, k = kg._load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
        decay, v, beta = jnp.exp(load_scalar(inputs.g)), load(inputs.v, vmask), load_scalar(inputs.beta)
        S = S * decay
        d = beta * (v - matvec(S, k))
        S = S + d[:, None] * k[None, :]
        store(o_ref, matvec(S, q), vmask)
        store_checkpoint(state_ref, state_out_ref, None, S, tmask, vmask, None, K)

    record, whole = kg._record_loaders(records, pl.ds(0, BV), vmask, kmask, L)
    rm.fold_live_records(S, count, record, finish, whole if dot_fold else None, L, state_ref.dtype)
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


def mamba2_late(state_ref, inputs, records, cursor_ref, y_ref, state_out_ref, cursor_out_ref, *, P, N, L, dt_softplus,
                dt_limit, dot_fold, programs):
    if records is None:
        return MSTEP(state_ref, inputs, records, cursor_ref, y_ref, state_out_ref, cursor_out_ref, P=P, N=N, L=L,
                     dt_softplus=dt_softplus, dt_limit=dt_limit, dot_fold=dot_fold, programs=programs)
    count = read_cursor(cursor_ref)
    BP, BN = inputs.x.shape[0], inputs.B.shape[0]
    pmask, nmask = row_mask(BP, P), lane_mask(BN, N)
    A = load_scalar(inputs.A)
    tmask = tile_mask(pmask, nmask, (BP, BN))
    S = load_checkpoint(state_ref, None, tmask, pmask)

    def finish(S):
        _, _, x, dt, _, Bv, Cv, skip, gate = km._load_step_inputs(inputs, P, N, dt_softplus, dt_limit)
        S = S * jnp.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        store(y_ref, km._skip_and_gate(matvec(S, Cv), skip, gate), pmask)
        store_checkpoint(state_ref, state_out_ref, None, S, tmask, pmask, None, N)

    record, whole = km._record_loaders(records, pl.ds(0, BP), pmask, nmask, L, A)
    rm.fold_live_records(S, count, record, finish, whole if dot_fold else None, L, state_ref.dtype)
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


VARIANTS = {"base": (RANK, GSTEP, MSTEP), "acc": (rank_onto_S, GSTEP, MSTEP), "late": (RANK, gdn_late, mamba2_late),
            "acc+late": (rank_onto_S, gdn_late, mamba2_late), "base-again": (RANK, GSTEP, MSTEP)}
opts = kb.TimingOptions(repeats=3, profile=True) if BK == "pallas" else kb.TimingOptions.dry_run()
rows = []
for layer in ("gdn", "mamba2"):
    for name, (rank, gstep, mstep) in VARIANTS.items():
        rm.rank_update, kg._step_kernel, km._step_kernel = rank, gstep, mstep
        jax.clear_caches()
        bench = kb.make_bench(layer, B, "float32", np.random.default_rng(0))
        r = kb.run_variant(bench, 16, "lockstep", opts)
        ks = {k: round(v["us"] / max(v["launches_per_step"], 1e-9), 2) for k, v in (r["kernels_us"] or {}).items()}
        rows.append(dict(layer=layer, variant=name, us=r["seconds"] * 1e6, per_launch_us=ks))
        print(f"{layer:7s} {name:12s} {r['seconds']*1e6:8.2f} us/step {ks}", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/direct_probe.json", "w"), indent=1)
