"""GDN direct step, chunked: d and o from the checkpoint tile by the readout's sums, then the new tile
formed and stored C columns at a time (rank-L dot on [BV, C] accumulators). Probe: patches kg._step_kernel."""
import functools
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from replayssm_jax.kernels import gdn as kg, replay_math as rm
from replayssm_jax.kernels.cursor import advance_cursor, read_cursor
from replayssm_jax.kernels.tiles import (load, load_scalar, load_live, matvec, row_mask, store, tile_mask, lane_mask,
                                         lane_ids)
f32 = jnp.float32
ORIG = kg._step_kernel
CHUNK = [64]


def gdn_chunked(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
                use_qk_l2norm, dot_fold, programs):
    if records is None or not dot_fold:
        return ORIG(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, V=V, K=K, L=L,
                    scale=scale, use_qk_l2norm=use_qk_l2norm, dot_fold=dot_fold, programs=programs)
    C = CHUNK[0]
    count = read_cursor(cursor_ref)
    BV, BK = state_ref.shape
    BL = records.g.shape[0]
    n = BK // C
    vmask = row_mask(BV, V)
    cols = [pl.ds(j * C, C) for j in range(n)]
    cmask = [lane_mask(C, K - j * C) for j in range(n)]
    tm = [tile_mask(vmask, cmask[j], (BV, C)) for j in range(n)]
    live = lane_ids(BL) < count
    qs = [load(inputs.q.at[cols[j]], cmask[j]) for j in range(n)]
    ks = [load(inputs.k.at[cols[j]], cmask[j]) for j in range(n)]
    if use_qk_l2norm:
        rq = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in qs) + 1e-6)
        rk = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in ks) + 1e-6)
        qs = [x * rq for x in qs]
        ks = [x * rk for x in ks]
    qs = [x * scale for x in qs]
    S = [load(state_ref.at[:, cols[j]], tm[j]) for j in range(n)]
    total, w = rm.replay_weights(load_live(records.g, live, L), count)
    U = load_live(records.d, live, L, vmask)
    Kb = [load_live(records.k.at[:, cols[j]], live, L, cmask[j], records.k.dtype) for j in range(n)]
    decay, v, beta = jnp.exp(load_scalar(inputs.g)), load(inputs.v, vmask), load_scalar(inputs.beta)
    carried = jnp.exp(total)
    Kf = [x.astype(f32) for x in Kb]
    a_k = w * sum(jnp.sum(Kf[j] * ks[j][None, :], axis=1) for j in range(n))
    a_q = w * sum(jnp.sum(Kf[j] * qs[j][None, :], axis=1) for j in range(n))
    kq = sum(jnp.sum(ks[j] * qs[j]) for j in range(n))
    Sk = sum(matvec(S[j], ks[j]) for j in range(n))
    Sq = sum(matvec(S[j], qs[j]) for j in range(n))
    d = beta * (v - decay * (carried * Sk + jnp.sum(a_k[:, None] * U, axis=0)))
    o = decay * (carried * Sq + jnp.sum(a_q[:, None] * U, axis=0)) + kq * d
    store(o_ref, o, vmask)
    parts = rm.split_bf16((decay * w)[:, None] * U, rm.split_parts(state_ref.dtype))
    dims = (((0,), (0,)), ((), ()))
    for j in range(n):
        acc = None
        for part in reversed(parts):
            t = jax.lax.dot_general(part, Kb[j], dims, preferred_element_type=f32)
            acc = t if acc is None else acc + t
        new = (decay * carried) * S[j] + acc + d[:, None] * ks[j][None, :]
        store(state_out_ref.at[:, cols[j]], new, tm[j])
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


def install(chunk=64):
    CHUNK[0] = chunk
    kg._step_kernel = gdn_chunked
    jax.clear_caches()


def uninstall():
    kg._step_kernel = ORIG
    jax.clear_caches()


from replayssm_jax.kernels import mamba2 as km
MORIG = km._step_kernel


def mamba2_chunked(state_ref, inputs, records, cursor_ref, y_ref, state_out_ref, cursor_out_ref, *, P, N, L,
                   dt_softplus, dt_limit, dot_fold, programs):
    if records is None or not dot_fold:
        return MORIG(state_ref, inputs, records, cursor_ref, y_ref, state_out_ref, cursor_out_ref, P=P, N=N, L=L,
                     dt_softplus=dt_softplus, dt_limit=dt_limit, dot_fold=dot_fold, programs=programs)
    C = CHUNK[0]
    count = read_cursor(cursor_ref)
    BP, BN = state_ref.shape
    BL = records.dt.shape[0]
    n = BN // C
    pmask = row_mask(BP, P)
    cols = [pl.ds(j * C, C) for j in range(n)]
    cmask = [lane_mask(C, N - j * C) for j in range(n)]
    tm = [tile_mask(pmask, cmask[j], (BP, C)) for j in range(n)]
    live = lane_ids(BL) < count
    x = load(inputs.x, pmask)
    dt = km._process_dt(load_scalar(inputs.dt), load_scalar(inputs.dt_bias), dt_softplus, dt_limit)
    A = load_scalar(inputs.A)
    Bs = [load(inputs.B.at[cols[j]], cmask[j]) for j in range(n)]
    Cs = [load(inputs.C.at[cols[j]], cmask[j]) for j in range(n)]
    skip = load_scalar(inputs.D) * x
    gate = None
    if inputs.z is not None:
        z = load(inputs.z, pmask)
        gate = z * jax.nn.sigmoid(z)
    S = [load(state_ref.at[:, cols[j]], tm[j]) for j in range(n)]
    dts = load_live(records.dt, live, L)
    total, w = rm.replay_weights(dts * A, count)
    w = w * dts
    U = load_live(records.x, live, L, pmask)
    Kb = [load_live(records.B.at[:, cols[j]], live, L, cmask[j], records.B.dtype) for j in range(n)]
    decay, carried = jnp.exp(dt * A), jnp.exp(total)
    a_c = w * sum(jnp.sum(Kb[j].astype(f32) * Cs[j][None, :], axis=1) for j in range(n))
    bc = sum(jnp.sum(Bs[j] * Cs[j]) for j in range(n))
    Sc = sum(matvec(S[j], Cs[j]) for j in range(n))
    u = dt * x
    y = decay * (carried * Sc + jnp.sum(a_c[:, None] * U, axis=0)) + bc * u
    store(y_ref, km._skip_and_gate(y, skip, gate), pmask)
    parts = rm.split_bf16((decay * w)[:, None] * U, rm.split_parts(state_ref.dtype))
    dims = (((0,), (0,)), ((), ()))
    for j in range(n):
        acc = None
        for part in reversed(parts):
            t = jax.lax.dot_general(part, Kb[j], dims, preferred_element_type=f32)
            acc = t if acc is None else acc + t
        new = (decay * carried) * S[j] + acc + u[:, None] * Bs[j][None, :]
        store(state_out_ref.at[:, cols[j]], new, tm[j])
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


def install_both(chunk=64):
    CHUNK[0] = chunk
    kg._step_kernel = gdn_chunked
    km._step_kernel = mamba2_chunked
    jax.clear_caches()


def uninstall_both():
    kg._step_kernel = ORIG
    km._step_kernel = MORIG
    jax.clear_caches()
