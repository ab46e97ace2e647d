"""Pallas (Triton) decode kernels of the Gated DeltaNet layer.

Letters: batch, H key heads, HV value heads (value head h reads key head
h // (HV // H)), K key dim, V value dim, L buffer length. The state is
value-major, S f32 | bf16[batch, HV, V, K]. One decode step (DESIGN.md
section 2, fla's fused_recurrent_gated_delta_rule with T = 1):

    S' = exp(g) S;  d = beta (v - S' k);  S_new = S' + d k^T;  o = S_new (scale q)

with q, k L2-normalized over K (eps 1e-6) when use_qk_l2norm.

Tiles: a program works on [block_v, K] tiles of one head's state (rows of
V, all K columns), so S k and S q are local row sums and no two programs
touch the same state element.

- :func:`gdn_step`: the standard step, grid (batch, HV, cdiv(V, block_v)),
  one tile per program; reads S, writes S in place (aliased). Given a
  replay state's buffers and cursor, it is the replay step's direct route:
  each row's live records are folded into its checkpoint tile first, and
  the cursor is set to 0 in place.
- :func:`gdn_replay_step`: the ReplaySSM step. The replay kernel, grid
  (batch, HV, splits): a program forms the per-head terms once (decay
  weights of the live slots, the buffered keys' scores against k and q),
  then loops over its row tiles; one read of each checkpoint tile gives both
  exp(g) S_{j-1} k_j (for d_j) and S_j q_j through the buffered records,
  without forming S; the new record (d_j, k_j, g_j) goes to the row's
  cursor. The flush materializes S_j of each row whose buffer is now full
  (its buffered records applied to its checkpoint tile, then this step)
  and writes it in place: with `config.fused_flush` the replay kernel does
  it after its readout, on sub-tiles of its rows (one launch per step, the
  cursor moved in place by the row's last program, `advance_cursor`);
  otherwise a second launch, grid (batch / rows, HV, tiles), one tile and a
  block of batch rows per program; the replay kernel's first program of
  the row then writes the next cursor to a fresh array (the flush launch
  reads the old one). `route="state"` makes the replay kernel
  form S_{j-1} in every step and read o from S_j instead.

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


def _step_kernel(s_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, V, K, scale, use_qk_l2norm, L=0, programs=0):
    """The standard step; with L > 0 the direct route of the replay step: refs
    then begin with the row's buffers (d, k, g) and cursor, which are first
    folded into the checkpoint tile, and end with the cursor (in place, 0)."""
    o_ref, s_out_ref = refs[-3:-1] if L else refs
    if L:
        dbuf_ref, kbuf_ref, gbuf_ref, cur_ref = refs[:4]
        count = c.read_cursor(cur_ref)  # first: the fold's trip count waits on it
    BV, BK = s_ref.shape
    vmask = c.row_mask(BV, V)
    kmask, q, k = _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale)
    tile = c.outer(vmask, kmask, (BV, BK))
    S = c.load(s_ref, tile)
    decay, v, beta = jnp.exp(c.load_scalar(g_ref)), c.load(v_ref, vmask), c.load_scalar(beta_ref)

    def finish(S):
        S = S * decay
        d = beta * (v - c.matvec(S, k))
        S = S + d[:, None] * k[None, :]
        c.store(o_ref, c.matvec(S, q), vmask)
        c.store(s_out_ref, S, tile)

    if not L:
        return finish(S)
    c.fold_then(S, count, lambda i: (gbuf_ref[i], c.load(dbuf_ref.at[i], vmask), c.load(kbuf_ref.at[i], kmask)),
                finish)
    c.advance_cursor(refs[-1], count, jnp.int32(0), programs)


def _replay_kernel(
    ck_ref, dbuf_ref, kbuf_ref, gbuf_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    o_ref, ck_out, dbuf_out, kbuf_out, gbuf_out, cur_out,
    *, V, K, L, group, scale, use_qk_l2norm, route, config, programs,
):
    BL, BK, BV = gbuf_ref.shape[0], q_ref.shape[-1], config.block_v
    kmask, q, k = _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale)
    count = c.read_cursor(cur_ref)  # live records; the new one goes to slot `count`
    split = pl.program_id(2)
    live = c.lane_ids(BL) < count  # dead slots are zeroed (a rejected draft may have left inf there)

    # Per-head work, once per program: the decay weights of the live slots
    # and the buffered keys' scores against this step's k and q.
    total, w = c.replay_weights(c.load_live(gbuf_ref, live, L), count)
    Kb = c.load_live(kbuf_ref, live, L, kmask, kbuf_ref.dtype)  # as buffered (the rank update's keys)
    a_k = w * jnp.sum(Kb * k[None, :], axis=1)
    a_q = w * jnp.sum(Kb * q[None, :], axis=1)
    kq = jnp.sum(k * q)
    decay = jnp.exp(c.load_scalar(g_ref))
    beta = c.load_scalar(beta_ref)
    carried = jnp.exp(total)  # decay of the checkpoint up to the last live slot
    append = count < L  # a row that entered full has no free slot (the flush absorbs this step)

    def tile(rows, vmask):
        tmask = c.outer(vmask, kmask, (BV, BK))
        S_c = c.load(ck_ref.at[rows, :], tmask)  # the one read of the checkpoint
        U = c.load_live(dbuf_ref.at[:, rows], live, L, vmask)
        v = c.load(v_ref.at[rows], vmask)
        if route == "output":
            # exp(g) S_{j-1} k and exp(g) S_{j-1} q without forming S_{j-1}.
            Sk = decay * (carried * c.matvec(S_c, k) + jnp.sum(a_k[:, None] * U, axis=0))
            d = beta * (v - Sk)
            o = decay * (carried * c.matvec(S_c, q) + jnp.sum(a_q[:, None] * U, axis=0)) + kq * d
        else:
            S = decay * c.rank_update(carried * S_c, w[:, None] * U, Kb, ck_ref.dtype)
            d = beta * (v - c.matvec(S, k))
            o = c.matvec(S + d[:, None] * k[None, :], q)
        c.store(o_ref.at[rows], o, vmask)
        c.store(dbuf_out.at[count, rows], d, c.both(vmask, append, (BV,)))  # the d rows are this program's

    c.replay_tiles(V, config, split, tile)
    if config.fused_flush:

        @pl.when(count >= L - 1)
        def _():
            _flush_row(ck_ref, dbuf_ref, kbuf_ref, gbuf_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, ck_out,
                       cursor=count, split=split, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       config=c.fused_flush_config(config))

    # The shared records: g by the first program of the head, k by the first
    # value head of the group, so no element has two writers.
    first = split == 0
    c.store(gbuf_out, jnp.broadcast_to(c.load_scalar(g_ref), (BL,)), (c.lane_ids(BL) == count) & append & first)
    leader = first & (pl.program_id(1) % group == 0)
    c.store(kbuf_out.at[count], k, c.both(kmask, append & leader, (BK,)))  # k normalized, not scaled
    if config.fused_flush:  # one launch: the cursor moves in place
        c.advance_cursor(cur_out, count, c.next_cursor(count, L), programs)
    else:  # the flush launch reads the old cursors: a fresh array
        c.store_cursor(cur_out, count, L, first & (pl.program_id(1) == 0))


def _flush_kernel(*refs, V, K, L, scale, use_qk_l2norm, config):
    """The flush launch: a program holds one row tile of one head for a block of batch rows."""
    split = pl.program_id(2)  # read here: interpret mode cannot read it inside a branch
    c.flush_rows_of_program(refs, L, functools.partial(
        _flush_row, split=split, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm, config=config))


def _flush_row(
    ck_ref, dbuf_ref, kbuf_ref, gbuf_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, ck_out,
    *, cursor, split, V, K, L, scale, use_qk_l2norm, config,
):
    """Write S after this step into the checkpoint of one flushing row (refs:
    the row's blocks; cursor at entry L - 1 or L): its `cursor` buffered
    records, then this step, S <- exp(g) S + d k^T with d from the
    materialized S, its d and k rounded to the buffers' dtypes when the step
    has a slot (cursor < L), as the buffer holds them. Slot `cursor` is
    never read: the fused flush runs in the launch that writes it."""
    BK, BV = q_ref.shape[-1], config.block_v
    kmask, _, k = _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale)
    append = cursor < L
    k_rec = jnp.where(append, k.astype(kbuf_ref.dtype).astype(f32), k)
    decay = jnp.exp(c.load_scalar(g_ref))
    beta = c.load_scalar(beta_ref)

    def tile(rows, vmask):
        tmask = c.outer(vmask, kmask, (BV, BK))

        def record(i):
            return gbuf_ref[i], c.load(dbuf_ref.at[i, rows], vmask), c.load(kbuf_ref.at[i], kmask)

        def records(live):
            return (c.load_live(gbuf_ref, live, L), c.load_live(dbuf_ref.at[:, rows], live, L, vmask),
                    c.load_live(kbuf_ref, live, L, kmask, kbuf_ref.dtype))

        S = decay * c.replay_records(c.load(ck_ref.at[rows, :], tmask), cursor, L, record, records, ck_ref.dtype)
        d = beta * (c.load(v_ref.at[rows], vmask) - c.matvec(S, k))
        d_rec = jnp.where(append, d.astype(dbuf_ref.dtype).astype(f32), d)
        c.store(ck_out.at[rows, :], S + d_rec[:, None] * k_rec[None, :], tmask)

    c.replay_tiles(V, config, split, tile)


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
def gdn_step(state, q, k, v, g, beta, replay=None, *, scale: float, use_qk_l2norm: bool, config: Config | None = None,
             interpret: bool = False):
    """One standard GDN decode step; the state is updated in place.

    Args: state f32|bf16[batch, HV, V, K]; q, k [batch, H, K]; v [batch, HV, V];
    g f32[batch, HV] (log decay <= 0); beta [batch, HV]; scale: float;
    replay: None, or the replay step's direct route: the buffers (d
    [batch, HV, L, V], k [batch, H, L, K], g f32[batch, HV, L]) and cursor
    i32[batch] of a replay state whose checkpoint is `state`. Each row's
    live records are then folded into the checkpoint before the step, and
    the cursor is set to 0 in place.

    Returns: (o [batch, HV, V] in v.dtype, new_state like state, new cursor
    or None).
    """
    batch, HV, V, K = state.shape
    H = q.shape[1]
    cfg = config or c.default_config(batch, HV, V, K, state.dtype.itemsize)
    grid, sspec, qk, vrow, scal = _specs(batch, H, HV, V, K, cfg)
    kernel = functools.partial(_step_kernel, V=V, K=K, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return c.step_launch(
        kernel, "gdn", grid=grid, in_specs=[sspec, qk, qk, vrow, scal, scal], out_specs=[vrow, sspec],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        operands=(state, q, k, v, g.astype(f32), beta), config=cfg, interpret=interpret, replay=replay,
        buffer_specs=lambda L: _buffer_specs(H, HV, K, L, cfg.block_v))


def _buffer_specs(H, HV, K, L, R, nb=None):
    """Block specs of the buffers (d, k, g): R value rows and nb batch rows (None: one, squeezed)."""
    BK, BL, group = c.next_pow2(K), c.next_pow2(L), HV // H
    return [pl.BlockSpec((nb, None, BL, R), lambda b, h, j: (b, h, 0, j)),
            pl.BlockSpec((nb, None, BL, BK), lambda b, h, j: (b, h // group, 0, 0)),
            pl.BlockSpec((nb, None, BL), lambda b, h, j: (b, h, 0))]


@functools.partial(jax.jit, static_argnames=("L", "scale", "use_qk_l2norm", "route", "config", "interpret"))
def gdn_replay_step(checkpoint, dbuf, kbuf, gbuf, cursor, q, k, v, g, beta, *, L: int, scale: float,
                    use_qk_l2norm: bool, route: str, config: Config | None = None, interpret: bool = False):
    """One ReplaySSM GDN decode step on the raw state arrays (in place).

    Args: checkpoint f32|bf16[batch, HV, V, K]; dbuf [batch, HV, L, V];
    kbuf [batch, H, L, K]; gbuf f32[batch, HV, L]; cursor i32[batch] in 0..L;
    q, k [batch, H, K]; v [batch, HV, V]; g f32[batch, HV]; beta [batch, HV].

    Returns: (o [batch, HV, V] in v.dtype, checkpoint, dbuf, kbuf, gbuf,
    new cursor); checkpoint and buffers are updated in place (aliased). A
    row flushes (writes checkpoint = S after this step, cursor 0) when its
    cursor reaches L with this step or entered at L.
    """
    batch, HV, V, K = checkpoint.shape
    H = q.shape[1]
    cfg = config or c.default_config(batch, HV, V, K, checkpoint.dtype.itemsize, replay_len=L)
    group = HV // H

    def specs(cfg, nb=None):
        """(grid, in_specs, out_specs) for programs of cfg.tiles row tiles and
        nb batch rows (None: one row, the batch axis squeezed)."""
        BK, R = c.next_pow2(K), cfg.block_v * cfg.tiles
        state = pl.BlockSpec((nb, None, R, BK), lambda b, h, j: (b, h, j, 0))
        qk = pl.BlockSpec((nb, None, BK), lambda b, h, j: (b, h // group, 0))
        vrow = pl.BlockSpec((nb, None, R), lambda b, h, j: (b, h, j))
        scal = pl.BlockSpec((nb, None), lambda b, h, j: (b, h))
        buffers, row = _buffer_specs(H, HV, K, L, R, nb), c.cursor_spec(nb)
        grid = (batch // (nb or 1), HV, cfg.splits(V))
        return grid, [state, *buffers, row, qk, qk, vrow, scal, scal], [vrow, state, *buffers, row]

    args = (checkpoint, dbuf, kbuf, gbuf, cursor, q, k, v, g.astype(f32), beta)
    grid, in_specs, out_specs = specs(cfg)
    kernel = functools.partial(_replay_kernel, V=V, K=K, L=L, group=group, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, route=route, config=cfg, programs=HV * grid[2])
    o, checkpoint, dbuf, kbuf, gbuf, new_cursor = c.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (v, checkpoint, dbuf, kbuf, gbuf, cursor)],
        input_output_aliases={0: 1, 1: 2, 2: 3, 3: 4, **({4: 5} if cfg.fused_flush else {})},
        interpret=interpret,
        config=cfg,
        name=f"gdn_replay_{route}_L{L}_{cfg.tag()}",
    )(*args)
    if not cfg.fused_flush:
        flush = functools.partial(_flush_kernel, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm)
        checkpoint = c.flush_launch(flush, specs, cfg, checkpoint, (dbuf, kbuf, gbuf, *args[4:]),
                                    interpret=interpret, name=f"gdn_replay_flush_L{L}")
    return o, checkpoint, dbuf, kbuf, gbuf, new_cursor
