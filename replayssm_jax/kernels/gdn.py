"""Pallas (Triton) decode kernels of the Gated DeltaNet layer.

Letters: batch, H key heads, HV value heads (value head h reads key head
h // (HV // H)), K key dim, V value dim, L buffer length. The state is
value-major, S f32 | bf16[batch, HV, V, K]. One decode step (ARCHITECTURE.md,
"The math", fla's fused_recurrent_gated_delta_rule with T = 1):

    S' = exp(g) S;  d = beta (v - S' k);  S_new = S' + d k^T;  o = S_new (scale q)

with q, k L2-normalized over K (eps 1e-6) when use_qk_l2norm.

Tiles: a program works on [block_v, K] tiles of one head's state (rows of
V, all K columns), so S k and S q are local row sums and no two programs
touch the same state element.

- :func:`gdn_step`: the standard step, grid (batch, HV, cdiv(V, block_v)),
  one tile per program; reads S, writes S in place (aliased). The replay
  step's direct route runs the same kernel with the row's buffered records
  and cursor: its live records are folded into its checkpoint tile first,
  and the cursor is set to 0 in place.
- :func:`gdn_conv_step`: the standard step with the layer's short conv
  fused, one launch on the standard step's grid: each program forms its
  key head's q and k and its own v rows from the packed conv input and
  the conv's ring (`conv.conv_channels`), steps its tile, and writes its
  part of the ring's new column last (`_conv_loaders`).
- :func:`gdn_replay_step` on the output, state, append and deferred routes:
  the replay kernel, grid (batch, HV, splits): a program forms the per-head
  terms once (decay weights of the live slots, the buffered keys' scores
  against k and q), then loops over its row tiles; one read of each checkpoint
  tile gives both exp(g) S_{j-1} k_j (for d_j) and S_j q_j through the
  buffered records, without forming S; the new record (d_j, k_j, g_j) goes
  to the row's cursor. The flush materializes S_j of each row whose buffer
  is now full (its buffered records applied to its checkpoint tile, then
  this step) and writes it in place, fused into the replay kernel or as a
  second launch (:func:`replayssm_jax.kernels.launch.replay_launch`).
  `route="state"` makes the replay kernel form S_{j-1} in every step and
  read o from S_j instead; `route="append"` runs the output route's kernel
  alone (no flush; the cursor moved by an XLA op after it), and
  `route="deferred"` runs it after the flush launch of the rows that entered
  full (`launch.flush_full_launch`). With a TMAReadoutConfig the append
  and deferred routes are instead two launches: a Triton prelude, grid
  (batch, H), that forms the per-head terms and writes the shared records
  and the cursors at entry (`_head_terms`), and the Mosaic GPU readout
  (`tma_readout.gdn_append_tma`), which on the deferred route flushes the
  rows that entered full itself; one of the two moves the cursor
  (`tma_readout.readout_moves_cursor`); the direct route likewise, the prelude on
  route "direct" (the dead slots' keys zeroed in rows with live records, no
  other record written, the cursor set to 0) and the Mosaic GPU step
  (`tma_step.gdn_direct_tma`).
- :func:`gdn_replay_verify`: a verify window of W steps. The rows whose
  window does not fit behind the cursor flush their buffered records first
  (the flush launch); then the verify kernel, grid (batch, HV, splits),
  reads each checkpoint tile once, applies the row's live records to it in
  registers (S_0, as the flush does), runs the W steps of the window on
  that tile and writes the W outputs and the W records at the cursor; the
  checkpoint is not written. With a draft tree (tree speculation, a static
  `tree`), the same kernel walks the tree's nodes in node order
  (`launch.walk_tree`): a node whose parent is the node before it continues
  from the state just computed, any other restarts from S_0 along its path.
- :func:`gdn_verify`: the per-draft standard verify (the standard-state
  baseline of speculative decoding) on a slotted state [batch, slots, HV,
  V, K]: grid (batch, HV, cdiv(V, block_v)) as the standard step; a program
  reads its tile of the row's current slot once, runs the W steps of the
  window (or tree) on it with the verify kernel's step (`_window_steps`),
  and writes each step's state tile to its own slot and its output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import (NO_FLUSH_ROUTES, ReplayConfig, StepConfig, next_pow2, num_sms,
                                          per_draft_config_for, replay_config_for, step_config_for, verify_config_for)
from replayssm_jax.kernels.conv import ACTIVATIONS, conv_channels
from replayssm_jax.kernels.cursor import advance_cursor, live_count, read_cursor
from replayssm_jax.kernels.launch import (BlockSpecs, batch_shaped, flush_full_launch, head_work_warps,
                                          per_draft_launch, pool_of, replay_launch, replay_step,
                                          run_replay_program, run_verify_program,
                                          run_window, step_launch, tree_option, triton_params, verify_launch,
                                          verify_window, window_start)
from replayssm_jax.kernels.replay_math import (fold_live_records, rank_update, replay_records, replay_weights,
                                               softplus)
from replayssm_jax.kernels.tiles import (f32, fma, for_each_row_tile, lane_ids, lane_mask, load, load_checkpoint,
                                         load_live, load_live_only, load_scalar, mask_and, matvec, pick_row,
                                         program_id, row_ids, row_mask, stochastic, store, store_checkpoint,
                                         tile_mask, tile_row_ids)
from replayssm_jax.kernels.tma_readout import (TERMS, TMA_MAX, TMAReadoutConfig, check_tma_readout,
                                               check_tma_route, cursor_rows, default_tma_readout, gdn_append_tma,
                                               readout_moves_cursor)
from replayssm_jax.kernels.tma_step import (STEP_TERMS, check_direct_tma, check_step_tma, default_direct_tma,
                                            gdn_direct_tma, gdn_step_tma)
from replayssm_jax.state import GDNReplayState

# The state's rows and columns, as the size errors name them.
DIMS = (("value dim", "V"), ("key dim", "K"))


class Inputs(NamedTuple):
    """A step's inputs (arrays, their block specs, or their refs in a kernel):
    q, k [batch, H, K]; v [batch, HV, V]; the gates g f32[batch, HV] (log
    decay <= 0) and beta [batch, HV], A_log and dt_bias None; or, with
    A_log and dt_bias [HV] given, the raw projections in their places (g
    holds a, beta holds b), from which the kernels form the gates (`_gates`)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    A_log: Any = None
    dt_bias: Any = None


# The inputs without a batch axis (the layer's parameters of the raw gates).
PER_HEAD = ("A_log", "dt_bias")


def _inputs(q, k, v, g, beta, a, b, A_log, dt_bias) -> Inputs:
    """The Inputs of a kernel op's validated arguments: q, k, v and either g and beta (A_log None) or the
    raw a, b, A_log and dt_bias."""
    return Inputs(q, k, v, g, beta) if A_log is None else Inputs(q, k, v, a, b, A_log, dt_bias)


def raw_log_decay(a, A_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias), f32 operands of any matching shapes, in a kernel or in XLA."""
    return -jnp.exp(A_log) * softplus(a + dt_bias)


def raw_gates(a, b, A_log, dt_bias):
    """(g, beta) f32 from the raw projections, in a kernel or in XLA: `raw_log_decay` and beta = sigmoid(b)
    (`reference.gdn_gates`; f32 operands of any matching shapes)."""
    return raw_log_decay(a, A_log, dt_bias), 1.0 / (1.0 + jnp.exp(-b))


def _gates(inputs: Inputs, at=()):
    """(g, beta) f32: inputs.g and inputs.beta at index `at` of their blocks (() a 0-d block or whole
    loaded vectors, t a window step), or formed from the raw a and b there and A_log and dt_bias."""
    g, beta = inputs.g[at].astype(f32), inputs.beta[at].astype(f32)
    if inputs.A_log is None:
        return g, beta
    return raw_gates(g, beta, inputs.A_log[()].astype(f32), inputs.dt_bias[()].astype(f32))


def _gate_vectors(inputs: Inputs, heads) -> Inputs:
    """The gate fields of a prelude's row blocks ([BH] each: g and beta, or a, b, A_log and dt_bias) loaded
    as f32 vectors where `heads` (bool[BH]), zeros elsewhere; the other fields None."""
    fields = (inputs.g, inputs.beta, inputs.A_log, inputs.dt_bias)
    return Inputs(None, None, None, *(None if f is None else load(f, heads) for f in fields))


def _window_log_decays(inputs: Inputs, wmask):
    """f32[BW]: the log decays of a verify window's steps (lanes outside wmask unspecified)."""
    g = load(inputs.g, wmask)
    if inputs.A_log is None:
        return g
    return raw_log_decay(g, load_scalar(inputs.A_log), load_scalar(inputs.dt_bias))


class Records(NamedTuple):
    """The buffered records of a GDNReplayState (fields named as its own):
    d [batch, HV, L, V] (delta-rule update vectors), k [batch, H, L, K]
    (normalized keys), g f32[batch, HV, L]."""

    d: Any
    k: Any
    g: Any


class ConvOperands(NamedTuple):
    """The fused conv's operands of the standard step (arrays, block specs or refs in a kernel): the ring
    columns [batch, S, C] (`layers.cache.ConvWindow.columns`, written in place; a program's block is its
    row's whole ring), start i32[batch] (its oldest live slot), and the conv weight [C, W] three times, as
    the blocks of the program's q, k and v channels (wq, wk, wv; one array)."""

    columns: Any
    start: Any
    wq: Any
    wk: Any
    wv: Any


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis (a vector [BK] or each row of [BW, BK]); padded lanes must
    be zero."""
    if x.ndim == 1:
        return x * jax.lax.rsqrt(jnp.sum(x * x) + eps)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _normalized(q, k, use_qk_l2norm, scale):
    """(scale * q, k) of f32 q and k, L2-normalized (each row of a window's tiles) if use_qk_l2norm."""
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    return q * scale, k


def _load_head_vectors(q_ref, k_ref, K, use_qk_l2norm, scale, wmask=None):
    """(kmask, scale * q, k) in f32, L2-normalized if use_qk_l2norm. With
    `wmask` (bool[BW] or None), a verify window's [BW, BK] tiles, each row
    normalized."""
    BK = q_ref.shape[-1]
    kmask = lane_mask(BK, K)
    mask = kmask if len(q_ref.shape) == 1 else tile_mask(wmask, kmask, tuple(q_ref.shape))
    return kmask, *_normalized(load(q_ref, mask), load(k_ref, mask), use_qk_l2norm, scale)


def _step_kernel(state_ref, inputs: Inputs, records: Records | None, cursor_ref, o_ref, state_out_ref, cursor_out_ref,
                 *, V, K, L, scale, use_qk_l2norm, dot_fold, programs, conv=None):
    """The standard step on one state tile. Given the row's records and cursor
    (not None), the replay step's direct route: the live records are first
    folded into the checkpoint tile (one at a time, or with dot_fold all L
    slots as one rank-L update), and the cursor is set to 0 in place. conv:
    None (q, k and v loaded from their refs), or the fused conv's
    `_ConvLoaders` (formed from the packed inputs and the ring, after the
    state tile's load, which waits on nothing where the conv's loads wait
    on the ring's start; the ring written last)."""
    direct = records is not None
    if direct:
        count = read_cursor(cursor_ref)  # first: the fold's trip count waits on it
    BV, BK = state_ref.shape
    vmask = row_mask(BV, V)
    if conv is None:
        kmask, q, k = _load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
        tmask = tile_mask(vmask, kmask, (BV, BK))
        S = load_checkpoint(state_ref, None, tmask, vmask)
    else:
        kmask = lane_mask(BK, K)
        tmask = tile_mask(vmask, kmask, (BV, BK))
        S = load_checkpoint(state_ref, None, tmask, vmask)
        q, k = _normalized(*conv.qk(kmask), use_qk_l2norm, scale)
    ids = row_ids(state_ref.shape[0]) if stochastic(state_ref) else None  # the rows' global ids (stochastic rounding)
    g, beta = _gates(inputs)
    decay, v = jnp.exp(g), load(inputs.v, vmask) if conv is None else conv.v(vmask)

    def finish(S):
        S = S * decay
        d = beta * (v - matvec(S, k))
        # One rounding (`fma`) on an f32 state: 0.9-1.0% less kernel time (H100, H200); on a bf16 state 9-11% more
        # on the H100, the same on the H200 (2026-12-05).
        S = fma(d[:, None], k[None, :], S) if state_ref.dtype == f32 else S + d[:, None] * k[None, :]
        store(o_ref, matvec(S, q), vmask)
        store_checkpoint(state_ref, state_out_ref, None, S, tmask, vmask, ids, K)

    if not direct:
        finish(S)
    else:
        record, whole = _record_loaders(records, pl.ds(0, BV), vmask, kmask, L)
        fold_live_records(S, count, record, finish, whole if dot_fold else None, L, state_ref.dtype)
        advance_cursor(cursor_out_ref, count, jnp.int32(0), programs)
    if conv is not None:
        conv.write_ring()


class _ConvLoaders(NamedTuple):
    """The fused conv in a step program: qk(kmask) -> the key head's raw (q, k) and v(vmask) -> the program's
    v rows, f32, each formed from the packed inputs and the ring; write_ring() then stores their inputs into
    the ring's new column (a store before the state tile's load would hold that load back: no alias
    information lets the compiler move a load above a store)."""

    qk: Callable
    v: Callable
    write_ring: Callable


def _conv_loaders(inputs: Inputs, ring: ConvOperands, ring_out, *, H, K, V, group, W, activation,
                  whole_ring) -> _ConvLoaders:
    """The `_ConvLoaders` of a program (batch row, value head h, row tile j) whose inputs.q, .k and .v are
    blocks of the packed conv input [batch, C] (C = 2 H K + HV V, channels [q; k; v]) and ring its
    row's: the conv reads ring slots start .. start + W - 2 (mod S) of the program's channels and writes x
    at slot start + W - 1, q's and k's by one program of the key head (h % group == 0, j == 0). y is
    rounded to the inputs' dtype, as the conv's own launch stores it. whole_ring: load the ring's S slots
    at once rather than the live ones at start (`conv.conv_channels`)."""
    S = ring.columns.shape[0]
    h, j = program_id(1), program_id(2)
    start = ring.start[0]
    slot = (start + W - 1) % S
    writes = []  # the ring's new column, stored by write_ring

    def conv(x_ref, taps_ref, first, mask, owns):
        n = x_ref.shape[-1]
        x, y = conv_channels(x_ref, lambda at: ring.columns.at[at, pl.ds(first, n)], taps_ref, None, start, W=W,
                             S=S, activation=activation, mask=mask, tap_columns=True, whole_ring=whole_ring)
        writes.append((owns, functools.partial(store, ring_out.at[slot, pl.ds(first, n)], x, mask)))
        return y.astype(x_ref.dtype).astype(f32)

    def write_ring():
        for owns, write in writes:
            pl.when(owns)(write)

    def qk(kmask):
        first, head = (h % group == 0) & (j == 0), h // group
        return (conv(inputs.q, ring.wq, head * K, kmask, first),
                conv(inputs.k, ring.wk, (H + head) * K, kmask, first))

    def v(vmask):
        BV = inputs.v.shape[-1]
        return conv(inputs.v, ring.wv, 2 * H * K + h * V + j * BV, vmask, True)

    return _ConvLoaders(qk, v, write_ring)


def _conv_step_kernel(state_ref, inputs: Inputs, records, cursor_ref, ring: ConvOperands, o_ref, state_out_ref,
                      cursor_out_ref, ring_out, *, H, group, W, activation, whole_ring, **step):
    """The standard step (`_step_kernel`, its keywords `step`) with the conv fused (`_conv_loaders`)."""
    conv = _conv_loaders(inputs, ring, ring_out, H=H, K=step["K"], V=step["V"], group=group, W=W,
                         activation=activation, whole_ring=whole_ring)
    _step_kernel(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, conv=conv, **step)


def _replay_kernel(checkpoint_ref, records: Records, cursor_ref, inputs: Inputs, o_ref, checkpoint_out,
                   records_out: Records, cursor_out, *, V, K, L, group, scale, use_qk_l2norm, route, config, programs):
    """The replay kernel (output, state, append and deferred routes) on a program's row tiles of one head and
    batch row."""
    BL, BK, BV = records.g.shape[0], inputs.q.shape[-1], config.block_v
    kmask, q, k = _load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    count = live_count(read_cursor(cursor_ref), L, route)  # live records; the new one goes to slot `count`
    split = program_id(2)
    live = lane_ids(BL) < count  # dead slots are zeroed (a rejected draft may have left inf there)

    # Per-head work, once per program: the decay weights of the live slots
    # and the buffered keys' scores against this step's k and q.
    total, w = replay_weights(load_live(records.g, live, L), count)
    Kb = load_live(records.k, live, L, kmask, records.k.dtype)  # as buffered (the rank update's keys)
    a_k = w * jnp.sum(Kb * k[None, :], axis=1)
    a_q = w * jnp.sum(Kb * q[None, :], axis=1)
    kq = jnp.sum(k * q)
    g, beta = _gates(inputs)
    decay = jnp.exp(g)
    carried = jnp.exp(total)  # decay of the checkpoint up to the last live slot
    append = count < L  # a row that entered full has no free slot (the flush absorbs this step)

    def tile(rows, vmask):
        tmask = tile_mask(vmask, kmask, (BV, BK))
        S_c = load_checkpoint(checkpoint_ref, rows, tmask, vmask)  # the one read of the checkpoint
        U = load_live(records.d.at[:, rows], live, L, vmask)
        v = load(inputs.v.at[rows], vmask)
        if route != "state":
            # exp(g) S_{j-1} k and exp(g) S_{j-1} q without forming S_{j-1}.
            Sk = decay * (carried * matvec(S_c, k) + jnp.sum(a_k[:, None] * U, axis=0))
            d = beta * (v - Sk)
            o = decay * (carried * matvec(S_c, q) + jnp.sum(a_q[:, None] * U, axis=0)) + kq * d
        else:
            S = decay * rank_update(carried * S_c, w[:, None] * U, Kb, checkpoint_ref.dtype)
            d = beta * (v - matvec(S, k))
            o = matvec(S + d[:, None] * k[None, :], q)
        if route == "append":  # a row that entered full cannot take the step: NaN, its state unchanged
            o = jnp.where(append, o, jnp.nan)
        store(o_ref.at[rows], o, vmask)
        store(records_out.d.at[count, rows], d, mask_and(vmask, append, (BV,)))  # the d rows are this program's

    flush_row = functools.partial(_flush_row, checkpoint_ref, records, inputs, checkpoint_out, cursor=count,
                                  split=split, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm)
    # The shared records: the step's g, and its k normalized, not scaled.
    run_replay_program(tile, flush_row, V=V, L=L, config=config, split=split, count=count, append=append,
                       group=group, decay_record=lambda: g, decay_out=records_out.g, key=k,
                       key_out=records_out.k, key_mask=kmask, cursor_out=cursor_out, programs=programs,
                       flush=route not in NO_FLUSH_ROUTES)


def _flush_terms(lg, terms_ref, hv, L: int) -> None:
    """A full row's flush terms in the deferred prelude's terms tile of value head hv (terms_ref f32[BH,
    TERMS, BL]): row 3 the decay weights of the L slots of lg (f32[BL], the head's log decay records),
    row 2's lane 4 exp of their sum. Only the rows that flush run this: the other rows' programs neither
    load their g records' dead slots nor form these terms. (Qwen3.5-4B's layer at batch 256, staggered
    cursors, H200, 2026-12-03: 14.0 us a launch, against 14.5 with the terms formed in every program and
    12.7 with none formed.)"""
    BL = lg.shape[0]
    total, w = replay_weights(lg, L)
    store(terms_ref.at[hv, jnp.int32(3)], w, lane_mask(BL, L))
    store(terms_ref.at[hv, jnp.int32(2)], jnp.broadcast_to(jnp.exp(total), (BL,)), lane_ids(BL) == 4)


def _terms_kernel(records: Records, cursor_ref, inputs: Inputs, qn_ref, kn_ref, terms_ref, entry_ref,
                  records_out: Records, cursor_out, *stash, K, L, group, scale, use_qk_l2norm, programs, route,
                  move_cursor=True):
    """The prelude of a Mosaic GPU step on one (batch row, key head): q and k normalized, the per-head
    terms of the key head's `group` value heads, from the row's head 0 its cursor at entry (for the
    Mosaic GPU kernel), and the cursor moved in place once the row's H programs have read it
    (`advance_cursor`). route "append" (`tma_readout.head_terms`): terms a_k, a_q, then exp of the
    live log decays' sum, k . q, exp(g), beta; the shared records (k, g) at the cursor where the row
    has a free slot; the cursor to min(cursor + 1, L). route "deferred": the same, a full row read as
    empty (`cursor.live_count`: the readout flushes it first), so its records go to slot 0 and its
    cursor to 1; for a full row also its flush terms (terms row 3 the L slots' decay weights, the
    scalars' lane 4 exp of their log decays' sum; zeros for other rows) and its k record of slot 0
    before this step overwrites it, in `stash` ([BK] in the k records' dtype; unwritten for other
    rows); the entry is the cursor, not the live count. route "direct" (`tma_step.direct_terms`):
    terms w (the live slots' decay weights), zeros, then the same scalars; in a row with live records
    the dead slots' k records zeroed (`tma_step.clear_dead_keys`: the step's fold on the tensor cores
    reads every slot's key), no other record written; the cursor to 0. route "standard" (the standard
    step; `tma_step.step_terms`): no records or cursor (their refs None), terms zeros, zeros, then the
    scalars (exp(0) = 1 for the carried decay).
    move_cursor False: the cursor is left as it was (the readout moves it from the entry cursors,
    `tma_readout.readout_moves_cursor`).

    Refs (BL, BK, BH: L, K, HV up to powers of two): records.k [BL, BK]
    (the key head's) and records.g f32[BH, BL] (the row's), cursor_ref
    i32[1]; inputs.q, inputs.k [BK], inputs.g f32[BH], inputs.beta [BH];
    qn_ref, kn_ref f32[BK]; terms_ref f32[BH, TERMS, BL]; entry_ref i32[1];
    records_out and cursor_out the aliased records and cursor, as above.
    Padded lanes are neither read nor written."""
    h = program_id(1)
    append, standard, deferred = route in NO_FLUSH_ROUTES, route == "standard", route == "deferred"
    kmask, q, k = _load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
    cursor = jnp.int32(0) if standard else read_cursor(cursor_ref)
    count = live_count(cursor, L, route)
    BH, BL = terms_ref.shape[0], terms_ref.shape[-1]
    lanes, lmask = lane_ids(BL), lane_mask(BL, L)
    live = lanes < count
    kq = jnp.sum(k * q)
    free = count < L  # a row that entered full writes no record
    full = cursor >= L  # (deferred) a row the readout flushes first
    # What the value heads' loop reads, loaded before the first store (a store may alias a later load):
    # their gates and log decay records, the live ones (a full row's all L on the deferred route).
    mine = lane_ids(BH) // group == h  # the key head's value heads
    gates = _gates(_gate_vectors(inputs, mine))
    loaded = lanes < jnp.where(full, L, count) if deferred else live
    decays = None if standard else load(records.g, tile_mask(mine, loaded, (BH, BL)))
    store(qn_ref, q, kmask)
    store(kn_ref, k, kmask)
    if deferred:  # the full row's slot-0 key, read before this step's record replaces it
        kept = mask_and(kmask, full, k.shape)
        store(stash[0], load(records.k.at[jnp.int32(0)], kept), kept)
    if route == "direct":  # the step's fold reads every slot's key on the tensor cores: a dead one (maybe inf) zeroed
        dead = mask_and(lmask, (lanes >= count) & (count > 0), (BL,))
        shape = (BL, k.shape[0])
        store(records_out.k, jnp.zeros(shape, records_out.k.dtype), tile_mask(dead, kmask, shape))
    if append:
        keys = load_live_only(records.k, live, kmask)  # dead slots not read (bench/RESULTS.md, 2026-12-03)
        score_k, score_q = jnp.sum(keys * k[None, :], axis=1), jnp.sum(keys * q[None, :], axis=1)
        store(records_out.k.at[count], k, mask_and(kmask, free, k.shape))
    for j in range(group):  # the key head's value heads
        hv = h * group + j
        g, beta = (pick_row(x, hv) for x in gates)
        if standard:
            total, w = jnp.float32(0.0), jnp.zeros((BL,), f32)
        else:
            lg = pick_row(decays, hv)
            total, w = replay_weights(lg, count)
        scalars = jnp.where(lanes == 0, jnp.exp(total), jnp.where(lanes == 1, kq, jnp.where(
            lanes == 2, jnp.exp(g), jnp.where(lanes == 3, beta, 0.0))))
        first, second = (w * score_k, w * score_q) if append else (w, jnp.zeros_like(w))
        rows = lane_ids(TERMS)[:, None]  # the terms' rows: a_k or w, a_q or 0, the scalars, flush weights
        tile = jnp.where(rows == 0, first[None, :], jnp.where(rows == 1, second[None, :], jnp.where(
            rows == 2, scalars[None, :], 0.0)))
        mask = tile_mask(None, lmask, (TERMS, BL))
        if deferred:  # a full row's flush terms are stored apart (`_flush_terms`), the rest as above
            mask = mask_and(mask, ~full | ((rows < 2) | ((rows == 2) & (lanes[None, :] != 4))), (TERMS, BL))
            pl.when(full)(functools.partial(_flush_terms, lg, terms_ref, hv, L))
        store(terms_ref.at[hv], tile, mask)
        if append:
            store(records_out.g.at[hv], jnp.broadcast_to(g, (BL,)), (lanes == count) & free)

    if standard:
        return

    @pl.when(h == 0)
    def _():
        entry_ref[0] = cursor if deferred else count

    if move_cursor:
        advance_cursor(cursor_out, cursor, jnp.minimum(count + 1, L) if append else jnp.int32(0), programs)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "route", "move_cursor"))
def _head_terms(records: Records, cursor, inputs: Inputs, *, scale: float, use_qk_l2norm: bool, interpret: bool,
                route: str = "append", move_cursor: bool = True):
    """The prelude of a Mosaic GPU step (route "append" or "deferred": the readout; "direct": the direct
    step), one Triton launch, grid (batch, H).

    Takes the state's records (d [batch, HV, L, V], not read; k [batch, H,
    L, K]; g f32[batch, HV, L]), its cursor i32[batch] and the step's
    inputs (q, k [batch, H, K]; v, not read; g f32[batch, HV]; beta
    [batch, HV]), validated; scale and use_qk_l2norm as :func:`gdn_step`.

    Returns (qn, kn f32[batch, H, K], terms f32[batch, HV, TERMS, L], entry
    i32[rows * TMA_MAX] (each row's cursor at entry, then unwritten
    padding), k and g records (written in place on the append and deferred
    routes; on the direct one the dead slots' k records zeroed in a row
    with live records, `tma_step.clear_dead_keys`) and the cursor after the step
    (moved in place)), and on the deferred route a last output, each full
    row's k record of slot 0 before the step, [batch, H, K] in the k records'
    dtype (other rows unwritten); there the terms are those of a full row read as empty, with
    its flush terms (`tma_readout.head_terms`). move_cursor False (append and
    deferred routes): the cursor is returned as it entered, in place, for
    the readout to move (`tma_readout.readout_moves_cursor`). The pure-JAX form is
    `tma_readout.head_terms` and `tma_readout.append_shared_records` (append,
    deferred), `tma_step.direct_terms` (direct)."""
    if not move_cursor and route not in NO_FLUSH_ROUTES:
        raise ValueError(f"the prelude leaves the cursor to the readout on routes {NO_FLUSH_ROUTES} only; got "
                         f"move_cursor=False on route {route!r}")
    batch, H, K = inputs.q.shape
    HV, L = inputs.v.shape[1], records.d.shape[2]
    BK, BL, BH = next_pow2(K), next_pow2(L), next_pow2(HV)
    head = pl.BlockSpec((None, None, BK), lambda b, h: (b, h, 0))
    row = pl.BlockSpec((1,), lambda b, h: (b,))
    g_spec = pl.BlockSpec((None, BH, BL), lambda b, h: (b, 0, 0))
    k_spec = pl.BlockSpec((None, None, BL, BK), lambda b, h: (b, h, 0, 0))
    kernel = functools.partial(_terms_kernel, K=K, L=L, group=HV // H, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               programs=H, route=route, move_cursor=move_cursor)
    stash = route == "deferred"  # a full row's slot-0 k record, for the readout's flush
    k_shape = jax.ShapeDtypeStruct(records.k.shape, records.k.dtype)
    out_shape = (jax.ShapeDtypeStruct((batch, H, K), f32), jax.ShapeDtypeStruct((batch, H, K), f32),
                 jax.ShapeDtypeStruct((batch, HV, TERMS, L), f32),
                 jax.ShapeDtypeStruct((cursor_rows(batch) * TMA_MAX,), jnp.int32),
                 Records(d=None, k=k_shape, g=jax.ShapeDtypeStruct(records.g.shape, f32)),
                 jax.ShapeDtypeStruct((batch,), jnp.int32)) + ((k_shape.update(shape=(batch, H, K)),) * stash)
    return pl.pallas_call(
        kernel, grid=(batch, H), interpret=interpret, name=f"gdn_{route}_terms_L{L}",
        compiler_params=triton_params(head_work_warps(BL * BK)),
        in_specs=(Records(d=None, k=k_spec, g=g_spec), row, _heads_specs(BH, inputs)),
        out_specs=(head, head, pl.BlockSpec((None, BH, TERMS, BL), lambda b, h: (b, 0, 0, 0)), row,
                   Records(d=None, k=k_spec, g=g_spec), row) + ((head,) * stash),
        out_shape=out_shape, input_output_aliases={0: 4, 1: 5, 2: 6},
    )(records._replace(d=None), cursor, inputs._replace(v=None))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret"))
def _step_terms(inputs: Inputs, *, scale: float, use_qk_l2norm: bool, interpret: bool):
    """The prelude of the standard step on Mosaic GPU (`_terms_kernel` on route "standard"), one Triton
    launch, grid (batch, H): takes the step's inputs (q, k [batch, H, K], v [batch, HV, V], not read, g
    f32[batch, HV], beta [batch, HV]) and returns (qn, kn f32[batch, H, K], terms f32[batch, HV, TERMS,
    STEP_TERMS]); the pure-JAX form is `tma_step.step_terms`."""
    batch, H, K = inputs.q.shape
    HV = inputs.v.shape[1]
    BK, BH = next_pow2(K), next_pow2(HV)
    head = pl.BlockSpec((None, None, BK), lambda b, h: (b, h, 0))
    kernel = functools.partial(_terms_kernel, K=K, L=STEP_TERMS, group=HV // H, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, programs=H, route="standard")
    qn, kn, terms, *_ = pl.pallas_call(
        kernel, grid=(batch, H), interpret=interpret, name="gdn_step_terms",
        compiler_params=triton_params(head_work_warps(BK)),
        in_specs=(None, None, _heads_specs(BH, inputs)),
        out_specs=(head, head, pl.BlockSpec((None, BH, TERMS, STEP_TERMS), lambda b, h: (b, 0, 0, 0)), None, None,
                   None),
        out_shape=(jax.ShapeDtypeStruct((batch, H, K), f32), jax.ShapeDtypeStruct((batch, H, K), f32),
                   jax.ShapeDtypeStruct((batch, HV, TERMS, STEP_TERMS), f32), None, None, None),
    )(None, None, inputs._replace(v=None))
    return qn, kn, terms


def _record_loaders(records: Records, rows, vmask, kmask, L):
    """The loaders of `replay_records` for the state rows `rows` (a `pl.ds`):
    record(i) -> (g_i, d_i [BV], k_i [BK]) of slot i, and all_records(live)
    -> (g [BL], d [BL, BV], k [BL, BK] as buffered), dead slots zeroed."""

    def record(i):
        return records.g[i], load(records.d.at[i, rows], vmask), load(records.k.at[i], kmask)

    def all_records(live):
        return (load_live(records.g, live, L), load_live(records.d.at[:, rows], live, L, vmask),
                load_live(records.k, live, L, kmask, records.k.dtype))

    return record, all_records


def _materialize(checkpoint_ref, records: Records, count, rows, vmask, kmask, tmask, L):
    """f32[BV, BK]: the checkpoint tile of `rows` (its mask `tmask`) after the row's first `count`
    buffered records (`replay_records`)."""
    S_c = load_checkpoint(checkpoint_ref, rows, tmask, vmask)
    return replay_records(S_c, count, L, *_record_loaders(records, rows, vmask, kmask, L), checkpoint_ref.dtype)


def _flush_row(checkpoint_ref, records: Records, inputs: Inputs, checkpoint_out, *, cursor, split, config, V, K, L,
               scale, use_qk_l2norm, step=True):
    """Write S after this step into the checkpoint of one flushing row (refs:
    the row's blocks; cursor at entry L - 1 or L): its `cursor` buffered
    records, then this step, S <- exp(g) S + d k^T with d from the
    materialized S, its d and k rounded to the buffers' dtypes when the step
    has a slot (cursor < L), as the buffer holds them. Slot `cursor` is
    never read: the fused flush runs in the launch that writes it.
    step=False (a verify window's early flush): the buffered records only;
    `inputs` is not read."""
    BK, BV = records.k.shape[-1], config.block_v
    if step:
        kmask, _, k = _load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale)
        append = cursor < L
        k_rec = jnp.where(append, k.astype(records.k.dtype).astype(f32), k)
        g, beta = _gates(inputs)
        decay = jnp.exp(g)
    else:
        kmask = lane_mask(BK, K)

    def tile(rows, vmask):
        tmask = tile_mask(vmask, kmask, (BV, BK))
        S = _materialize(checkpoint_ref, records, cursor, rows, vmask, kmask, tmask, L)
        if step:
            S = decay * S
            d = beta * (load(inputs.v.at[rows], vmask) - matvec(S, k))
            d_rec = jnp.where(append, d.astype(records.d.dtype).astype(f32), d)
            S = S + d_rec[:, None] * k_rec[None, :]
        ids = tile_row_ids(config, split, rows) if stochastic(checkpoint_ref) else None
        store_checkpoint(checkpoint_ref, checkpoint_out, rows, S, tmask, vmask, ids, K)

    for_each_row_tile(V, config, split, tile)


def _window_steps(inputs: Inputs, o_ref, rows, vmask, S_0, keep, *, W, K, scale, use_qk_l2norm, tree=None) -> None:
    """The W steps of a verify window on the state tile S_0 f32[BV, BK] of `rows` (a `pl.ds`; vmask its
    rows' mask): step t (the gated delta rule) writes its output o_t [BV] to o_ref.at[t, rows], then calls
    keep(t, S_t, d_t), which stores what the launch keeps of it (the d record, or the state). A chain runs
    a loop; a draft tree (static, not a chain) its nodes in node order (`walk_tree`)."""

    def advance(t, S):  # S after step t, and the step's scaled q and d
        _, q, k = _load_head_vectors(inputs.q.at[t], inputs.k.at[t], K, use_qk_l2norm, scale)
        g, beta = _gates(inputs, t)
        S = jnp.exp(g) * S
        d = beta * (load(inputs.v.at[t, rows], vmask) - matvec(S, k))
        return S + d[:, None] * k[None, :], q, d

    def step(t, S):
        S, q, d = advance(t, S)
        store(o_ref.at[t, rows], matvec(S, q), vmask)
        keep(t, S, d)
        return S

    run_window(tree, W, S_0, step, lambda t, S: advance(t, S)[0])


def _verify_kernel(checkpoint_ref, records: Records, cursor_ref, inputs: Inputs, o_ref, records_out: Records, *, V,
                   K, L, W, group, scale, use_qk_l2norm, config, tree=None):
    """The verify kernel on a program's row tiles of one value head and batch
    row: each checkpoint tile read once and brought to the window's start
    in registers (its live records applied), then the W steps on it, each
    writing its output and its d record; the state is not written. With a
    draft tree (static, not a chain), the W nodes in node order on the
    tree's paths (`walk_tree`)."""
    BW = inputs.g.shape[0]
    wmask = lane_mask(BW, W)
    kmask, _, keys = _load_head_vectors(inputs.q, inputs.k, K, use_qk_l2norm, scale, wmask)  # the key records
    count = read_cursor(cursor_ref)
    start = window_start(count, L, W)  # the early flush emptied the rows whose window does not fit
    split = program_id(2)

    def tile(rows, vmask):
        def keep(t, S, d):
            store(records_out.d.at[start + t, rows], d, vmask)  # the d rows are this program's

        tmask = tile_mask(vmask, kmask, (config.block_v, inputs.q.shape[-1]))
        S_0 = _materialize(checkpoint_ref, records, start, rows, vmask, kmask, tmask, L)
        _window_steps(inputs, o_ref, rows, vmask, S_0, keep, W=W, K=K, scale=scale, use_qk_l2norm=use_qk_l2norm,
                      tree=tree)

    # The shared records: the window's g, and its k normalized, not scaled.
    run_verify_program(tile, V=V, W=W, config=config, split=split, start=start, group=group,
                       decay_window=_window_log_decays(inputs, wmask), decay_out=records_out.g, keys=keys,
                       key_out=records_out.k, key_mask=kmask)


def _per_draft_kernel(state_ref, index_ref, inputs: Inputs, o_ref, state_out_ref, *, V, K, W, slots, scale,
                      use_qk_l2norm, tree=None):
    """The per-draft verify on one state tile of one value head and batch row: the tile of the current
    state (slot index) read once, then the W steps on it (`_window_steps`), step t's state written to slot
    (index + 1 + t) mod slots."""
    BV, BK = state_ref.shape[1:]
    vmask = row_mask(BV, V)
    tmask = tile_mask(vmask, lane_mask(BK, K), (BV, BK))
    index = index_ref[0]
    S_0 = load(state_ref.at[index], tmask)

    def keep(t, S, d):
        store(state_out_ref.at[(index + 1 + t) % slots], S, tmask)

    _window_steps(inputs, o_ref, pl.ds(0, BV), vmask, S_0, keep, W=W, K=K, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, tree=tree)


def _block_specs(H, HV, K, L, raw, rows, nb=None, window=None) -> BlockSpecs:
    """Block specs of programs of `rows` state rows and nb batch rows (None:
    one, the batch axis squeezed); records None where L is None; A_log and
    dt_bias the head's (0-d) where `raw` (the raw gates), else None. window:
    BW, the block of a verify window's axis (after batch) on the inputs and
    the output; None: one step, no window axis."""
    BK, group = next_pow2(K), HV // H
    lead, at = ((nb,), ()) if window is None else ((nb, window), (0,))
    state = pl.BlockSpec((nb, None, rows, BK), lambda b, h, j: (b, h, j, 0))
    qk = pl.BlockSpec((*lead, None, BK), lambda b, h, j: (b, *at, h // group, 0))
    vrow = pl.BlockSpec((*lead, None, rows), lambda b, h, j: (b, *at, h, j))
    scal = pl.BlockSpec((*lead, None), lambda b, h, j: (b, *at, h))
    records = None
    if L is not None:
        BL = next_pow2(L)
        records = Records(d=pl.BlockSpec((nb, None, BL, rows), lambda b, h, j: (b, h, 0, j)),
                          k=pl.BlockSpec((nb, None, BL, BK), lambda b, h, j: (b, h // group, 0, 0)),
                          g=pl.BlockSpec((nb, None, BL), lambda b, h, j: (b, h, 0)))
    head = pl.BlockSpec((None,), lambda b, h, j: (h,)) if raw else None
    inputs = Inputs(q=qk, k=qk, v=vrow, g=scal, beta=scal, A_log=head, dt_bias=head)
    return BlockSpecs(state=state, inputs=inputs, out=vrow, records=records)


def _specs_of(H, HV, K, L, inputs: Inputs):
    """`_block_specs` of these shapes for `inputs` (raw gates or not), as the launches call it: (rows, nb,
    window) -> BlockSpecs."""
    return functools.partial(_block_specs, H, HV, K, L, inputs.A_log is not None)


def _f32_decay(inputs: Inputs) -> Inputs:
    """inputs with g in f32 (the raw a as given: the kernels form g)."""
    return inputs if inputs.A_log is not None else inputs._replace(g=inputs.g.astype(f32))


def _heads_specs(BH: int, inputs: Inputs) -> Inputs:
    """The prelude's (grid (batch, H)) input specs: q and k of the program's key head, the gates (or a and
    b) of all BH value heads of its row, A_log and dt_bias whole where given."""
    head = pl.BlockSpec((None, None, next_pow2(inputs.q.shape[-1])), lambda b, h: (b, h, 0))
    heads = pl.BlockSpec((None, BH), lambda b, h: (b, 0))
    params = pl.BlockSpec((BH,), lambda b, h: (0,)) if inputs.A_log is not None else None
    return Inputs(q=head, k=head, v=None, g=heads, beta=heads, A_log=params, dt_bias=params)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config", "interpret"))
def _step(state, inputs: Inputs, records: Records | None, cursor, slots=None, *, scale: float,
          use_qk_l2norm: bool, config: StepConfig, interpret: bool):
    """The standard step's launch; with records and cursor, the direct route's; over a state pool with
    `slots` (`launch.Pool`). Returns (o, state, cursor or None)."""
    H, HV, K = inputs.q.shape[1], state.shape[1], state.shape[3]
    L = None if records is None else records.d.shape[2]
    kernel = functools.partial(_step_kernel, V=state.shape[2], K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               dot_fold=config.dot_fold)
    return step_launch("gdn", kernel, _specs_of(H, HV, K, L, inputs), state, _f32_decay(inputs),
                       jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype), records, cursor, config=config,
                       interpret=interpret, pool=pool_of(slots, state))


def _conv_specs(H: int, HV: int, K: int, V: int, ring, rows: int):
    """(the packed inputs' q, k and v specs, the ConvOperands' specs) of the fused conv step's programs of
    `rows` state rows: blocks of the packed conv input [batch, C] and of the weight [C, W] at the program's
    channels (K a power of two, rows dividing V and 2 H K), the row's whole ring, its start."""
    group, (S, C), BW = HV // H, ring.columns.shape[1:], next_pow2(ring.wq.shape[1])
    vfirst, per_head = 2 * H * K // rows, V // rows

    def v_block(h, j):
        return vfirst + h * per_head + j

    x = dict(q=pl.BlockSpec((None, K), lambda b, h, j: (b, h // group)),
             k=pl.BlockSpec((None, K), lambda b, h, j: (b, H + h // group)),
             v=pl.BlockSpec((None, rows), lambda b, h, j: (b, v_block(h, j))))
    return x, ConvOperands(columns=pl.BlockSpec((None, S, C), lambda b, h, j: (b, 0, 0)),
                           start=pl.BlockSpec((1,), lambda b, h, j: (b,)),
                           wq=pl.BlockSpec((K, BW), lambda b, h, j: (h // group, 0)),
                           wk=pl.BlockSpec((K, BW), lambda b, h, j: (H + h // group, 0)),
                           wv=pl.BlockSpec((rows, BW), lambda b, h, j: (v_block(h, j), 0)))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "activation", "config", "interpret"))
def _conv_step(state, inputs: Inputs, ring: ConvOperands, *, scale: float, use_qk_l2norm: bool, activation: str,
               config: StepConfig, interpret: bool):
    """The fused conv step's launch: inputs.q, .k and .v are the packed conv input x [batch, C]. Returns (o,
    state, columns)."""
    _, HV, V, K = state.shape
    C = ring.columns.shape[2]
    H = (C - HV * V) // (2 * K)
    x_specs, ring_specs = _conv_specs(H, HV, K, V, ring, config.block_v)
    step_specs = _specs_of(H, HV, K, None, inputs)

    def specs(rows, nb):
        block = step_specs(rows, nb)
        return block._replace(inputs=block.inputs._replace(**x_specs))

    # On a latency-bound grid (batch x HV <= the SMs, as `replay_is_one_launch`) the ring's slots are loaded
    # whole, none waiting on the start (a load latency off the program's path); elsewhere the live ones, as
    # the whole ring took 168 registers a program against 128-130 at batch 64-256 (static SASS,
    # bench/RESULTS.md, "The GDN conv fused into the standard step").
    kernel = functools.partial(_conv_step_kernel, H=H, group=HV // H, W=ring.wq.shape[1], activation=activation,
                               whole_ring=state.shape[0] * HV <= num_sms(), V=V, K=K, L=None, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, dot_fold=False)
    o, state, _, columns = step_launch(
        "gdn", kernel, specs, state, _f32_decay(inputs),
        jax.ShapeDtypeStruct((state.shape[0], HV, V), inputs.v.dtype), config=config, interpret=interpret,
        ring=(ring, ring_specs))
    return o, state, columns


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "route", "config", "interpret"))
def _replay(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, scale: float,
            use_qk_l2norm: bool, route: str, config: ReplayConfig, interpret: bool):
    """The replay step's launches (output, state, append and deferred routes; the deferred route's
    flush launch first); over a state pool with `slots` (`launch.Pool`). Returns (o, checkpoint, records,
    cursor)."""
    _, HV, V, K = checkpoint.shape
    H, L = inputs.q.shape[1], records.d.shape[2]
    if route == "deferred":
        checkpoint = _flush_full(checkpoint, records, cursor, inputs, slots, scale=scale,
                                 use_qk_l2norm=use_qk_l2norm, config=config, interpret=interpret)
    kernel = functools.partial(_replay_kernel, V=V, K=K, L=L, group=HV // H, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, route=route)
    flush_row = functools.partial(_flush_row, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return replay_launch("gdn", kernel, flush_row, _specs_of(H, HV, K, L, inputs), checkpoint, records,
                         cursor, _f32_decay(inputs), jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype),
                         per_head=PER_HEAD, route=route, config=config, interpret=interpret,
                         pool=pool_of(slots, checkpoint))


def _flush_full(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, scale: float,
                use_qk_l2norm: bool, config: ReplayConfig, interpret: bool):
    """The deferred route's flush launch (`launch.flush_full_launch`) with `config`'s flush tiling: the
    rows at cursor L get their L buffered records folded into the checkpoint, in place. Returns the
    checkpoint operand."""
    _, HV, V, K = checkpoint.shape
    H, L = inputs.q.shape[1], records.d.shape[2]
    flush_row = functools.partial(_flush_row, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm, step=False)
    return flush_full_launch("gdn", flush_row, _specs_of(H, HV, K, L, inputs), checkpoint, records,
                             cursor, None, per_head=PER_HEAD, config=config, interpret=interpret,
                             pool=pool_of(slots, checkpoint))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config", "interpret", "tree"))
def _verify(checkpoint, records: Records, cursor, inputs: Inputs, slots=None, *, scale: float, use_qk_l2norm: bool,
            config: ReplayConfig, interpret: bool, tree=None):
    """A verify window's launches (early flush, verify kernel); tree: a draft
    tree (not a chain) or None; over a state pool with `slots` (`launch.Pool`).
    Returns (o, checkpoint, records, cursor)."""
    _, HV, V, K = checkpoint.shape
    H, L, W = inputs.q.shape[2], records.d.shape[2], inputs.v.shape[1]
    kernel = functools.partial(_verify_kernel, V=V, K=K, L=L, W=W, group=HV // H, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, **tree_option(tree))
    flush_row = functools.partial(_flush_row, V=V, K=K, L=L, scale=scale, use_qk_l2norm=use_qk_l2norm, step=False)
    specs = functools.partial(_specs_of(H, HV, K, L, inputs), window=next_pow2(W))
    return verify_launch("gdn", kernel, flush_row, specs,
                         checkpoint, records, cursor, _f32_decay(inputs), None,
                         jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype), window=W, per_head=PER_HEAD,
                         config=config, interpret=interpret, tree=tree, pool=pool_of(slots, checkpoint))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config", "interpret", "tree"))
def _per_draft(state, index, inputs: Inputs, slots=None, *, scale: float, use_qk_l2norm: bool, config: StepConfig,
               interpret: bool, tree=None):
    """The per-draft verify's launch; tree: a draft tree (not a chain) or None; over a state pool with
    `slots`. Returns (o, state)."""
    _, S, HV, V, K = state.shape
    H, W = inputs.q.shape[2], inputs.v.shape[1]
    kernel = functools.partial(_per_draft_kernel, V=V, K=K, W=W, slots=S, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, **tree_option(tree))
    return per_draft_launch("gdn", kernel, functools.partial(_specs_of(H, HV, K, None, inputs), window=next_pow2(W)),
                            state, index, _f32_decay(inputs), jax.ShapeDtypeStruct(inputs.v.shape, inputs.v.dtype),
                            window=W, config=config, interpret=interpret, tree=tree, pool=pool_of(slots, state))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config", "route"))
def _append_tma(state: GDNReplayState, inputs: Inputs, *, scale: float, use_qk_l2norm: bool,
                config: TMAReadoutConfig, route: str):
    """The append or deferred route on Mosaic GPU: the prelude launch (`_head_terms`), then the readout
    (`tma_readout.gdn_append_tma`; on the deferred route it flushes the full rows first, in place), on
    validated arguments within the readout's limits (`tma_readout.check_tma_readout`). Jitted: an eager
    call, as in an eager `jax.shard_map`, returns arrays, not the d records' `jax.Ref`. Returns (o
    [batch, HV, V] in v.dtype, new GDNReplayState), as :func:`gdn_replay_step`."""
    records = Records(state.d, state.k, state.g)
    qn, kn, terms, entry, shared, cursor, *stash = _head_terms(
        records, state.cursor, _f32_decay(inputs), scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=False,
        route=route, move_cursor=not readout_moves_cursor(state.batch))
    state = state.replace(k=shared.k, g=shared.g, cursor=cursor)
    return gdn_append_tma(state, qn, kn, terms, entry, inputs.v, config, k0=stash[0] if stash else None)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config"))
def _direct_tma(state: GDNReplayState, inputs: Inputs, *, scale: float, use_qk_l2norm: bool,
                config: TMAReadoutConfig):
    """The direct route on Mosaic GPU: the prelude launch (`_head_terms`, route "direct"), then the step
    (`tma_step.gdn_direct_tma`), on validated arguments within its limits (`tma_step.check_direct_tma`).
    Returns (o [batch, HV, V] in v.dtype, new GDNReplayState: the checkpoint after the live records and
    this step, cursor 0), as :func:`gdn_replay_step`."""
    records = Records(state.d, state.k, state.g)
    qn, kn, terms, entry, shared, cursor = _head_terms(records, state.cursor, _f32_decay(inputs), scale=scale,
                                                       use_qk_l2norm=use_qk_l2norm, interpret=False, route="direct")
    o, checkpoint = gdn_direct_tma(state.replace(k=shared.k), qn, kn, terms, entry, inputs.v, config)
    return o, state.replace(checkpoint=checkpoint, k=shared.k, g=shared.g, cursor=cursor)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "config"))
def _step_tma(state, inputs: Inputs, *, scale: float, use_qk_l2norm: bool, config: TMAReadoutConfig):
    """The standard step on Mosaic GPU: the prelude launch (`_step_terms`), then the step
    (`tma_step.gdn_step_tma`), on validated arguments within its limits (`tma_step.check_step_tma`).
    Returns (o [batch, HV, V] in v.dtype, new state, written in place)."""
    qn, kn, terms = _step_terms(_f32_decay(inputs), scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=False)
    return gdn_step_tma(state, qn, kn, terms, inputs.v, config)


def gdn_step(state, q, k, v, g=None, beta=None, *, a=None, b=None, A_log=None, dt_bias=None, scale: float,
             use_qk_l2norm: bool,
             config: StepConfig | TMAReadoutConfig | None = None, interpret: bool = False, slots=None):
    """One standard Gated DeltaNet decode step (Pallas kernel); the state is updated in place.

    Takes validated arguments (:func:`replayssm_jax.ops.gdn_step` validates
    them) and checks only the kernels' own limits, before any launch.

    Args:
      state: f32 | bf16[batch, HV, V, K], value-major.
      q, k: [batch, H, K] (H divides HV); v: [batch, HV, V].
      g: f32[batch, HV], log decay <= 0; beta: [batch, HV] in (0, 1). Or,
        in their place, the raw gates, which the kernels form
        (`reference.gdn_gates`): a, b [batch, HV] (the projections) and
        A_log, dt_bias [HV] (the layer's parameters, f32 or bf16; the
        kernels compute in f32).
      scale: the factor of q (after the L2 norm), e.g. K ** -0.5.
      use_qk_l2norm: L2-normalize q and k over K (eps 1e-6) first.
      config: the tiling; None: :func:`default_step_config` (layer "gdn"). A
        :class:`~replayssm_jax.kernels.tma_readout.TMAReadoutConfig` (e.g.
        `tma_step.STEP_CONFIG`; not a default: 5% slower than the default
        at batch 256, bench/RESULTS.md, 2026-12-03) runs the step as two launches: a
        Triton prelude (q and k normalized, the per-head scalars) and a
        persistent Mosaic GPU kernel whose TMA copies stream each state
        tile through shared memory and back
        (:func:`~replayssm_jax.kernels.tma_step.gdn_step_tma`).
      interpret: run the kernel in Pallas interpret mode (any platform).
      slots: None, or i32[batch] (validated): `state` is a state pool
        [capacity, HV, V, K] and batch row b steps slot slots[b] in place
        (the kernel indexes the pool: no copy of the states); -1: a padding
        row (no read, no write; its o is left unwritten). The tiling is
        that of a state of `batch` rows.

    Returns:
      (o [batch, HV, V] in v.dtype, new_state like state).

    Raises:
      ValueError: V or K above MAX_HEAD_DIM (256), or `config.block_v`
        above V rounded up to a power of two.
      TypeError: a `config` that is not a StepConfig or TMAReadoutConfig.
      NotImplementedError, ValueError: a TMAReadoutConfig beyond the
        Mosaic GPU kernel's limits (:func:`~replayssm_jax.kernels.tma_step.check_step_tma`).

    Math: Yang, Kautz & Hatamizadeh, "Gated Delta Networks" (ICLR 2025), as
    flash-linear-attention's fused_recurrent_gated_delta_rule.
    """
    inputs = _inputs(q, k, v, g, beta, a, b, A_log, dt_bias)
    if isinstance(config, TMAReadoutConfig):
        check_step_tma(state, v, config, interpret=interpret, slots=slots)
        return _step_tma(state, inputs, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), config=config)
    config = step_config_for(config, batch_shaped(state, slots), DIMS, layer="gdn")
    o, state, _ = _step(state, inputs, None, None, slots, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
                        config=config, interpret=interpret)
    return o, state


def conv_step_config(state, C: int, config: StepConfig | None = None) -> StepConfig:
    """The fused conv step's tiling for `state` [batch, HV, V, K] and C conv channels: `config`, checked as the
    standard step's (:func:`step_config_for`), or the standard step's default (layer "gdn") with its rows
    halved until they divide V and 2 H K = C - HV V.

    Raises as :func:`step_config_for`.
    """
    fitted = step_config_for(config, state, DIMS, layer="gdn")
    if config is None:
        V, qk = state.shape[2], C - state.shape[1] * state.shape[2]
        rows = fitted.block_v
        while rows > 1 and (V % rows or qk % rows):
            rows //= 2
        fitted = dataclasses.replace(fitted, block_v=rows)
    return fitted


def conv_step_fits(state, C: int, config: StepConfig | None = None) -> str | None:
    """Why the fused conv step (:func:`gdn_conv_step`) cannot take a state [batch, HV, V, K] (an array or its
    shape) and C = 2 H K + HV V conv channels with this tiling (None: :func:`conv_step_config`'s default), or
    None where it can.

    Raises as :func:`step_config_for`.
    """
    _, HV, V, K = state.shape
    if K != next_pow2(K):
        return (f"the key dim K = {K} (axis 3 of `state`) is not a power of two, which the fused launch needs "
                "(backend='xla' takes any)")
    rows, qk = conv_step_config(state, C, config).block_v, C - HV * V
    if V % rows or qk % rows:
        fit = next(r for r in (rows >> i for i in range(rows.bit_length())) if V % r == 0 and qk % r == 0)
        return (f"`config.block_v` = {rows} must divide V = {V} and 2 H K = {qk}, the tile's rows lying in one "
                f"piece of the conv's channels (e.g. {fit})")
    return None


def gdn_conv_step(state, x, columns, start, weight, g=None, beta=None, *, a=None, b=None, A_log=None, dt_bias=None,
                  scale: float, use_qk_l2norm: bool, activation: str = "silu", config: StepConfig | None = None,
                  interpret: bool = False):
    """One standard Gated DeltaNet decode step with its short conv fused: one launch.

    The decode layer's conv (:func:`replayssm_jax.kernels.conv_update`,
    no bias) and step (:func:`gdn_step`) in one kernel: each program forms
    its key head's q and k and its own v rows from the packed conv input
    and the ring, writes its part of the ring's new column, and steps its
    state tile; q, k and v never reach memory. A key head's q and k are
    formed by all of its programs (HV / H heads, V / block_v tiles each),
    from the L2. Takes validated arguments (`ops.gdn_conv_step`).

    Args:
      state: f32 | bf16[batch, HV, V, K], value-major; updated in place.
      x: [batch, C], the conv's inputs [q; k; v] (C = 2 H K + HV V).
      columns: [batch, S, C], the conv's ring (ConvWindow.columns), S >= W;
        x is written at slot (start + W - 1) mod S, in place.
      start: i32[batch], each row's oldest live ring slot, in [0, S).
      weight: [C, W], the conv's weight ([C, 1, W] reshaped).
      g, beta, a, b, A_log, dt_bias, scale, use_qk_l2norm, interpret: as
        :func:`gdn_step`.
      config: the tiling, a StepConfig; None: :func:`conv_step_config`.
      activation: the conv's, a name of `kernels.conv.ACTIVATIONS`.

    Returns:
      (o [batch, HV, V] in x.dtype, new state, new columns); the start is
      left to the caller (`ConvWindow.advance`).

    Raises:
      ValueError: an unknown activation; a K or a tiling the launch does
        not take (:func:`conv_step_fits`); as :func:`gdn_step`.
      TypeError: a `config` that is not a StepConfig.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
    if config is not None and not isinstance(config, StepConfig):
        raise TypeError(f"`config` must be a StepConfig for the fused conv step; got {type(config).__name__}")
    why = conv_step_fits(state, columns.shape[2], config)
    if why is not None:
        raise ValueError(f"gdn_conv_step: {why}")
    config = conv_step_config(state, columns.shape[2], config)
    inputs = _inputs(x, x, x, g, beta, a, b, A_log, dt_bias)
    ring = ConvOperands(columns, start, weight, weight, weight)
    return _conv_step(state, inputs, ring, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm),
                      activation=activation, config=config, interpret=interpret)


def gdn_replay_step(state: GDNReplayState, q, k, v, g=None, beta=None, *, a=None, b=None, A_log=None, dt_bias=None,
                    scale: float, use_qk_l2norm: bool, route: str,
                    config: StepConfig | ReplayConfig | TMAReadoutConfig | None = None, interpret: bool = False,
                    slots=None):
    """One ReplaySSM Gated DeltaNet decode step (Pallas kernels); checkpoint, buffers and cursor in place.

    Takes validated arguments (:func:`replayssm_jax.ops.gdn_replay_step`
    validates them and resolves route="auto") and checks only the kernels'
    own limits, before any launch. A row flushes (checkpoint <- S after
    this step, cursor 0) when its cursor reaches L with this step, or when
    it entered full (cursor == L, after a speculative commit): the flush
    then absorbs the L records and this step at once, as the reference does.

    Args:
      state: a GDNReplayState (checkpoint f32 | bf16[batch, HV, V, K],
        records d [batch, HV, L, V], k [batch, H, L, K], g f32[batch, HV, L],
        cursor i32[batch] in 0..L).
      q, k, v, g, beta, scale, use_qk_l2norm: as :func:`gdn_step`.
      route: "output" (o from one read of the checkpoint plus the buffer),
        "state" (the state formed for the readout; same numbers), "direct"
        (the standard step's kernel on the checkpoint with the row's live
        records folded in: cursor 0, no record appended), "append" (the
        output route without a flush, one launch: a row's record goes to
        its free slot, and a row that fills its buffer keeps it full, cursor
        L; a row that entered full gets NaN outputs and keeps its state) or
        "deferred" (a flush launch for the rows that entered full, their L
        records only, then the append route's launches, which read those
        rows as empty: the output route's numbers, each row's flush
        deferred to its next step).
      config: a StepConfig for the direct route, a ReplayConfig for the
        others; None: the default (:func:`default_direct_config`,
        :func:`default_replay_config`). The append, deferred and direct
        routes also take a
        :class:`~replayssm_jax.kernels.tma_readout.TMAReadoutConfig`:
        the same step as a Triton prelude launch (the per-head terms; on the
        append route the shared records) and one Mosaic GPU kernel whose TMA
        copies stream the checkpoint tiles through shared memory
        (:func:`~replayssm_jax.kernels.tma_readout.gdn_append_tma`, which
        writes the d records, and the cursor where the batch is a multiple
        of 4; :func:`~replayssm_jax.kernels.tma_step.gdn_direct_tma`,
        which writes the checkpoint back; on the deferred route the flush
        launch before them takes the default ReplayConfig's flush tiling);
        None on the append and deferred routes takes it
        where :func:`~replayssm_jax.kernels.tma_readout.default_tma_readout`
        says (an f32 or bf16 checkpoint of batch >= 64 on a Hopper-class
        GPU), on the direct route where
        :func:`~replayssm_jax.kernels.tma_step.default_direct_tma` says
        (an f32 checkpoint of batch >= 64 on a Hopper-class GPU with bf16 k
        records, L a multiple of 16 and K of 64: its fold on the tensor
        cores).
      interpret: run the kernels in Pallas interpret mode.
      slots: None, or i32[batch] (validated): the state is a state pool of
        capacity slots and batch row b steps slot slots[b], as
        :func:`gdn_step` (an 8-bit checkpoint's scales and write counts
        indexed by slot too); over a pool the flush launch takes one batch
        row per program.

    Returns:
      (o [batch, HV, V] in v.dtype, new GDNReplayState).

    Raises:
      ValueError: a route other than the five; V or K above MAX_HEAD_DIM
        (256), L above MAX_BUFFER_LEN (64); a `config.block_v` or
        `flush_block_v` above V rounded up to a power of two, a
        `config.flush_rows` that does not divide the batch; a one-launch
        step (fused flush, direct route) of more than 32767 programs per
        batch row.
      TypeError: a `config` of the other class than the route takes (a
        TMAReadoutConfig on another route than "append", "deferred" or "direct").
      NotImplementedError, ValueError: a TMAReadoutConfig beyond the
        Mosaic GPU kernels' limits (:func:`~replayssm_jax.kernels.tma_readout.check_tma_readout`,
        :func:`~replayssm_jax.kernels.tma_step.check_direct_tma`).
    """
    inputs = _inputs(q, k, v, g, beta, a, b, A_log, dt_bias)
    if config is None and route in NO_FLUSH_ROUTES:
        config = default_tma_readout(state, v, interpret=interpret, slots=slots, deferred=route == "deferred")
    elif config is None and route == "direct":
        config = default_direct_tma(state, v, interpret=interpret, slots=slots)
    if isinstance(config, TMAReadoutConfig):
        check_tma_route(route)
        options = dict(scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), config=config)
        if route == "direct":
            check_direct_tma(state, v, config, interpret=interpret, slots=slots)
            return _direct_tma(state, inputs, **options)
        check_tma_readout(state, v, config, interpret=interpret, slots=slots, deferred=route == "deferred")
        return _append_tma(state, inputs, route=route, **options)
    config = replay_config_for(config, batch_shaped(state.checkpoint, slots), state.buffer_len, DIMS, route=route)
    kw = dict(scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), interpret=interpret)
    return replay_step(state, Records(state.d, state.k, state.g), inputs, route=route, config=config,
                       step=functools.partial(_step, **kw), replay=functools.partial(_replay, **kw), slots=slots)


def gdn_replay_verify(state: GDNReplayState, q, k, v, g=None, beta=None, *, a=None, b=None, A_log=None,
                      dt_bias=None, scale: float, use_qk_l2norm: bool, tree=None,
                      config: ReplayConfig | None = None, interpret: bool = False, slots=None):
    """Verify a window of W speculative Gated DeltaNet steps (Pallas kernels); checkpoint and buffers in place.

    Takes validated arguments (:func:`replayssm_jax.ops.gdn_replay_verify`
    validates them). Rows with cursor + W > L flush first, as in
    :func:`replayssm_jax.kernels.mamba2_replay_verify`. Then one launch,
    grid (batch, HV, splits), reads each checkpoint tile once and applies
    the row's live records to it in registers, S_0 = exp(G) S_c + sum_i
    w_i d_i k_i^T (the flush's `replay_records`; S_0 the state at the
    window's start), then runs the window's W steps on that tile (the
    gated delta rule; ARCHITECTURE.md, "The verify window"; Yang, Kautz & Hatamizadeh,
    "Gated Delta Networks", ICLR 2025):

        S_t = exp(g_t) S_{t-1} + d_t k_t^T,  d_t = beta_t (v_t - exp(g_t) S_{t-1} k_t),  o_t = S_t q_t,

    writes o_t, and the W records (d, normalized k, g) as the buffers'
    dtypes at slots cursor .. cursor + W - 1; the checkpoint is not
    written. Output t reads nothing of steps s > t (NaN and inf included),
    nor of dead slots.

    Args:
      state: a GDNReplayState with no pending window (as
        :func:`gdn_replay_step`).
      q, k: [batch, W, H, K]; v: [batch, W, HV, V]; g: f32[batch, W, HV],
        log decay <= 0; beta: [batch, W, HV]; scale, use_qk_l2norm: as
        :func:`gdn_step`.
      tree: None or a :class:`~replayssm_jax.speculative.tree.DraftTree`
        of W nodes (static). A tree that is not a chain runs the nodes in
        node order: a node whose parent is the node before it continues
        from the state just computed, any other restarts from S_0 and
        replays the steps on its path (unrolled, no writes) first; a chain
        runs the window's loop.
      config: a ReplayConfig (fused_flush False; its flush fields tile the
        early flush); None: :func:`default_verify_config`.
      interpret: run the kernels in Pallas interpret mode.
      slots: None, or i32[batch] (validated): the state is a state pool of
        capacity slots and batch row b verifies slot slots[b] in place (both
        launches index the pool by slot; -1: a padding row, which reads and
        writes nothing), as :func:`gdn_replay_step`.

    Returns:
      (o [batch, W, HV, V] in v.dtype, new GDNReplayState with window = W):
      o[:, t] assumes steps 0 .. t - 1 of the window accepted; commit with
      :func:`replayssm_jax.state.replay_commit`.

    Raises:
      ValueError: V or K above MAX_HEAD_DIM (256), L above MAX_BUFFER_LEN
        (64), W outside [1, L]; a `config.block_v` or `flush_block_v` above
        V rounded up to a power of two, a `config.flush_rows` that does not
        divide the batch, `config.fused_flush` True.
      TypeError: a `config` that is not a ReplayConfig.
    """
    W = v.shape[1]
    config = verify_config_for(config, batch_shaped(state.checkpoint, slots), state.buffer_len, W, DIMS, tree)
    verify = functools.partial(_verify, scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), config=config,
                               interpret=interpret, **tree_option(tree))
    return verify_window(state, Records(state.d, state.k, state.g), _inputs(q, k, v, g, beta, a, b, A_log, dt_bias),
                         window=W, verify=verify, slots=slots)


def gdn_verify(state, index, q, k, v, g=None, beta=None, *, a=None, b=None, A_log=None, dt_bias=None,
               scale: float, use_qk_l2norm: bool, tree=None,
               config: StepConfig | None = None, interpret: bool = False, slots=None):
    """The per-draft standard verify of W speculative Gated DeltaNet steps (Pallas kernel); the state in place.

    Takes validated arguments (:func:`replayssm_jax.ops.gdn_verify`
    validates them). One launch, grid (batch, HV, cdiv(V, block_v)): each
    program reads its tile of the row's current state (slot index[b]) once
    and runs the W steps on it (the standard step's math, as
    :func:`gdn_step`), writing o_t and the state after step t to slot
    (index + 1 + t) mod slots: 1 + W state passes per layer, as vLLM's
    fused recurrent kernels with per-draft state indices. The current slot
    is never written (W < slots), so a commit is an index move.

    Args:
      state: f32 | bf16[batch, slots, HV, V, K], the slotted standard state;
        index: i32[batch], each row's slot of the current state.
      q, k: [batch, W, H, K]; v: [batch, W, HV, V]; g: f32[batch, W, HV],
        log decay <= 0; beta: [batch, W, HV]; scale, use_qk_l2norm: as
        :func:`gdn_step`.
      tree: None or a DraftTree of W nodes (static): node t steps from its
        parent's state (the root from the current state), walked in node
        order as in :func:`gdn_replay_verify`; a chain runs the window's loop.
      config: the tiling (a StepConfig); None: :func:`default_step_config`
        (layer None) of one slot's state.
      interpret: run the kernel in Pallas interpret mode.
      slots: None, or i32[batch] (validated): `state` is a state pool
        [capacity, slots, HV, V, K] with `index` i32[capacity], and batch
        row b verifies pool slot slots[b] in place (the kernel indexes the
        pool: no copy; -1: a padding row, which reads and writes nothing).

    Returns:
      (o [batch, W, HV, V] in v.dtype, new state like state).

    Raises:
      ValueError, TypeError: as :func:`gdn_step`.
    """
    config = per_draft_config_for(config, batch_shaped(state, slots), DIMS)
    return _per_draft(state, index, _inputs(q, k, v, g, beta, a, b, A_log, dt_bias), slots, scale=float(scale),
                      use_qk_l2norm=bool(use_qk_l2norm), config=config, interpret=interpret, **tree_option(tree))
