"""Pallas (Triton) decode kernels of the Mamba-2 SSM.

Letters: batch, H heads, P head_dim, N d_state, G n_groups (head h reads
group h // (H // G)), L buffer length. The state is S f32 | bf16[batch, H, P, N]
(mamba_ssm's ssm_state). One decode step (Dao & Gu 2024; mamba_ssm's
selective_state_update):

    dt = clamp(softplus(dt_raw + dt_bias), dt_limit)
    S_new = exp(dt A) S + (dt x) B^T;   y = S_new C + D x;   y *= silu(z)

Grid: (batch, H, cdiv(P, block_v)). A program owns rows [p0, p0 + block_v)
of one head's state and all N columns.

- :func:`mamba2_step`: the standard step; S read and written in place.
- :func:`mamba2_replay_step`: the ReplaySSM step: one read of the checkpoint
  tile, the buffered records (x, dt, B) replayed as
  y = exp(G) S_c C + sum_i w_i dt_i (B_i . C) x_i, the new record appended at
  the row's cursor, the checkpoint written only by the flushing step (masked
  per row; aliased in place). `route="state"` materializes S instead; one
  kernel body serves both routes.

These functions take validated arrays; the public entry points are
:mod:`replayssm_jax.ops`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels import _common as c
from replayssm_jax.kernels._common import Config, f32


def _process_dt(dt_raw, dt_bias, dt_softplus, dt_limit):
    dt = dt_raw + dt_bias
    if dt_softplus:
        dt = c.softplus(dt)
    low, high = dt_limit
    if low > 0.0 or high < math.inf:
        dt = jnp.clip(dt, low, high)
    return dt


def _load_step_inputs(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref, z_ref, P, N, dt_softplus, dt_limit):
    BP, BN = x_ref.shape[0], B_ref.shape[0]
    pmask = c.row_mask(BP, P)
    nmask = c.lane_mask(BN, N)
    x = c.load(x_ref, pmask)
    dt = _process_dt(c.load_scalar(dt_ref), c.load_scalar(bias_ref), dt_softplus, dt_limit)
    A = c.load_scalar(A_ref)
    Bv = c.load(B_ref, nmask)
    Cv = c.load(C_ref, nmask)
    skip = c.load_scalar(D_ref) * x
    gate = None
    if z_ref is not None:
        z = c.load(z_ref, pmask)
        gate = z * jax.nn.sigmoid(z)
    return pmask, nmask, x, dt, A, Bv, Cv, skip, gate


def _finish(y, skip, gate):
    y = y + skip
    return y if gate is None else y * gate


def _step_kernel(*refs, P, N, has_z, dt_softplus, dt_limit):
    s_ref, x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref = refs[:8]
    z_ref = refs[8] if has_z else None
    y_ref, s_out = refs[-2:]
    pmask, nmask, x, dt, A, Bv, Cv, skip, gate = _load_step_inputs(
        x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref, z_ref, P, N, dt_softplus, dt_limit)
    tile = c.outer(pmask, nmask, (x_ref.shape[0], B_ref.shape[0]))
    S = c.load(s_ref, tile) * jnp.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    c.store(y_ref, _finish(c.matvec(S, Cv), skip, gate), pmask)
    c.store(s_out, S, tile)


def _replay_kernel(*refs, P, N, L, group, has_z, dt_softplus, dt_limit, route):
    ck_ref, xbuf_ref, dtbuf_ref, Bbuf_ref, cur_ref, x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref = refs[:12]
    z_ref = refs[12] if has_z else None
    y_ref, ck_out, xbuf_out, dtbuf_out, Bbuf_out = refs[-5:]
    BL, BP, BN = dtbuf_ref.shape[0], x_ref.shape[0], B_ref.shape[0]
    pmask, nmask, x, dt, A, Bv, Cv, skip, gate = _load_step_inputs(
        x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref, z_ref, P, N, dt_softplus, dt_limit)
    x = x.astype(xbuf_ref.dtype).astype(f32)  # the record as buffered
    Bv = Bv.astype(Bbuf_ref.dtype).astype(f32)
    lmask = c.lane_mask(BL, L)
    tile = c.outer(pmask, nmask, (BP, BN))
    count, slot, flush, _ = c.slot_plan(c.load_scalar(cur_ref, jnp.int32), L)

    S_c = c.load(ck_ref, tile)  # the one read of the checkpoint
    dts = c.load(dtbuf_ref, lmask)
    total, w = c.replay_weights(dts * A, count)
    w = w * dts  # u_i = dt_i x_i: fold dt_i into the slot weight
    decay = jnp.exp(dt * A)
    u = dt * x

    def x_row(i):
        return c.load(xbuf_ref.at[i], pmask)

    def B_row(i):
        return c.load(Bbuf_ref.at[i], nmask)

    if route == "output":
        X = c.load(xbuf_ref, c.outer(lmask, pmask, (BL, BP)))
        Bb = c.load(Bbuf_ref, c.outer(lmask, nmask, (BL, BN)))
        y = decay * c.replay_readout(S_c, X, Bb, total, w, Cv) + jnp.sum(Bv * Cv) * u
        c.store(y_ref, _finish(y, skip, gate), pmask)

        @pl.when(flush)
        def _():
            S = decay * c.replay_materialize(S_c, x_row, B_row, total, w, count)
            c.store(ck_out, S + u[:, None] * Bv[None, :], tile)
    else:
        S = decay * c.replay_materialize(S_c, x_row, B_row, total, w, count) + u[:, None] * Bv[None, :]
        c.store(y_ref, _finish(c.matvec(S, Cv), skip, gate), pmask)
        c.store(ck_out, S, c.both(tile, flush, (BP, BN)))

    # Append (x, dt, B) at `slot` unless flushing. x rows are owned by this
    # program; dt is written by the first row block of the head, B by the
    # first head of the group: no element has two writers.
    at_slot = (c.lane_ids(BL) == slot) & jnp.logical_not(flush)
    c.store(xbuf_out, jnp.broadcast_to(x[None, :], (BL, BP)), c.outer(at_slot, pmask, (BL, BP)))
    first_block = pl.program_id(2) == 0
    c.store(dtbuf_out, jnp.broadcast_to(dt, (BL,)), at_slot & first_block)
    leader = first_block & (pl.program_id(1) % group == 0)
    c.store(Bbuf_out, jnp.broadcast_to(Bv[None, :], (BL, BN)), c.both(c.outer(at_slot, nmask, (BL, BN)), leader, (BL, BN)))


def _specs(H, G, cfg, N):
    BP, BN = cfg.block_v, c.next_pow2(N)
    group = H // G
    return dict(
        state=pl.BlockSpec((None, None, BP, BN), lambda b, h, j: (b, h, j, 0)),
        row=pl.BlockSpec((None, None, BP), lambda b, h, j: (b, h, j)),
        scal=pl.BlockSpec((None, None), lambda b, h, j: (b, h)),
        head=pl.BlockSpec((None,), lambda b, h, j: (h,)),
        grp=pl.BlockSpec((None, None, BN), lambda b, h, j: (b, h // group, 0)),
    )


def _inputs(x, dt, A, B, C, D, z, dt_bias):
    H = x.shape[1]
    D = jnp.zeros((H,), f32) if D is None else D
    dt_bias = jnp.zeros((H,), f32) if dt_bias is None else dt_bias
    args = [x, dt, A, B, C, D, dt_bias] + ([] if z is None else [z])
    return args


def _input_specs(s, has_z):
    return [s["row"], s["scal"], s["head"], s["grp"], s["grp"], s["head"], s["head"]] + ([s["row"]] if has_z else [])


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "config", "interpret"))
def mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool, dt_limit: tuple[float, float],
                config: Config | None = None, interpret: bool = False):
    """One standard Mamba-2 decode step; the state is updated in place.

    Args: state f32|bf16[batch, H, P, N]; x [batch, H, P]; dt [batch, H] raw;
    A f32[H] negative; B, C [batch, G, N]; D [H] or None; z [batch, H, P] or
    None; dt_bias [H] or None.

    Returns: (y [batch, H, P] in x.dtype, new_state like state).
    """
    batch, H, P, N = state.shape
    G = B.shape[1]
    cfg = config or c.default_config(batch, H, P, N, state.dtype.itemsize)
    s = _specs(H, G, cfg, N)
    kernel = functools.partial(_step_kernel, P=P, N=N, has_z=z is not None, dt_softplus=dt_softplus, dt_limit=dt_limit)
    y, new_state = c.pallas_call(
        kernel,
        grid=(batch, H, pl.cdiv(P, cfg.block_v)),
        in_specs=[s["state"]] + _input_specs(s, z is not None),
        out_specs=[s["row"], s["state"]],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={0: 1},
        interpret=interpret,
        config=cfg,
        name=f"mamba2_step_{cfg.tag()}",
    )(state, *_inputs(x, dt, A, B, C, D, z, dt_bias))
    return y, new_state


@functools.partial(jax.jit, static_argnames=("L", "dt_softplus", "dt_limit", "route", "config", "interpret"))
def mamba2_replay_step(checkpoint, xbuf, dtbuf, Bbuf, cursor, x, dt, A, B, C, D, z, dt_bias, *, L: int,
                       dt_softplus: bool, dt_limit: tuple[float, float], route: str,
                       config: Config | None = None, interpret: bool = False):
    """One ReplaySSM Mamba-2 decode step on the raw state arrays (in place).

    Args: checkpoint f32|bf16[batch, H, P, N]; xbuf [batch, H, L, P];
    dtbuf f32[batch, H, L] (processed dt); Bbuf [batch, G, L, N];
    cursor i32[batch] in 0..L; the step inputs as :func:`mamba2_step`.

    Returns: (y [batch, H, P] in x.dtype, checkpoint, xbuf, dtbuf, Bbuf,
    new cursor). A row flushes (checkpoint = S after this step, cursor 0)
    when its cursor reaches L with this step or entered at L.
    """
    batch, H, P, N = checkpoint.shape
    G = B.shape[1]
    cfg = config or c.default_config(batch, H, P, N, checkpoint.dtype.itemsize, replay_len=L)
    s = _specs(H, G, cfg, N)
    BL, BP, BN = c.next_pow2(L), cfg.block_v, c.next_pow2(N)
    group = H // G
    xspec = pl.BlockSpec((None, None, BL, BP), lambda b, h, j: (b, h, 0, j))
    dtspec = pl.BlockSpec((None, None, BL), lambda b, h, j: (b, h, 0))
    Bspec = pl.BlockSpec((None, None, BL, BN), lambda b, h, j: (b, h // group, 0, 0))
    cspec = pl.BlockSpec((None,), lambda b, h, j: (b,))
    kernel = functools.partial(_replay_kernel, P=P, N=N, L=L, group=group, has_z=z is not None,
                               dt_softplus=dt_softplus, dt_limit=dt_limit, route=route)
    outs = c.pallas_call(
        kernel,
        grid=(batch, H, pl.cdiv(P, BP)),
        in_specs=[s["state"], xspec, dtspec, Bspec, cspec] + _input_specs(s, z is not None),
        out_specs=[s["row"], s["state"], xspec, dtspec, Bspec],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)]
        + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (checkpoint, xbuf, dtbuf, Bbuf)],
        input_output_aliases={0: 1, 1: 2, 2: 3, 3: 4},
        interpret=interpret,
        config=cfg,
        name=f"mamba2_replay_{route}_L{L}_{cfg.tag()}",
    )(checkpoint, xbuf, dtbuf, Bbuf, cursor, *_inputs(x, dt, A, B, C, D, z, dt_bias))
    return (*outs, c.next_cursor(cursor, L))
