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
  one tile per program; S read and written in place. The replay step's
  direct route runs the same kernel with the row's buffered records and
  cursor: its live records are folded into its checkpoint tile first, and
  the cursor is set to 0 in place.
- :func:`mamba2_replay_step` on the output, state, append and deferred routes:
  the replay kernel, grid (batch, H, splits): a program forms the per-head
  terms once (decay weights of the live slots, the buffered B's scores
  against C) and loops over its row tiles, reading each checkpoint tile
  once:
  y = exp(dt A) (exp(G) S_c C + sum_i w_i dt_i (B_i . C) x_i) + (B . C) dt x;
  the new record (x, dt, B) goes to the row's cursor. The flush applies
  the buffered records, then this step, to the checkpoint tiles of each
  row whose buffer is now full and writes them in place, fused into the
  replay kernel or as a second launch
  (:func:`replayssm_jax.kernels.launch.replay_launch`). `route="state"`
  makes the replay kernel form S in every step; `route="append"` runs the
  output route's kernel alone (no flush; the cursor moved by an XLA op
  after it), and `route="deferred"` runs it after the flush launch of the
  rows that entered full (`launch.flush_full_launch`).

- :func:`mamba2_replay_verify`: a verify window of W steps. The rows whose
  window does not fit behind the cursor flush their buffered records first
  (the flush launch); then the verify kernel, grid (batch, H, splits),
  reads each checkpoint tile once, applies the row's live records to it in
  registers (as the flush does), runs the W steps of the window on that
  tile and writes the W outputs and the W records at the cursor; the
  checkpoint is not written. A draft tree's nodes (tree speculation) are
  walked as in :mod:`replayssm_jax.kernels.gdn` (`launch.walk_tree`).
- :func:`mamba2_verify`: the per-draft standard verify on a slotted state
  [batch, slots, H, P, N], as :func:`replayssm_jax.kernels.gdn_verify`.

The z gate is optional (a None ref: no gate); D and dt_bias, when None,
are passed as zeros.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import (NO_FLUSH_ROUTES, ReplayConfig, StepConfig, next_pow2, per_draft_config_for,
                                          replay_config_for, step_config_for, verify_config_for)
from replayssm_jax.kernels.cursor import advance_cursor, live_count, read_cursor
from replayssm_jax.kernels.launch import (BlockSpecs, batch_shaped, flush_full_launch, head_work_warps,
                                          per_draft_launch, pool_of, replay_launch, replay_step,
                                          run_replay_program, run_verify_program,
                                          run_window, step_launch, tree_option, triton_params, verify_launch,
                                          verify_window, window_start)
from replayssm_jax.kernels.replay_math import (fold_live_records, rank_update, replay_records, replay_weights,
                                               softplus)
from replayssm_jax.kernels.tiles import (f32, for_each_row_tile, lane_ids, lane_mask, load, load_live, load_live_only,
                                         load_scalar, program_id)
from replayssm_jax.kernels.tiles import (load_checkpoint, mask_and, matvec, row_ids, row_mask, stochastic, store,
                                         store_checkpoint, tile_mask, tile_row_ids)
from replayssm_jax.kernels.tma_readout import (TMAReadoutConfig, check_mamba2_tma, check_tma_route,
                                               default_mamba2_tma, mamba2_deferred_readout_tma,
                                               mamba2_flushes_in_readout, mamba2_readout_tma,
                                               readout_moves_cursor)
from replayssm_jax.state import Mamba2ReplayState

# The state's rows and columns, as the size errors name them.
DIMS = (("head_dim", "P"), ("d_state", "N"))

# The inputs without a batch axis (one value per head).
PER_HEAD = ("A", "D", "dt_bias")


class Inputs(NamedTuple):
    """A step's inputs (arrays, their block specs, or their refs in a kernel):
    x [batch, H, P]; dt [batch, H] raw (as an array, [batch, X] with its H
    values at the launch's static `dt_offset`); A f32[H] negative; B, C
    [batch, G, N]; D [H]; dt_bias [H]; z [batch, H, P] or None (no gate)."""

    x: Any
    dt: Any
    A: Any
    B: Any
    C: Any
    D: Any
    dt_bias: Any
    z: Any


class Records(NamedTuple):
    """The buffered records of a Mamba2ReplayState (fields named as its own):
    x [batch, H, L, P], dt f32[batch, H, L] (processed), B [batch, G, L, N]."""

    x: Any
    dt: Any
    B: Any


def _process_dt(dt_raw, dt_bias, dt_softplus, dt_limit):
    dt = dt_raw + dt_bias
    if dt_softplus:
        dt = softplus(dt)
    low, high = dt_limit
    if low > 0.0 or high < math.inf:
        dt = jnp.clip(dt, low, high)
    return dt


def _load_step_inputs(inputs: Inputs, P, N, dt_softplus, dt_limit):
    BP, BN = inputs.x.shape[0], inputs.B.shape[0]
    pmask = row_mask(BP, P)
    nmask = lane_mask(BN, N)
    x = load(inputs.x, pmask)
    dt = _process_dt(load_scalar(inputs.dt), load_scalar(inputs.dt_bias), dt_softplus, dt_limit)
    A = load_scalar(inputs.A)
    Bv = load(inputs.B, nmask)
    Cv = load(inputs.C, nmask)
    skip = load_scalar(inputs.D) * x
    gate = None
    if inputs.z is not None:
        z = load(inputs.z, pmask)
        gate = z * jax.nn.sigmoid(z)
    return pmask, nmask, x, dt, A, Bv, Cv, skip, gate


def _skip_and_gate(y, skip, gate):
    y = y + skip
    return y if gate is None else y * gate


def _step_kernel(state_ref, inputs: Inputs, records: Records | None, cursor_ref, y_ref, state_out_ref,
                 cursor_out_ref, *, P, N, L, dt_softplus, dt_limit, dot_fold, programs):
    """The standard step on one state tile. Given the row's records and cursor
    (not None), the replay step's direct route: the live records are first
    folded into the checkpoint tile (one at a time, or with dot_fold all L
    slots as one rank-L update), and the cursor is set to 0 in place."""
    direct = records is not None
    if direct:
        count = read_cursor(cursor_ref)  # first: the fold's trip count waits on it
    pmask, nmask, x, dt, A, Bv, Cv, skip, gate = _load_step_inputs(inputs, P, N, dt_softplus, dt_limit)
    tmask = tile_mask(pmask, nmask, (inputs.x.shape[0], inputs.B.shape[0]))
    S = load_checkpoint(state_ref, None, tmask, pmask)
    ids = row_ids(state_ref.shape[0]) if stochastic(state_ref) else None  # the rows' global ids (stochastic rounding)

    def finish(S):
        S = S * jnp.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        store(y_ref, _skip_and_gate(matvec(S, Cv), skip, gate), pmask)
        store_checkpoint(state_ref, state_out_ref, None, S, tmask, pmask, ids, N)

    if not direct:
        return finish(S)
    record, whole = _record_loaders(records, pl.ds(0, state_ref.shape[0]), pmask, nmask, L, A)
    fold_live_records(S, count, record, finish, whole if dot_fold else None, L, state_ref.dtype)
    advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)


def _record_inputs(inputs: Inputs, B_dtype, N, dt_softplus, dt_limit):
    """This step's nmask, dt, A and B as buffered (rounded to the buffer's dtype)."""
    nmask = lane_mask(inputs.B.shape[0], N)
    dt = _process_dt(load_scalar(inputs.dt), load_scalar(inputs.dt_bias), dt_softplus, dt_limit)
    Bv = load(inputs.B, nmask).astype(B_dtype).astype(f32)
    return nmask, dt, load_scalar(inputs.A), Bv


def _load_x_record(x_ref, x_dtype, rows, pmask):
    """(x f32[BP], x as buffered) for the rows of a tile."""
    x = load(x_ref.at[rows], pmask)
    return x, x.astype(x_dtype).astype(f32)


def _buffer_weights(dt_ref, live, L, count, A):
    """(carried decay, w f32[BL]) of the live slots, dt_i folded into w (u_i = dt_i x_i)."""
    dts = load_live(dt_ref, live, L)
    total, w = replay_weights(dts * A, count)
    return jnp.exp(total), w * dts


def _replay_kernel(checkpoint_ref, records: Records, cursor_ref, inputs: Inputs, y_ref, checkpoint_out,
                   records_out: Records, cursor_out, *, P, N, L, group, dt_softplus, dt_limit, route, config,
                   programs):
    """The replay kernel (output, state, append and deferred routes) on a program's row tiles of one head and
    batch row."""
    BL, BN, BP = records.dt.shape[0], inputs.B.shape[0], config.block_v
    nmask, dt, A, Bv = _record_inputs(inputs, records.B.dtype, N, dt_softplus, dt_limit)
    Cv = load(inputs.C, nmask)
    D = load_scalar(inputs.D)
    count = live_count(read_cursor(cursor_ref), L, route)  # live records; the new one goes to slot `count`
    split = program_id(2)
    live = lane_ids(BL) < count  # dead slots are zeroed (a rejected draft may have left inf there)

    # Per-head work, once per program: decay weights of the live slots and
    # the buffered B's scores against C.
    carried, w = _buffer_weights(records.dt, live, L, count, A)
    Bb = load_live(records.B, live, L, nmask, records.B.dtype)  # as buffered (the rank update's keys)
    a_c = w * jnp.sum(Bb * Cv[None, :], axis=1)
    bc = jnp.sum(Bv * Cv)
    decay = jnp.exp(dt * A)
    append = count < L  # a row that entered full has no free slot (the flush absorbs this step)

    def tile(rows, pmask):
        tmask = tile_mask(pmask, nmask, (BP, BN))
        S_c = load_checkpoint(checkpoint_ref, rows, tmask, pmask)  # the one read of the checkpoint
        X = load_live(records.x.at[:, rows], live, L, pmask)
        x, x_rec = _load_x_record(inputs.x, records.x.dtype, rows, pmask)
        u = dt * x_rec
        if route != "state":
            y = decay * (carried * matvec(S_c, Cv) + jnp.sum(a_c[:, None] * X, axis=0)) + bc * u
        else:
            S = decay * rank_update(carried * S_c, w[:, None] * X, Bb, checkpoint_ref.dtype) + u[:, None] * Bv[None, :]
            y = matvec(S, Cv)
        y = y + D * x
        if inputs.z is not None:
            z = load(inputs.z.at[rows], pmask)
            y = y * (z * jax.nn.sigmoid(z))
        if route == "append":  # a row that entered full cannot take the step: NaN, its state unchanged
            y = jnp.where(append, y, jnp.nan)
        store(y_ref.at[rows], y, pmask)
        store(records_out.x.at[count, rows], x_rec, mask_and(pmask, append, (BP,)))  # the x rows are this program's

    flush_row = functools.partial(_flush_row, checkpoint_ref, records, inputs, checkpoint_out, cursor=count,
                                  split=split, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit)
    # The shared records: the step's processed dt, and B as buffered.
    run_replay_program(tile, flush_row, V=P, L=L, config=config, split=split, count=count, append=append,
                       group=group, decay_record=lambda: dt, decay_out=records_out.dt, key=Bv, key_out=records_out.B,
                       key_mask=nmask, cursor_out=cursor_out, programs=programs,
                       flush=route not in NO_FLUSH_ROUTES)


def _after_readout_kernel(readout_ref, records: Records, cursor_ref, inputs: Inputs, entry_ref, y_ref, outs, *, P,
                          N, L, group, dt_softplus, dt_limit, programs, route):
    """The append route's per-head work after the Mosaic GPU readout, on one (batch row, head): the live
    slots' decay weights and the buffered B's scores against C, then

        y = exp(dt A) (exp(G) S_c C + sum_i w_i dt_i (B_i . C) x_i) + (B . C) dt x + D x,

    times silu(z), with S_c C from `readout_ref`; the x and dt records at the row's cursor, the group's
    B record by the group's first head, all where the row has a free slot (else NaN outputs and nothing
    written), and the cursor moved to min(cursor + 1, L) in place: given `entry_ref` (the readout's copy of
    the cursor at entry, which the programs read instead of the cursor), by the row's first program; else
    once the row's `programs` programs have read it (`advance_cursor`). On the deferred route a full row is
    read as empty (`cursor.live_count`: its flush ran before), its cursor moved to 1. The buffered records
    are loaded where live only (`tiles.load_live_only`).

    Refs (BP, BN, BL: P, N, L up to powers of two; the head's and its
    group's blocks): readout_ref f32[BP], records.x [BL, BP], records.dt
    f32[BL], records.B [BL, BN], cursor_ref and entry_ref (or None)
    i32[1]; inputs.x, inputs.z [BP], inputs.dt, inputs.A, inputs.D,
    inputs.dt_bias scalars, inputs.B, inputs.C [BN]; y_ref [BP]; outs
    (records_out, cursor_out), the aliased records and cursor. Padded lanes
    are neither read nor written."""
    records_out, cursor_out = outs
    BL, BN, BP = records.dt.shape[0], inputs.B.shape[0], inputs.x.shape[0]
    pmask, nmask = lane_mask(BP, P), lane_mask(BN, N)
    cursor = read_cursor(cursor_ref if entry_ref is None else entry_ref)
    count = live_count(cursor, L, route)
    lanes = lane_ids(BL)
    live = lanes < count
    append = count < L  # a row that entered full has no free slot
    Bv = load(inputs.B, nmask).astype(records.B.dtype).astype(f32)  # as buffered
    Cv = load(inputs.C, nmask)
    scores = jnp.sum(load_live_only(records.B, live, nmask) * Cv[None, :], axis=1)
    A = load_scalar(inputs.A)
    dt = _process_dt(load_scalar(inputs.dt), load_scalar(inputs.dt_bias), dt_softplus, dt_limit)
    dts = load_live_only(records.dt, live)
    total, w = replay_weights(dts * A, count)
    X = load_live_only(records.x, live, pmask)
    x = load(inputs.x, pmask)
    x_rec = x.astype(records.x.dtype).astype(f32)
    terms = jnp.sum((w * dts * scores)[:, None] * X, axis=0)  # the buffer terms, u_i = dt_i x_i
    y = jnp.exp(dt * A) * (jnp.exp(total) * load(readout_ref, pmask) + terms) + (jnp.sum(Bv * Cv) * dt) * x_rec
    y = y + load_scalar(inputs.D) * x
    if inputs.z is not None:
        z = load(inputs.z, pmask)
        y = y * (z * jax.nn.sigmoid(z))
    store(y_ref, jnp.where(append, y, jnp.nan), pmask)
    store(records_out.x.at[count], x_rec, mask_and(pmask, append, (BP,)))
    store(records_out.dt, jnp.broadcast_to(dt, (BL,)), (lanes == count) & append)

    @pl.when(program_id(1) % group == 0)
    def _():
        store(records_out.B.at[count], Bv, mask_and(nmask, append, (BN,)))

    new = jnp.minimum(count + 1, L)
    if entry_ref is None:
        advance_cursor(cursor_out, cursor, new, programs)
    else:  # no program of this launch reads the cursor

        @pl.when((program_id(1) == 0) & (new != cursor))
        def _():
            cursor_out[0] = new


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "interpret", "route"))
def _after_readout(readout, records: Records, cursor, inputs: Inputs, entry=None, *, dt_softplus: bool,
                   dt_limit: tuple[float, float], interpret: bool, route: str = "append", dt_offset: int = 0):
    """The append (or deferred) route's launch after the Mosaic GPU readout (`_after_readout_kernel`),
    grid (batch, H).
    Takes the readout f32[batch, H, P] (S_c C), the state's records and cursor, the step's inputs (with
    D and dt_bias) and the readout's copy of the cursor at entry i32[batch] (None: the cursor is read and
    moved with atomics); returns (y [batch, H, P] in x.dtype, records, cursor), the records and the cursor
    written in place."""
    batch, H, P = inputs.x.shape
    G, N = inputs.B.shape[1:]
    L, group = records.x.shape[2], H // G
    BP, BN, BL = next_pow2(P), next_pow2(N), next_pow2(L)
    rows = pl.BlockSpec((None, None, BP), lambda b, h: (b, h, 0))
    per_row = pl.BlockSpec((None, None), lambda b, h: (b, h + dt_offset))
    per_head = pl.BlockSpec((None,), lambda b, h: (h,))
    grp = pl.BlockSpec((None, None, BN), lambda b, h: (b, h // group, 0))
    record_specs = Records(x=pl.BlockSpec((None, None, BL, BP), lambda b, h: (b, h, 0, 0)),
                           dt=pl.BlockSpec((None, None, BL), lambda b, h: (b, h, 0)),
                           B=pl.BlockSpec((None, None, BL, BN), lambda b, h: (b, h // group, 0, 0)))
    cursor_spec = pl.BlockSpec((1,), lambda b, h: (b,))
    input_specs = Inputs(x=rows, dt=per_row, A=per_head, B=grp, C=grp, D=per_head, dt_bias=per_head,
                         z=None if inputs.z is None else rows)
    kernel = functools.partial(_after_readout_kernel, P=P, N=N, L=L, group=group, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, programs=H, route=route)
    y, (records, cursor) = pl.pallas_call(
        kernel, grid=(batch, H), interpret=interpret, name=f"mamba2_append_heads_L{L}",
        compiler_params=triton_params(head_work_warps(BL * BP)),
        in_specs=(rows, record_specs, cursor_spec, input_specs, None if entry is None else cursor_spec),
        out_specs=(rows, (record_specs, cursor_spec)),
        out_shape=(jax.ShapeDtypeStruct(inputs.x.shape, inputs.x.dtype),
                   jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (records, cursor))),
        input_output_aliases={1: 1, 2: 2, 3: 3, 4: 4},
    )(readout, records, cursor, inputs, entry)
    return y, records, cursor


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "config", "route"))
def _append_tma(state: Mamba2ReplayState, inputs: Inputs, *, dt_softplus: bool, dt_limit: tuple[float, float],
                dt_offset: int, config: TMAReadoutConfig, route: str):
    """The append or deferred route on Mosaic GPU: the readout S_c C (`tma_readout.mamba2_readout_tma`), then
    the per-head launch (`_after_readout`), on validated arguments within the readout's limits
    (`tma_readout.check_mamba2_tma`). On the deferred route the readout flushes the full rows itself
    (`tma_readout.mamba2_deferred_readout_tma`) where `tma_readout.mamba2_flushes_in_readout` says, else
    the flush launch of the full rows (`_flush_full`, the default ReplayConfig's flush tiling) runs first.
    Returns (y [batch, H, P] in x.dtype, new Mamba2ReplayState), as :func:`mamba2_replay_step`."""
    records, inputs = Records(state.x, state.dt, state.B), _with_defaults(inputs)
    if route == "deferred" and mamba2_flushes_in_readout(state, inputs.C, config):
        readout, checkpoint, entry = mamba2_deferred_readout_tma(state, inputs.C, inputs.A, config)
        state = state.replace(checkpoint=checkpoint)
    else:
        if route == "deferred":
            flush = replay_config_for(None, state.checkpoint, state.buffer_len, DIMS, route=route)
            state = state.replace(checkpoint=_flush_full(state.checkpoint, records, state.cursor, inputs,
                                                         dt_softplus=dt_softplus, dt_limit=dt_limit, config=flush,
                                                         interpret=False))
        if readout_moves_cursor(state.cursor.shape[0]):
            readout, entry = mamba2_readout_tma(state.checkpoint, inputs.C, config, state.cursor)
        else:
            readout, entry = mamba2_readout_tma(state.checkpoint, inputs.C, config), None
    y, records, cursor = _after_readout(readout, records, state.cursor, inputs, entry, dt_softplus=dt_softplus,
                                        dt_limit=dt_limit, dt_offset=dt_offset, interpret=False, route=route)
    return y, state.replace(x=records.x, dt=records.dt, B=records.B, cursor=cursor)


def _record_loaders(records: Records, rows, pmask, nmask, L, A):
    """The loaders of `replay_records` for the state rows `rows` (a `pl.ds`),
    with the head's A: record(i) -> (dt_i A, dt_i x_i [BP], B_i [BN]) of
    slot i, and all_records(live) -> (dt A [BL], dt x [BL, BP], B [BL, BN]
    as buffered), dead slots zeroed."""

    def record(i):
        dt_i = records.dt[i]
        return dt_i * A, dt_i * load(records.x.at[i, rows], pmask), load(records.B.at[i], nmask)

    def all_records(live):
        dts = load_live(records.dt, live, L)
        return (dts * A, dts[:, None] * load_live(records.x.at[:, rows], live, L, pmask),
                load_live(records.B, live, L, nmask, records.B.dtype))

    return record, all_records


def _materialize(checkpoint_ref, records: Records, count, rows, pmask, nmask, tmask, L, A):
    """f32[BP, BN]: the checkpoint tile of `rows` (its mask `tmask`) after the row's first `count`
    buffered records (`replay_records`), with the head's A."""
    S_c = load_checkpoint(checkpoint_ref, rows, tmask, pmask)
    return replay_records(S_c, count, L, *_record_loaders(records, rows, pmask, nmask, L, A), checkpoint_ref.dtype)


def _flush_row(checkpoint_ref, records: Records, inputs: Inputs, checkpoint_out, *, cursor, split, config, P, N, L,
               dt_softplus, dt_limit, step=True):
    """Write S after this step into the checkpoint of one flushing row (refs:
    the row's blocks; cursor at entry L - 1 or L): its `cursor` buffered
    records, then this step, S <- exp(dt A) S + dt x B^T with x and B as
    buffered. Slot `cursor` is never read: the fused flush runs in the
    launch that writes it. step=False (a verify window's early flush): the
    buffered records only, of which `inputs` holds A alone."""
    BN, BP = records.B.shape[-1], config.block_v
    if step:
        nmask, dt, A, Bv = _record_inputs(inputs, records.B.dtype, N, dt_softplus, dt_limit)
        decay = jnp.exp(dt * A)
    else:
        nmask, A = lane_mask(BN, N), load_scalar(inputs.A)

    def tile(rows, pmask):
        tmask = tile_mask(pmask, nmask, (BP, BN))
        S = _materialize(checkpoint_ref, records, cursor, rows, pmask, nmask, tmask, L, A)
        if step:
            S = decay * S
            u = dt * _load_x_record(inputs.x, records.x.dtype, rows, pmask)[1]
            S = S + u[:, None] * Bv[None, :]
        ids = tile_row_ids(config, split, rows) if stochastic(checkpoint_ref) else None
        store_checkpoint(checkpoint_ref, checkpoint_out, rows, S, tmask, pmask, ids, N)

    for_each_row_tile(P, config, split, tile)


def _window_steps(inputs: Inputs, y_ref, rows, pmask, nmask, S_0, keep, *, W, A, D, dt_bias, dt_softplus, dt_limit,
                  tree=None) -> None:
    """The W steps of a verify window on the state tile S_0 f32[BP, BN] of `rows` (a `pl.ds`; pmask, nmask
    its rows' and columns' masks; A, D, dt_bias the head's f32 scalars): step t (the selective state
    update) writes its output y_t [BP] to y_ref.at[t, rows], then calls keep(t, S_t, x_t), which stores
    what the launch keeps of it (the x record, or the state). A chain runs a loop; a draft tree (static,
    not a chain) its nodes in node order (`walk_tree`)."""

    def advance(t, S):  # S after step t, and the step's x
        dt = _process_dt(inputs.dt[t].astype(f32), dt_bias, dt_softplus, dt_limit)
        x = load(inputs.x.at[t, rows], pmask)
        return jnp.exp(dt * A) * S + (dt * x)[:, None] * load(inputs.B.at[t], nmask)[None, :], x

    def step(t, S):
        S, x = advance(t, S)
        gate = None
        if inputs.z is not None:
            z = load(inputs.z.at[t, rows], pmask)
            gate = z * jax.nn.sigmoid(z)
        store(y_ref.at[t, rows], _skip_and_gate(matvec(S, load(inputs.C.at[t], nmask)), D * x, gate), pmask)
        keep(t, S, x)
        return S

    run_window(tree, W, S_0, step, lambda t, S: advance(t, S)[0])


def _verify_kernel(checkpoint_ref, records: Records, cursor_ref, inputs: Inputs, y_ref, records_out: Records, *, P,
                   N, L, W, group, dt_softplus, dt_limit, config, tree=None):
    """The verify kernel on a program's row tiles of one head and batch row:
    each checkpoint tile read once and brought to the window's start in
    registers (its live records applied), then the W steps on it, each
    writing its output and its x record; the state is not written. With a
    draft tree (static, not a chain), the W nodes in node order on the
    tree's paths (`walk_tree`)."""
    BW, BN = inputs.dt.shape[0], inputs.B.shape[-1]
    nmask, wmask = lane_mask(BN, N), lane_mask(BW, W)
    count = read_cursor(cursor_ref)
    start = window_start(count, L, W)  # the early flush emptied the rows whose window does not fit
    split = program_id(2)
    A, D, dt_bias = load_scalar(inputs.A), load_scalar(inputs.D), load_scalar(inputs.dt_bias)

    def tile(rows, pmask):
        def keep(t, S, x):
            store(records_out.x.at[start + t, rows], x, pmask)  # the x rows are this program's

        tmask = tile_mask(pmask, nmask, (config.block_v, BN))
        S_0 = _materialize(checkpoint_ref, records, start, rows, pmask, nmask, tmask, L, A)
        _window_steps(inputs, y_ref, rows, pmask, nmask, S_0, keep, W=W, A=A, D=D, dt_bias=dt_bias,
                      dt_softplus=dt_softplus, dt_limit=dt_limit, tree=tree)

    # The shared records: the window's processed dt, and its B.
    dts = _process_dt(load(inputs.dt, wmask), dt_bias, dt_softplus, dt_limit)
    run_verify_program(tile, V=P, W=W, config=config, split=split, start=start, group=group, decay_window=dts,
                       decay_out=records_out.dt, keys=load(inputs.B, tile_mask(wmask, nmask, (BW, BN))),
                       key_out=records_out.B, key_mask=nmask)


def _per_draft_kernel(state_ref, index_ref, inputs: Inputs, y_ref, state_out_ref, *, P, N, W, slots, dt_softplus,
                      dt_limit, tree=None):
    """The per-draft verify on one state tile of one head and batch row: the tile of the current state
    (slot index) read once, then the W steps on it (`_window_steps`), step t's state written to slot
    (index + 1 + t) mod slots."""
    BP, BN = state_ref.shape[1:]
    pmask, nmask = row_mask(BP, P), lane_mask(BN, N)
    tmask = tile_mask(pmask, nmask, (BP, BN))
    index = index_ref[0]
    S_0 = load(state_ref.at[index], tmask)

    def keep(t, S, x):
        store(state_out_ref.at[(index + 1 + t) % slots], S, tmask)

    _window_steps(inputs, y_ref, pl.ds(0, BP), pmask, nmask, S_0, keep, W=W, A=load_scalar(inputs.A),
                  D=load_scalar(inputs.D), dt_bias=load_scalar(inputs.dt_bias), dt_softplus=dt_softplus,
                  dt_limit=dt_limit, tree=tree)


def _block_specs(H, G, N, L, gated, dt_offset, rows, nb=None, window=None) -> BlockSpecs:
    """Block specs of programs of `rows` state rows and nb batch rows (None:
    one, the batch axis squeezed); z's None without the gate; records None
    where L is None; dt's value of head h at column dt_offset + h. window:
    BW, the block of a verify window's axis (after batch) on the inputs and
    the output; None: one step, no window axis."""
    BN, group = next_pow2(N), H // G
    lead, at = ((nb,), ()) if window is None else ((nb, window), (0,))
    state = pl.BlockSpec((nb, None, rows, BN), lambda b, h, j: (b, h, j, 0))
    row = pl.BlockSpec((*lead, None, rows), lambda b, h, j: (b, *at, h, j))
    dt = pl.BlockSpec((*lead, None), lambda b, h, j: (b, *at, h + dt_offset))
    head = pl.BlockSpec((None,), lambda b, h, j: (h,))
    grp = pl.BlockSpec((*lead, None, BN), lambda b, h, j: (b, *at, h // group, 0))
    records = None
    if L is not None:
        BL = next_pow2(L)
        records = Records(x=pl.BlockSpec((nb, None, BL, rows), lambda b, h, j: (b, h, 0, j)),
                          dt=pl.BlockSpec((nb, None, BL), lambda b, h, j: (b, h, 0)),
                          B=pl.BlockSpec((nb, None, BL, BN), lambda b, h, j: (b, h // group, 0, 0)))
    inputs = Inputs(x=row, dt=dt, A=head, B=grp, C=grp, D=head, dt_bias=head, z=row if gated else None)
    return BlockSpecs(state=state, inputs=inputs, out=row, records=records)


def _only_A(inputs: Inputs) -> Inputs:
    """`inputs` with A alone (the others None): what an early flush (step=False) reads."""
    return Inputs(*(None,) * len(Inputs._fields))._replace(A=inputs.A)


def _with_defaults(inputs: Inputs) -> Inputs:
    """D and dt_bias as zeros where None."""
    H = inputs.A.shape[0]
    zeros = jnp.zeros((H,), f32)
    return inputs._replace(D=zeros if inputs.D is None else inputs.D,
                           dt_bias=zeros if inputs.dt_bias is None else inputs.dt_bias)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "config", "interpret"))
def _step(state, inputs: Inputs, records: Records | None, cursor, slots=None, *, dt_softplus: bool,
          dt_limit: tuple[float, float], dt_offset: int, config: StepConfig, interpret: bool):
    """The standard step's launch; with records and cursor, the direct route's; over a state pool with
    `slots` (`launch.Pool`). Returns (y, state, cursor or None)."""
    _, H, P, N = state.shape
    L = None if records is None else records.x.shape[2]
    kernel = functools.partial(_step_kernel, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit,
                               dot_fold=config.dot_fold)
    specs = functools.partial(_block_specs, H, inputs.B.shape[1], N, L, inputs.z is not None, dt_offset)
    return step_launch("mamba2", kernel, specs, state, _with_defaults(inputs),
                       jax.ShapeDtypeStruct(inputs.x.shape, inputs.x.dtype), records, cursor, config=config,
                       interpret=interpret, pool=pool_of(slots, state))


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "route", "config", "interpret"))
def _replay(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, dt_softplus: bool,
            dt_limit: tuple[float, float], dt_offset: int, route: str, config: ReplayConfig, interpret: bool):
    """The replay step's launches (output, state, append and deferred routes; the deferred route's
    flush launch first); over a state pool with `slots` (`launch.Pool`). Returns (y, checkpoint,
    records, cursor)."""
    _, H, P, N = checkpoint.shape
    G, L = inputs.B.shape[1], records.x.shape[2]
    inputs = _with_defaults(inputs)
    if route == "deferred":
        checkpoint = _flush_full(checkpoint, records, cursor, inputs, slots, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit, config=config, interpret=interpret)
    kernel = functools.partial(_replay_kernel, P=P, N=N, L=L, group=H // G, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, route=route)
    flush_row = functools.partial(_flush_row, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit)
    specs = functools.partial(_block_specs, H, G, N, L, inputs.z is not None, dt_offset)
    return replay_launch("mamba2", kernel, flush_row, specs, checkpoint, records, cursor, inputs,
                         jax.ShapeDtypeStruct(inputs.x.shape, inputs.x.dtype), per_head=PER_HEAD, route=route,
                         config=config, interpret=interpret, pool=pool_of(slots, checkpoint))


def _flush_full(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, dt_softplus: bool,
                dt_limit: tuple[float, float], config: ReplayConfig, interpret: bool):
    """The deferred route's flush launch (`launch.flush_full_launch`) with `config`'s flush tiling: the
    rows at cursor L get their L buffered records folded into the checkpoint, in place (of `inputs`,
    with their defaults, only A is read). Returns the checkpoint operand."""
    _, H, P, N = checkpoint.shape
    G, L = inputs.B.shape[1], records.x.shape[2]
    flush_row = functools.partial(_flush_row, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit, step=False)
    specs = functools.partial(_block_specs, H, G, N, L, inputs.z is not None, 0)  # dt not read
    return flush_full_launch("mamba2", flush_row, specs, checkpoint, records, cursor, _only_A(inputs),
                             per_head=PER_HEAD, config=config, interpret=interpret, pool=pool_of(slots, checkpoint))


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "config", "interpret", "tree"))
def _verify(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, dt_softplus: bool,
            dt_limit: tuple[float, float], dt_offset: int, config: ReplayConfig, interpret: bool, tree=None):
    """A verify window's launches (early flush, verify kernel); tree: a draft
    tree (not a chain) or None; over a state pool with `slots` (`launch.Pool`).
    Returns (y, checkpoint, records, cursor)."""
    _, H, P, N = checkpoint.shape
    G, L, W = inputs.B.shape[2], records.x.shape[2], inputs.x.shape[1]
    kernel = functools.partial(_verify_kernel, P=P, N=N, L=L, W=W, group=H // G, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, **tree_option(tree))
    flush_row = functools.partial(_flush_row, P=P, N=N, L=L, dt_softplus=dt_softplus, dt_limit=dt_limit, step=False)
    specs = functools.partial(_block_specs, H, G, N, L, inputs.z is not None, dt_offset, window=next_pow2(W))
    inputs = _with_defaults(inputs)
    return verify_launch("mamba2", kernel, flush_row, specs, checkpoint, records, cursor, inputs, _only_A(inputs),
                         jax.ShapeDtypeStruct(inputs.x.shape, inputs.x.dtype), window=W, per_head=PER_HEAD,
                         config=config, interpret=interpret, tree=tree, pool=pool_of(slots, checkpoint))


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "dt_offset", "config", "interpret", "tree"))
def _per_draft(state, index, inputs: Inputs, slots=None, *, dt_softplus: bool, dt_limit: tuple[float, float],
               dt_offset: int, config: StepConfig, interpret: bool, tree=None):
    """The per-draft verify's launch; tree: a draft tree (not a chain) or None; over a state pool with
    `slots`. Returns (y, state)."""
    _, S, H, P, N = state.shape
    W = inputs.x.shape[1]
    kernel = functools.partial(_per_draft_kernel, P=P, N=N, W=W, slots=S, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, **tree_option(tree))
    specs = functools.partial(_block_specs, H, inputs.B.shape[2], N, None, inputs.z is not None, dt_offset,
                              window=next_pow2(W))
    return per_draft_launch("mamba2", kernel, specs, state, index, _with_defaults(inputs),
                            jax.ShapeDtypeStruct(inputs.x.shape, inputs.x.dtype), window=W, config=config,
                            interpret=interpret, tree=tree, pool=pool_of(slots, state))


def _step_options(dt_softplus, dt_limit, dt_offset, interpret) -> dict:
    low, high = dt_limit
    return dict(dt_softplus=bool(dt_softplus), dt_limit=(float(low), float(high)), dt_offset=int(dt_offset or 0),
                interpret=interpret)


def mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool, dt_limit: tuple[float, float],
                dt_offset: int | None = None, config: StepConfig | None = None, interpret: bool = False,
                slots=None):
    """One standard Mamba-2 decode step (Pallas kernel); the state is updated in place.

    Takes validated arguments (:func:`replayssm_jax.ops.mamba2_step`
    validates them) and checks only the kernels' own limits, before any launch.

    Args:
      state: f32 | bf16[batch, H, P, N] (mamba_ssm's ssm_state).
      x: [batch, H, P]; dt: [batch, H], raw (before dt_bias and softplus).
      A: f32[H], negative, A = -exp(A_log).
      B, C: [batch, G, N] (G divides H).
      D: [H] or None (no skip); z: [batch, H, P] or None (no gate,
        y *= silu(z) otherwise); dt_bias: [H] or None.
      dt_softplus: dt = softplus(dt + dt_bias) (else dt + dt_bias).
      dt_limit: (low, high), 0 <= low <= high: dt is clamped to it (the
        model's time_step_limit; (0, inf): no clamp).
      dt_offset: None, or an int: dt is [batch, X] and holds the H values
        at columns dt_offset .. dt_offset + H - 1, read there by the kernels
        (Mamba-2's in_proj output zxbcdt: no slice of it before the launch).
      config, interpret, slots: as :func:`replayssm_jax.kernels.gdn_step`
        (a state pool [capacity, H, P, N] with slots); the default tiling is
        :func:`default_step_config` with layer "mamba2".

    Returns (y [batch, H, P] in x.dtype, new_state like state); raises
    ValueError for P or N above MAX_HEAD_DIM (256) or a `config.block_v`
    above P rounded up to a power of two, TypeError for a `config` that is
    not a StepConfig. Math: Dao & Gu, "Transformers are SSMs" (ICML 2024),
    as mamba_ssm's selective_state_update.
    """
    config = step_config_for(config, batch_shaped(state, slots), DIMS, layer="mamba2")
    y, state, _ = _step(state, Inputs(x, dt, A, B, C, D, dt_bias, z), None, None, slots, config=config,
                        **_step_options(dt_softplus, dt_limit, dt_offset, interpret))
    return y, state


def mamba2_replay_step(state: Mamba2ReplayState, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool,
                       dt_limit: tuple[float, float], route: str, dt_offset: int | None = None,
                       config: StepConfig | ReplayConfig | TMAReadoutConfig | None = None, interpret: bool = False,
                       slots=None):
    """One ReplaySSM Mamba-2 decode step (Pallas kernels); checkpoint, buffers and cursor in place.

    Takes validated arguments (:func:`replayssm_jax.ops.mamba2_replay_step`
    validates them and resolves route="auto"); the flush rule, `route`,
    `config`, `interpret`, `slots` (a state pool) and the kernels' own
    limits (checked before any launch) are those of
    :func:`replayssm_jax.kernels.gdn_replay_step`,
    with head_dim P and d_state N for V and K. On the append route a
    :class:`~replayssm_jax.kernels.tma_readout.TMAReadoutConfig` (the
    default where :func:`~replayssm_jax.kernels.tma_readout.default_mamba2_tma`
    says) runs it as two launches: one Mosaic GPU kernel whose TMA copies
    stream the checkpoint for S_c C
    (:func:`~replayssm_jax.kernels.tma_readout.mamba2_readout_tma`), then a
    Triton launch of the per-head work, the records and the cursor, in
    place; within :func:`~replayssm_jax.kernels.tma_readout.check_mamba2_tma`'s
    limits (NotImplementedError, ValueError). On the deferred route the
    readout flushes the rows that entered full itself where
    :func:`~replayssm_jax.kernels.tma_readout.mamba2_flushes_in_readout`
    says (else the flush launch runs first).

    Args:
      state: a Mamba2ReplayState: checkpoint f32 | bf16[batch, H, P, N];
        records x [batch, H, L, P], dt f32[batch, H, L] (processed dt),
        B [batch, G, L, N]; cursor i32[batch] in 0..L.
      x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, dt_offset: as
        :func:`mamba2_step`.

    Returns:
      (y [batch, H, P] in x.dtype, new Mamba2ReplayState).

    Raises:
      ValueError, TypeError: as :func:`replayssm_jax.kernels.gdn_replay_step`.
    """
    kw = _step_options(dt_softplus, dt_limit, dt_offset, interpret)
    if config is None and route in NO_FLUSH_ROUTES:
        config = default_mamba2_tma(state, C, interpret=interpret, slots=slots, deferred=route == "deferred")
    if isinstance(config, TMAReadoutConfig):
        check_tma_route(route, NO_FLUSH_ROUTES)
        check_mamba2_tma(state, C, config, interpret=interpret, slots=slots)
        return _append_tma(state, Inputs(x, dt, A, B, C, D, dt_bias, z), config=config, route=route,
                           dt_softplus=kw["dt_softplus"], dt_limit=kw["dt_limit"], dt_offset=kw["dt_offset"])
    config = replay_config_for(config, batch_shaped(state.checkpoint, slots), state.buffer_len, DIMS, route=route)
    return replay_step(state, Records(state.x, state.dt, state.B), Inputs(x, dt, A, B, C, D, dt_bias, z),
                       route=route, config=config, step=functools.partial(_step, **kw),
                       replay=functools.partial(_replay, **kw), slots=slots)


def mamba2_replay_verify(state: Mamba2ReplayState, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool,
                         dt_limit: tuple[float, float], dt_offset: int | None = None, tree=None,
                         config: ReplayConfig | None = None, interpret: bool = False, slots=None):
    """Verify a window of W speculative Mamba-2 steps (Pallas kernels); checkpoint and buffers in place.

    Takes validated arguments (:func:`replayssm_jax.ops.mamba2_replay_verify`
    validates them). Rows with cursor + W > L flush first (a launch that
    writes their checkpoint, the state after their buffered records, and
    skips the other rows); such rows then verify from it with an empty
    buffer, at slots 0 .. W - 1, and their cursor becomes 0. Then one
    launch, grid (batch, H, splits), reads each checkpoint tile once and
    applies the row's live records to it in registers, S_0 = exp(G) S_c +
    sum_i w_i dt_i x_i B_i^T (the flush's `replay_records`; S_0 the state at
    the window's start), then runs the window's W steps on that tile (the
    selective state update; ARCHITECTURE.md, "The verify window"; Dao & Gu, "Transformers
    are SSMs", ICML 2024):

        S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,  y_t = S_t C_t + D x_t,

    then y_t *= silu(z_t), and writes the W records (x, processed dt, B),
    as the buffers' dtypes, at slots cursor .. cursor + W - 1; the
    checkpoint is not written. Output t reads nothing of steps s > t (NaN
    and inf included), nor of dead slots.

    Args:
      state: a Mamba2ReplayState with no pending window (as
        :func:`mamba2_replay_step`).
      x: [batch, W, H, P]; dt: [batch, W, H], raw; B, C: [batch, W, G, N];
        z: [batch, W, H, P] or None; A, D, dt_bias, dt_softplus, dt_limit,
        dt_offset (dt then [batch, W, X]): as :func:`mamba2_step`.
      tree: None or a DraftTree of W nodes (static), run as in
        :func:`replayssm_jax.kernels.gdn_replay_verify`.
      config: a ReplayConfig (fused_flush False; its flush fields tile the
        early flush); None: :func:`default_verify_config`.
      interpret: run the kernels in Pallas interpret mode.
      slots: None, or i32[batch] (validated): the state is a state pool of
        capacity slots and batch row b verifies slot slots[b] in place (the
        early flush and the verify kernel index the pool by slot; -1: a
        padding row, which reads and writes nothing), as
        :func:`mamba2_replay_step`.

    Returns:
      (y [batch, W, H, P] in x.dtype, new Mamba2ReplayState with window =
      W): y[:, t] assumes steps 0 .. t - 1 of the window accepted; commit
      with :func:`replayssm_jax.state.replay_commit`.

    Raises:
      ValueError, TypeError: as :func:`replayssm_jax.kernels.gdn_replay_verify`,
        with head_dim P and d_state N for V and K.
    """
    W = x.shape[1]
    config = verify_config_for(config, batch_shaped(state.checkpoint, slots), state.buffer_len, W, DIMS, tree)
    verify = functools.partial(_verify, config=config, **_step_options(dt_softplus, dt_limit, dt_offset, interpret),
                               **tree_option(tree))
    return verify_window(state, Records(state.x, state.dt, state.B), Inputs(x, dt, A, B, C, D, dt_bias, z),
                         window=W, verify=verify, slots=slots)


def mamba2_verify(state, index, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool, dt_limit: tuple[float, float],
                  dt_offset: int | None = None, tree=None, config: StepConfig | None = None, interpret: bool = False,
                  slots=None):
    """The per-draft standard verify of W speculative Mamba-2 steps (Pallas kernel); the state in place.

    Takes validated arguments (:func:`replayssm_jax.ops.mamba2_verify`
    validates them). One launch, grid (batch, H, cdiv(P, block_v)): each
    program reads its tile of the row's current state (slot index[b]) once
    and runs the W steps on it (the selective state update, as
    :func:`mamba2_step`), writing y_t and the state after step t to slot
    (index + 1 + t) mod slots: 1 + W state passes per layer, as vLLM's
    selective_state_update with per-draft state indices. The current slot
    is never written (W < slots), so a commit is an index move.

    Args:
      state: f32 | bf16[batch, slots, H, P, N], the slotted standard state;
        index: i32[batch], each row's slot of the current state.
      x: [batch, W, H, P]; dt: [batch, W, H], raw; B, C: [batch, W, G, N];
        z: [batch, W, H, P] or None; A, D, dt_bias, dt_softplus, dt_limit,
        dt_offset (dt then [batch, W, X]): as :func:`mamba2_step`.
      tree, config, interpret, slots: as :func:`replayssm_jax.kernels.gdn_verify`
        (a state pool [capacity, slots, H, P, N] with index i32[capacity]).

    Returns:
      (y [batch, W, H, P] in x.dtype, new state like state).

    Raises:
      ValueError, TypeError: as :func:`mamba2_step`.
    """
    config = per_draft_config_for(config, batch_shaped(state, slots), DIMS)
    return _per_draft(state, index, Inputs(x, dt, A, B, C, D, dt_bias, z), slots, config=config,
                      **_step_options(dt_softplus, dt_limit, dt_offset, interpret), **tree_option(tree))
