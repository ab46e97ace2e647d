"""Pallas (Triton) decode kernels of the Gated DeltaNet layer.

Letters: batch, H key heads, HV value heads (value head h reads key head
h // (HV // H)), K key dim, V value dim, L buffer length. The state is
value-major, S f32 | bf16[batch, HV, V, K]. One decode step (DESIGN.md
section 2, fla's fused_recurrent_gated_delta_rule with T = 1):

    S' = exp(g) S;  d = beta (v - S' k);  S_new = S' + d k^T;  o = S_new (scale q)

with q, k L2-normalized over K (eps 1e-6) when use_qk_l2norm.

Grid: (batch, HV, cdiv(V, block_v)). A program owns rows [v0, v0 + block_v)
of one head's state and all K columns, so S k and S q are local row sums and
no two programs touch the same state element.

- :func:`gdn_step`: the standard step; reads S, writes S in place
  (state aliased input -> output).
- :func:`gdn_replay_step`: the ReplaySSM step. Reads the checkpoint tile once
  and forms both S_{j-1} k_j (for d_j) and S_j q_j from it and the buffered
  records; appends (d_j, k_j, g_j) at the row's cursor; writes the
  checkpoint only in the step that flushes (masked per row; the checkpoint
  is aliased, so rows that do not flush cost no copy). `route="state"`
  materializes S_{j-1} in registers instead and reads o from S_j; the two
  routes share one kernel body.

These functions take validated arrays; the public, validated entry points
are :mod:`replayssm_jax.ops`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels import _common as c
from replayssm_jax.kernels._common import Config, f32


def _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale):
    BK = q_ref.shape[-1]
    kmask = c.lane_mask(BK, K)
    q = c.load(q_ref, kmask)
    k = c.load(k_ref, kmask)
    if use_qk_l2norm:
        q = c.l2norm(q)
        k = c.l2norm(k)
    return kmask, q * scale, k


def _step_kernel(s_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s_out_ref, *, V, K, scale, use_qk_l2norm):
    BV, BK = s_ref.shape
    vmask = c.row_mask(BV, V)
    kmask, q, k = _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale)
    tile = c.outer(vmask, kmask, (BV, BK))
    S = c.load(s_ref, tile) * jnp.exp(c.load_scalar(g_ref))
    v = c.load(v_ref, vmask)
    d = c.load_scalar(beta_ref) * (v - c.matvec(S, k))
    S = S + d[:, None] * k[None, :]
    c.store(o_ref, c.matvec(S, q), vmask)
    c.store(s_out_ref, S, tile)


def _replay_kernel(
    ck_ref, dbuf_ref, kbuf_ref, gbuf_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    o_ref, ck_out, dbuf_out, kbuf_out, gbuf_out,
    *, V, K, L, group, scale, use_qk_l2norm, route,
):
    BV, BK = ck_ref.shape
    BL = gbuf_ref.shape[0]
    vmask = c.row_mask(BV, V)
    kmask, q, k = _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale)
    lmask = c.lane_mask(BL, L)
    tile = c.outer(vmask, kmask, (BV, BK))
    count, slot, flush, _ = c.slot_plan(c.load_scalar(cur_ref, jnp.int32), L)

    S_c = c.load(ck_ref, tile)  # the one read of the checkpoint
    total, w = c.replay_weights(c.load(gbuf_ref, lmask), count)
    g = c.load_scalar(g_ref)
    beta = c.load_scalar(beta_ref)
    v = c.load(v_ref, vmask)
    decay = jnp.exp(g)

    def u_row(i):
        return c.load(dbuf_ref.at[i], vmask)

    def k_row(i):
        return c.load(kbuf_ref.at[i], kmask)

    if route == "output":
        U = c.load(dbuf_ref, c.outer(lmask, vmask, (BL, BV)))
        Kb = c.load(kbuf_ref, c.outer(lmask, kmask, (BL, BK)))
        Sk = decay * c.replay_readout(S_c, U, Kb, total, w, k)  # exp(g) S_{j-1} k
        d = beta * (v - Sk)
        o = decay * c.replay_readout(S_c, U, Kb, total, w, q) + jnp.sum(k * q) * d
        c.store(o_ref, o, vmask)

        @pl.when(flush)
        def _():
            S = decay * c.replay_materialize(S_c, u_row, k_row, total, w, count)
            c.store(ck_out, S + d[:, None] * k[None, :], tile)
    else:
        S = decay * c.replay_materialize(S_c, u_row, k_row, total, w, count)
        d = beta * (v - c.matvec(S, k))
        S = S + d[:, None] * k[None, :]
        c.store(o_ref, c.matvec(S, q), vmask)
        c.store(ck_out, S, c.both(tile, flush, (BV, BK)))

    # Append the record at `slot` (skipped on flush: the slot is dead then).
    # The d tile is owned by this program; the shared k and g records are
    # written by one program each (first value head of the group, first
    # row block), so no two programs write the same element.
    append = jnp.logical_not(flush)
    at_slot = (c.lane_ids(BL) == slot) & append
    c.store(dbuf_out, jnp.broadcast_to(d[None, :], (BL, BV)), c.outer(at_slot, vmask, (BL, BV)))
    first_block = pl.program_id(2) == 0
    c.store(gbuf_out, jnp.broadcast_to(g, (BL,)), at_slot & first_block)
    leader = first_block & (pl.program_id(1) % group == 0)
    k_mask = c.both(c.outer(at_slot, kmask, (BL, BK)), leader, (BL, BK))
    c.store(kbuf_out, jnp.broadcast_to(k[None, :], (BL, BK)), k_mask)  # k normalized, not scaled


def _specs(batch, H, HV, V, K, cfg):
    BV, BK = cfg.block_v, c.next_pow2(K)
    group = HV // H
    state = pl.BlockSpec((None, None, BV, BK), lambda b, h, j: (b, h, j, 0))
    qk = pl.BlockSpec((None, None, BK), lambda b, h, j: (b, h // group, 0))
    vrow = pl.BlockSpec((None, None, BV), lambda b, h, j: (b, h, j))
    scal = pl.BlockSpec((None, None), lambda b, h, j: (b, h))
    grid = (batch, HV, pl.cdiv(V, BV))
    return grid, state, qk, vrow, scal


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config", "interpret"))
def gdn_step(state, q, k, v, g, beta, *, scale: float, use_qk_l2norm: bool, config: Config | None = None, interpret: bool = False):
    """One standard GDN decode step; the state is updated in place.

    Args: state f32|bf16[batch, HV, V, K]; q, k [batch, H, K]; v [batch, HV, V];
    g f32[batch, HV] (log decay <= 0); beta [batch, HV]; scale: float.

    Returns: (o [batch, HV, V] in v.dtype, new_state like state).
    """
    batch, HV, V, K = state.shape
    H = q.shape[1]
    cfg = config or c.default_config(batch, HV, V, K, state.dtype.itemsize)
    grid, sspec, qk, vrow, scal = _specs(batch, H, HV, V, K, cfg)
    kernel = functools.partial(_step_kernel, V=V, K=K, scale=scale, use_qk_l2norm=use_qk_l2norm)
    o, new_state = c.pallas_call(
        kernel,
        grid=grid,
        in_specs=[sspec, qk, qk, vrow, scal, scal],
        out_specs=[vrow, sspec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={0: 1},
        interpret=interpret,
        config=cfg,
        name=f"gdn_step_{cfg.tag()}",
    )(state, q, k, v, g.astype(f32), beta)
    return o, new_state


@functools.partial(jax.jit, static_argnames=("L", "scale", "use_qk_l2norm", "route", "config", "interpret"))
def gdn_replay_step(checkpoint, dbuf, kbuf, gbuf, cursor, q, k, v, g, beta, *, L: int, scale: float,
                    use_qk_l2norm: bool, route: str, config: Config | None = None, interpret: bool = False):
    """One ReplaySSM GDN decode step on the raw state arrays (in place).

    Args: checkpoint f32|bf16[batch, HV, V, K]; dbuf [batch, HV, L, V];
    kbuf [batch, H, L, K]; gbuf f32[batch, HV, L]; cursor i32[batch] in 0..L;
    q, k [batch, H, K]; v [batch, HV, V]; g f32[batch, HV]; beta [batch, HV].

    Returns: (o [batch, HV, V] in v.dtype, checkpoint, dbuf, kbuf, gbuf,
    new cursor). A row flushes (writes checkpoint = S after this step,
    cursor 0) when its cursor reaches L with this step or entered at L.
    """
    batch, HV, V, K = checkpoint.shape
    H = q.shape[1]
    cfg = config or c.default_config(batch, HV, V, K, checkpoint.dtype.itemsize, replay_len=L)
    grid, sspec, qk, vrow, scal = _specs(batch, H, HV, V, K, cfg)
    BV, BK, BL = cfg.block_v, c.next_pow2(K), c.next_pow2(L)
    group = HV // H
    dspec = pl.BlockSpec((None, None, BL, BV), lambda b, h, j: (b, h, 0, j))
    kspec = pl.BlockSpec((None, None, BL, BK), lambda b, h, j: (b, h // group, 0, 0))
    gspec = pl.BlockSpec((None, None, BL), lambda b, h, j: (b, h, 0))
    cspec = pl.BlockSpec((None,), lambda b, h, j: (b,))
    kernel = functools.partial(_replay_kernel, V=V, K=K, L=L, group=group, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, route=route)
    outs = c.pallas_call(
        kernel,
        grid=grid,
        in_specs=[sspec, dspec, kspec, gspec, cspec, qk, qk, vrow, scal, scal],
        out_specs=[vrow, sspec, dspec, kspec, gspec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)]
        + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (checkpoint, dbuf, kbuf, gbuf)],
        input_output_aliases={0: 1, 1: 2, 2: 3, 3: 4},
        interpret=interpret,
        config=cfg,
        name=f"gdn_replay_{route}_L{L}_{cfg.tag()}",
    )(checkpoint, dbuf, kbuf, gbuf, cursor, q, k, v, g.astype(f32), beta)
    return (*outs, c.next_cursor(cursor, L))
