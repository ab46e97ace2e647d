"""Pallas (Triton) decode kernels of the Mamba-2 SSM.

Letters: batch, H heads, P head_dim, N d_state, G n_groups (head h reads
group h // (H // G)), L buffer length. The state is S f32 | bf16[batch, H, P, N]
(mamba_ssm's ssm_state). One decode step (Dao & Gu 2024; mamba_ssm's
selective_state_update):

    dt = clamp(softplus(dt_raw + dt_bias), dt_limit)
    S_new = exp(dt A) S + (dt x) B^T;   y = S_new C + D x;   y *= silu(z)

Tiles: a program works on [block_v, N] tiles of one head's state (rows of
P, all N columns).

- :func:`mamba2_step`: the standard step, grid (batch, H, cdiv(P, block_v)),
  one tile per program; S read and written in place. Given a replay
  state's buffers and cursor, it is the replay step's direct route: each
  row's live records are folded into its checkpoint tile first, and the
  cursor is set to 0 in place.
- :func:`mamba2_replay_step`: the ReplaySSM step. The replay kernel, grid
  (batch, H, splits): a program forms the per-head terms once (decay
  weights of the live slots, the buffered B's scores against C) and loops
  over its row tiles, reading each checkpoint tile once:
  y = exp(dt A) (exp(G) S_c C + sum_i w_i dt_i (B_i . C) x_i) + (B . C) dt x;
  the new record (x, dt, B) goes to the row's cursor. The flush applies
  the buffered records, then this step, to the checkpoint tiles of each
  row whose buffer is now full and writes them in place: with
  `config.fused_flush` the replay kernel does it after its readout, on
  sub-tiles of its rows (one launch, the cursor moved in place by the
  row's last program, `advance_cursor`); otherwise a second launch, grid
  (batch / rows, H, tiles), one tile and a block of batch rows per
  program, and the first program of the row writes its next cursor to a
  fresh array (the flush launch reads the old one).
  `route="state"` makes the replay kernel form S in every step.

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


def _step_kernel(*refs, P, N, has_z, dt_softplus, dt_limit, L=0, programs=0):
    """The standard step; with L > 0 the direct route of the replay step: the
    step's inputs are then followed by the row's buffers (x, dt, B) and
    cursor, which are first folded into the checkpoint tile, and the outputs
    end with the cursor (in place, 0)."""
    s_ref, x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref = refs[:8]
    z_ref = refs[8] if has_z else None
    y_ref, s_out = refs[-3:-1] if L else refs[-2:]
    if L:
        xbuf_ref, dtbuf_ref, Bbuf_ref, cur_ref = refs[8 + has_z:12 + has_z]
        count = c.read_cursor(cur_ref)  # first: the fold's trip count waits on it
    pmask, nmask, x, dt, A, Bv, Cv, skip, gate = _load_step_inputs(
        x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref, z_ref, P, N, dt_softplus, dt_limit)
    tile = c.outer(pmask, nmask, (x_ref.shape[0], B_ref.shape[0]))
    S = c.load(s_ref, tile)

    def finish(S):
        S = S * jnp.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        c.store(y_ref, _finish(c.matvec(S, Cv), skip, gate), pmask)
        c.store(s_out, S, tile)

    if not L:
        return finish(S)

    def record(i):
        dt_i = dtbuf_ref[i]
        return dt_i * A, dt_i * c.load(xbuf_ref.at[i], pmask), c.load(Bbuf_ref.at[i], nmask)

    c.fold_then(S, count, record, finish)
    c.advance_cursor(refs[-1], count, jnp.int32(0), programs)


def _record_inputs(x_ref, dt_ref, A_ref, B_ref, bias_ref, xbuf_ref, Bbuf_ref, N, dt_softplus, dt_limit):
    """This step's dt, A, the nmask and B as buffered (rounded to the buffer dtype)."""
    nmask = c.lane_mask(B_ref.shape[0], N)
    dt = _process_dt(c.load_scalar(dt_ref), c.load_scalar(bias_ref), dt_softplus, dt_limit)
    Bv = c.load(B_ref, nmask).astype(Bbuf_ref.dtype).astype(f32)
    return nmask, dt, c.load_scalar(A_ref), Bv


def _load_x_record(x_ref, xbuf_ref, rows, pmask):
    """(x f32[BP], x as buffered) for the rows of a tile."""
    x = c.load(x_ref.at[rows], pmask)
    return x, x.astype(xbuf_ref.dtype).astype(f32)


def _buffer_weights(dtbuf_ref, live, L, count, A):
    """(carried decay, w f32[BL]) of the live slots, dt_i folded into w (u_i = dt_i x_i)."""
    dts = c.load_live(dtbuf_ref, live, L)
    total, w = c.replay_weights(dts * A, count)
    return jnp.exp(total), w * dts


def _replay_kernel(*refs, P, N, L, group, has_z, dt_softplus, dt_limit, route, config, programs):
    ck_ref, xbuf_ref, dtbuf_ref, Bbuf_ref, cur_ref, x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, bias_ref = refs[:12]
    z_ref = refs[12] if has_z else None
    y_ref, ck_out, xbuf_out, dtbuf_out, Bbuf_out, cur_out = refs[-6:]
    BL, BN, BP = dtbuf_ref.shape[0], B_ref.shape[0], config.block_v
    nmask, dt, A, Bv = _record_inputs(x_ref, dt_ref, A_ref, B_ref, bias_ref, xbuf_ref, Bbuf_ref, N, dt_softplus,
                                      dt_limit)
    Cv = c.load(C_ref, nmask)
    D = c.load_scalar(D_ref)
    count = c.read_cursor(cur_ref)  # live records; the new one goes to slot `count`
    split = pl.program_id(2)
    live = c.lane_ids(BL) < count  # dead slots are zeroed (a rejected draft may have left inf there)

    # Per-head work, once per program: decay weights of the live slots and
    # the buffered B's scores against C.
    carried, w = _buffer_weights(dtbuf_ref, live, L, count, A)
    Bb = c.load_live(Bbuf_ref, live, L, nmask, Bbuf_ref.dtype)  # as buffered (the rank update's keys)
    a_c = w * jnp.sum(Bb * Cv[None, :], axis=1)
    bc = jnp.sum(Bv * Cv)
    decay = jnp.exp(dt * A)
    append = count < L  # a row that entered full has no free slot (the flush absorbs this step)

    def tile(rows, pmask):
        tmask = c.outer(pmask, nmask, (BP, BN))
        S_c = c.load(ck_ref.at[rows, :], tmask)  # the one read of the checkpoint
        X = c.load_live(xbuf_ref.at[:, rows], live, L, pmask)
        x, x_rec = _load_x_record(x_ref, xbuf_ref, rows, pmask)
        u = dt * x_rec
        if route == "output":
            y = decay * (carried * c.matvec(S_c, Cv) + jnp.sum(a_c[:, None] * X, axis=0)) + bc * u
        else:
            S = decay * c.rank_update(carried * S_c, w[:, None] * X, Bb, ck_ref.dtype) + u[:, None] * Bv[None, :]
            y = c.matvec(S, Cv)
        y = y + D * x
        if has_z:
            z = c.load(z_ref.at[rows], pmask)
            y = y * (z * jax.nn.sigmoid(z))
        c.store(y_ref.at[rows], y, pmask)
        c.store(xbuf_out.at[count, rows], x_rec, c.both(pmask, append, (BP,)))  # the x rows are this program's

    c.replay_tiles(P, config, split, tile)
    if config.fused_flush:

        @pl.when(count >= L - 1)
        def _():
            _flush_row(*refs[:12], ck_out, cursor=count, split=split, P=P, N=N, L=L, dt_softplus=dt_softplus,
                       dt_limit=dt_limit, config=c.fused_flush_config(config))

    # The shared records: dt by the first program of the head, B by the
    # first head of the group, so no element has two writers.
    first = split == 0
    c.store(dtbuf_out, jnp.broadcast_to(dt, (BL,)), (c.lane_ids(BL) == count) & append & first)
    leader = first & (pl.program_id(1) % group == 0)
    c.store(Bbuf_out.at[count], Bv, c.both(nmask, append & leader, (BN,)))
    if config.fused_flush:  # one launch: the cursor moves in place
        c.advance_cursor(cur_out, count, c.next_cursor(count, L), programs)
    else:  # the flush launch reads the old cursors: a fresh array
        c.store_cursor(cur_out, count, L, first & (pl.program_id(1) == 0))


def _flush_kernel(*refs, P, N, L, dt_softplus, dt_limit, config):
    """The flush launch: a program holds one row tile of one head for a block of batch rows."""
    split = pl.program_id(2)  # read here: interpret mode cannot read it inside a branch
    c.flush_rows_of_program(refs, L, functools.partial(
        _flush_row, split=split, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit, config=config),
        shared=(7, 10, 11))  # A, D, dt_bias: per head


def _flush_row(*refs, cursor, split, P, N, L, dt_softplus, dt_limit, config):
    """Write S after this step into the checkpoint of one flushing row (refs:
    the row's blocks, the checkpoint's output last; cursor at entry L - 1 or
    L): its `cursor` buffered records, then this step, S <- exp(dt A) S +
    dt x B^T with x and B as buffered. Slot `cursor` is never read: the
    fused flush runs in the launch that writes it."""
    ck_ref, xbuf_ref, dtbuf_ref, Bbuf_ref, _, x_ref, dt_ref, A_ref, B_ref, _, _, bias_ref = refs[:12]
    ck_out = refs[-1]
    BN, BP = B_ref.shape[0], config.block_v
    nmask, dt, A, Bv = _record_inputs(x_ref, dt_ref, A_ref, B_ref, bias_ref, xbuf_ref, Bbuf_ref, N,
                                      dt_softplus, dt_limit)
    decay = jnp.exp(dt * A)

    def tile(rows, pmask):
        tmask = c.outer(pmask, nmask, (BP, BN))

        def record(i):
            dt_i = dtbuf_ref[i]
            return dt_i * A, dt_i * c.load(xbuf_ref.at[i, rows], pmask), c.load(Bbuf_ref.at[i], nmask)

        def records(live):
            dts = c.load_live(dtbuf_ref, live, L)
            return (dts * A, dts[:, None] * c.load_live(xbuf_ref.at[:, rows], live, L, pmask),
                    c.load_live(Bbuf_ref, live, L, nmask, Bbuf_ref.dtype))

        S = decay * c.replay_records(c.load(ck_ref.at[rows, :], tmask), cursor, L, record, records, ck_ref.dtype)
        u = dt * _load_x_record(x_ref, xbuf_ref, rows, pmask)[1]
        c.store(ck_out.at[rows, :], S + u[:, None] * Bv[None, :], tmask)

    c.replay_tiles(P, config, split, tile)


def _specs(H, G, BP, N, nb=None):
    """Block specs of programs of BP state rows and nb batch rows (None: one, the batch axis squeezed)."""
    BN = c.next_pow2(N)
    group = H // G
    return dict(
        state=pl.BlockSpec((nb, None, BP, BN), lambda b, h, j: (b, h, j, 0)),
        row=pl.BlockSpec((nb, None, BP), lambda b, h, j: (b, h, j)),
        scal=pl.BlockSpec((nb, None), lambda b, h, j: (b, h)),
        head=pl.BlockSpec((None,), lambda b, h, j: (h,)),
        grp=pl.BlockSpec((nb, None, BN), lambda b, h, j: (b, h // group, 0)),
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
def mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, replay=None, *, dt_softplus: bool,
                dt_limit: tuple[float, float], config: Config | None = None, interpret: bool = False):
    """One standard Mamba-2 decode step; the state is updated in place.

    Args: state f32|bf16[batch, H, P, N]; x [batch, H, P]; dt [batch, H] raw;
    A f32[H] negative; B, C [batch, G, N]; D [H] or None; z [batch, H, P] or
    None; dt_bias [H] or None; replay: None, or the replay step's direct
    route: the buffers (x [batch, H, L, P], dt f32[batch, H, L], B
    [batch, G, L, N]) and cursor i32[batch] of a replay state whose
    checkpoint is `state`. Each row's live records are then folded into
    the checkpoint before the step, and the cursor is set to 0 in place.

    Returns: (y [batch, H, P] in x.dtype, new_state like state, new cursor
    or None).
    """
    batch, H, P, N = state.shape
    G = B.shape[1]
    cfg = config or c.default_config(batch, H, P, N, state.dtype.itemsize)
    s = _specs(H, G, cfg.block_v, N)
    grid = (batch, H, pl.cdiv(P, cfg.block_v))
    kernel = functools.partial(_step_kernel, P=P, N=N, has_z=z is not None, dt_softplus=dt_softplus, dt_limit=dt_limit)
    return c.step_launch(
        kernel, "mamba2", grid=grid, in_specs=[s["state"]] + _input_specs(s, z is not None),
        out_specs=[s["row"], s["state"]],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        operands=(state, *_inputs(x, dt, A, B, C, D, z, dt_bias)), config=cfg, interpret=interpret, replay=replay,
        buffer_specs=lambda L: _buffer_specs(G, H, L, N, cfg.block_v))


def _buffer_specs(G, H, L, N, R, nb=None):
    """Block specs of the buffers (x, dt, B): R state rows and nb batch rows (None: one, squeezed)."""
    BL, BN, group = c.next_pow2(L), c.next_pow2(N), H // G
    return [pl.BlockSpec((nb, None, BL, R), lambda b, h, j: (b, h, 0, j)),
            pl.BlockSpec((nb, None, BL), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((nb, None, BL, BN), lambda b, h, j: (b, h // group, 0, 0))]


@functools.partial(jax.jit, static_argnames=("L", "dt_softplus", "dt_limit", "route", "config", "interpret"))
def mamba2_replay_step(checkpoint, xbuf, dtbuf, Bbuf, cursor, x, dt, A, B, C, D, z, dt_bias, *, L: int,
                       dt_softplus: bool, dt_limit: tuple[float, float], route: str,
                       config: Config | None = None, interpret: bool = False):
    """One ReplaySSM Mamba-2 decode step on the raw state arrays (in place).

    Args: checkpoint f32|bf16[batch, H, P, N]; xbuf [batch, H, L, P];
    dtbuf f32[batch, H, L] (processed dt); Bbuf [batch, G, L, N];
    cursor i32[batch] in 0..L; the step inputs as :func:`mamba2_step`.

    Returns: (y [batch, H, P] in x.dtype, checkpoint, xbuf, dtbuf, Bbuf,
    new cursor); checkpoint and buffers are updated in place (aliased). A
    row flushes (checkpoint = S after this step, cursor 0) when its cursor
    reaches L with this step or entered at L.
    """
    batch, H, P, N = checkpoint.shape
    G = B.shape[1]
    cfg = config or c.default_config(batch, H, P, N, checkpoint.dtype.itemsize, replay_len=L)
    group = H // G

    def specs(cfg, nb=None):
        """(grid, in_specs, out_specs) for programs of cfg.tiles row tiles and
        nb batch rows (None: one row, the batch axis squeezed)."""
        R = cfg.block_v * cfg.tiles
        s = _specs(H, G, R, N, nb)
        buffers, row = _buffer_specs(G, H, L, N, R, nb), c.cursor_spec(nb)
        in_specs = [s["state"], *buffers, row] + _input_specs(s, z is not None)
        return (batch // (nb or 1), H, cfg.splits(P)), in_specs, [s["row"], s["state"], *buffers, row]

    args = (checkpoint, xbuf, dtbuf, Bbuf, cursor, *_inputs(x, dt, A, B, C, D, z, dt_bias))
    grid, in_specs, out_specs = specs(cfg)
    kernel = functools.partial(_replay_kernel, P=P, N=N, L=L, group=group, has_z=z is not None,
                               dt_softplus=dt_softplus, dt_limit=dt_limit, route=route, config=cfg,
                               programs=H * grid[2])
    y, checkpoint, xbuf, dtbuf, Bbuf, new_cursor = c.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, checkpoint, xbuf, dtbuf, Bbuf, cursor)],
        input_output_aliases={0: 1, 1: 2, 2: 3, 3: 4, **({4: 5} if cfg.fused_flush else {})},
        interpret=interpret,
        config=cfg,
        name=f"mamba2_replay_{route}_L{L}_{cfg.tag()}",
    )(*args)
    if not cfg.fused_flush:
        flush = functools.partial(_flush_kernel, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit)
        checkpoint = c.flush_launch(flush, specs, cfg, checkpoint, (xbuf, dtbuf, Bbuf, *args[4:]),
                                    interpret=interpret, name=f"mamba2_replay_flush_L{L}")
    return y, checkpoint, xbuf, dtbuf, Bbuf, new_cursor
