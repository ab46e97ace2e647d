"""Pure-JAX reference of the Mamba-2 SSM ops: standard step, chunked prefill,
and the ReplaySSM step, verify window, materialisation and flush.

Math: Dao & Gu, "Transformers are SSMs" (Mamba-2, 2024), in the convention of
mamba_ssm's `selective_state_update` and `ssd_minimal`; ReplaySSM per
ARCHITECTURE.md, "The math" and "The verify window". Per head h with group g = h // (nheads // n_groups):

    dt    = clamp(softplus(dt_raw + dt_bias), dt_limit)
    S     = exp(dt * A) S + (dt * x) B_g^T          S f32[head_dim, d_state]
    y     = S C_g + D x,   then y *= silu(z)

All arithmetic is float32; outputs have x's dtype and states keep their dtype.
The arguments are validated by :mod:`replayssm_jax.ops` (its namesakes of
these functions); this module holds the math only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from replayssm_jax.reference import _common as c
from replayssm_jax.state import Mamba2ReplayState, as_f32_checkpoint, in_order, step_writes, write_slots

f32 = jnp.float32
INF = math.inf


def process_dt(dt, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF)) -> jax.Array:
    """dt_raw -> clamp(softplus(dt_raw + dt_bias), dt_limit), float32."""
    dt = dt.astype(f32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(f32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    low, high = dt_limit
    if low > 0.0 or high < INF:
        dt = jnp.clip(dt, low, high)
    return dt


def dt_columns(dt, dt_offset, nheads: int):
    """dt's nheads columns: dt itself (dt_offset None), or dt[..., dt_offset : dt_offset + nheads] of a wider
    array (the ops' dt_offset: Mamba-2's in_proj output zxbcdt, whose kernels read dt in place)."""
    return dt if dt_offset is None else dt[..., dt_offset:dt_offset + nheads]


def _skip_and_gate(y, x, D, z, head_axis):
    """y + D x, then y * silu(z) (mamba_ssm's order)."""
    if D is not None:
        shape = [1] * x.ndim
        shape[head_axis] = -1
        y = y + D.astype(f32).reshape(shape) * x.astype(f32)
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    return y


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF), *,
                dt_offset=None):
    """One standard Mamba-2 decode step (the selective state update).

    Args:
      state: f32 | bf16[batch, nheads, head_dim, d_state], ssm_state before the step.
      x: [batch, nheads, head_dim]; dt: [batch, nheads] (raw); A: f32[nheads] < 0;
      B, C: [batch, n_groups, d_state]; D: optional [nheads]; z: optional like x;
      dt_bias: optional [nheads]; dt_softplus: bool; dt_limit: (low, high) floats;
      dt_offset: None, or dt's column of head 0 in a wider dt (:func:`dt_columns`; the
      other ops take it too). Their meaning: :func:`replayssm_jax.ops.mamba2_step`.

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new_state in state.dtype).
    """
    dt = dt_columns(dt, dt_offset, A.shape[0])
    H = state.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = (c.expand_heads(a.astype(f32), H, axis=1) for a in (B, C))
    decay = jnp.exp(dt * A.astype(f32))
    S = state.astype(f32) * decay[..., None, None]
    S = S + (dt[..., None] * x.astype(f32))[..., None] * Bh[:, :, None, :]
    y = c.einsum("bhpn,bhn->bhp", S, Ch)
    y = _skip_and_gate(y, x, D, z, head_axis=1)
    return y.astype(x.dtype), S.astype(state.dtype)


def mamba2_verify(state, index, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                  tree=None, *, dt_offset=None):
    """The per-draft standard verify of W speculative Mamba-2 steps (one state per draft position).

    Step t (of a chain; of a tree: node t) is :func:`mamba2_step` from the
    state of step t - 1 (of node t's parent; step 0 and the root: the
    row's current state, slot index), in float32; its state is stored, in
    the state's dtype, at slot (index + 1 + t) mod slots
    (:func:`replayssm_jax.reference._common.draft_slots`). The current
    state's slot is not written (W < slots), so a commit of m steps is an
    index move.

    Args:
      state: f32 | bf16[batch, slots, nheads, head_dim, d_state];
      index: i32[batch] in 0..slots - 1, the slot of each row's state.
      x: [batch, W, nheads, head_dim]; dt: [batch, W, nheads] (raw);
      B, C: [batch, W, n_groups, d_state]; z: optional like x; A, D,
      dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`.
      tree: None (a chain) or a DraftTree of W nodes.

    Returns:
      (y [batch, W, nheads, head_dim] in x.dtype, the new slotted state).
    """
    dt = dt_columns(dt, dt_offset, A.shape[0])

    def step(S, x, dt, B, C, z):
        return mamba2_step(S, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)

    return c.per_draft_verify(state, index, step, (x, dt, B, C, z), tree)


def mamba2_chunked(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF), chunk_size=64, *,
    dt_offset=None
):
    """T Mamba-2 steps at once in the chunked SSD form (the prefill path).

    Within a chunk of `chunk_size` steps the outputs are one masked
    "attention" product C B^T * decay; the state passes between chunks.

    Args:
      state: None (zeros) or f32 | bf16[batch, nheads, head_dim, d_state].
      x: [batch, seqlen, nheads, head_dim]; dt: [batch, seqlen, nheads] (raw);
      A: f32[nheads]; B, C: [batch, seqlen, n_groups, d_state];
      D: optional [nheads]; z: optional like x; dt_bias: optional [nheads];
      dt_softplus, dt_limit: as in :func:`mamba2_step`.
      chunk_size: steps per chunk (an int >= 1; need not divide seqlen).

    Returns:
      (y [batch, seqlen, nheads, head_dim] in x.dtype, final state in
      state.dtype, or float32 if state is None).
    """
    dt = dt_columns(dt, dt_offset, A.shape[0])
    batch, T, H, P = x.shape
    if state is None:
        state = jnp.zeros((batch, H, P, B.shape[-1]), f32)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    u = dt[..., None] * x.astype(f32)
    Bh, Ch = (c.expand_heads(a.astype(f32), H, axis=2) for a in (B, C))
    y, final = c.scan_chunks(c.chunk_readout, state.astype(f32), (u, Bh, Ch, dt * A.astype(f32)), chunk_size)
    y = _skip_and_gate(y, x, D, z, head_axis=2)
    return y.astype(x.dtype), final.astype(state.dtype)


# --------------------------------------------------------------------------
# ReplaySSM


def unify(state: Mamba2ReplayState, A) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The buffer in the common (u, k, lg) form: u = dt * x, k = B (per head), lg = dt * A."""
    H = state.checkpoint.shape[1]
    u = state.dt[..., None] * state.x.astype(f32)
    k = c.expand_heads(state.B.astype(f32), H, axis=1)
    return u, k, state.dt * A.astype(f32)[None, :, None]


def mamba2_replay_materialize(state: Mamba2ReplayState, A) -> jax.Array:
    """The state after `cursor` buffered steps, f32[batch, nheads, head_dim, d_state]:
    S = exp(G) S_c + sum_i w_i (dt_i x_i) B_i^T over the live slots (with a pending
    verify window: the state at the window's start). Arguments as
    :func:`replayssm_jax.ops.mamba2_replay_materialize`. An 8-bit checkpoint
    is read dequantized.
    """
    state = as_f32_checkpoint(state)
    return c.replay_materialize(state.checkpoint, *unify(state, A), state.cursor)


def mamba2_replay_flush(state: Mamba2ReplayState, A) -> Mamba2ReplayState:
    """Every row's materialised state written as its checkpoint (in the
    checkpoint's dtype), cursor 0; the buffers keep their contents, now dead
    slots. Arguments as :func:`replayssm_jax.ops.mamba2_replay_flush`.
    """
    if state.scale is not None:
        return c.on_f32_checkpoint(state, jnp.ones_like(state.cursor, bool),
                                   lambda s: ((), mamba2_replay_flush(s, A)))[1]
    return c.flush_where(state, jnp.ones_like(state.cursor, bool), lambda s: unify(s, A))


def mamba2_replay_step(
    state: Mamba2ReplayState,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    dt_limit=(0.0, INF),
    route: str = "output",
    *,
    dt_offset=None,
):
    """One ReplaySSM decode step of a Mamba-2 layer.

    Per row: append the record (x, dt, B) at slot `cursor`; compute y from
    one read of the checkpoint plus the buffer; cursor += 1; if the cursor
    reaches L, flush (checkpoint <- S_L, cursor <- 0), fused into this step.
    A row that enters with a full buffer (cursor == L, only after a commit)
    flushes its L records and this step together (cursor 0 afterwards).

    Args:
      state: Mamba2ReplayState with no pending verify window.
      x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`.
      route: "output" computes y = exp(G) S_c C + sum_i w_i (B_i . C) dt_i x_i
        without forming the state; "state" forms S in f32 and reads y = S C.
        "direct" folds each row's live records into its checkpoint and takes
        a standard step on it, written back at once (cursor 0, no record
        appended). All three give the same numbers up to float32 rounding.
        "append" is the output route without the flush: a row that fills its
        buffer keeps it full (cursor L), and a row that entered full gets NaN
        outputs and its state unchanged.
        "deferred" flushes the rows that entered full first (their L
        records only; :func:`replayssm_jax.reference._common.flush_full`),
        then takes the append route: the same outputs as "output", but a
        row that fills its buffer keeps it full (cursor L) until its next
        step. ("auto" is resolved by
        :func:`replayssm_jax.ops.mamba2_replay_step`.)

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new Mamba2ReplayState).
      y equals :func:`mamba2_step`'s output on the same step sequence.
      An 8-bit checkpoint is read dequantized and written quantized once
      per write (:func:`replayssm_jax.reference._common.on_f32_checkpoint`),
      a bfloat16 one rounded once per step (`on_widened_checkpoint`).
    """
    dt = dt_columns(dt, dt_offset, A.shape[0])
    if route == "deferred":  # the full rows flush first; the append route then finds a free slot in every row
        return mamba2_replay_step(c.flush_full(state, lambda s: unify(s, A)), x, dt, A, B, C, D, z, dt_bias,
                                  dt_softplus, dt_limit, "append")
    if state.scale is not None:
        return c.on_f32_checkpoint(state, step_writes(state, route), lambda s: mamba2_replay_step(
            s, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, route))
    if state.checkpoint.dtype != f32:  # bfloat16: written once per step, as the kernels write it
        return c.on_widened_checkpoint(state, lambda s: mamba2_replay_step(
            s, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, route))
    if route == "direct":
        return c.direct_step(state, lambda s: unify(s, A),
                             lambda S: mamba2_step(S, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit))
    H = state.checkpoint.shape[1]
    entered_full = state.cursor == state.buffer_len
    before = state
    state = c.make_room(state, 1, lambda s: unify(s, A))
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    state, dt = in_order(state, dt)  # the early flush has read the buffers
    state = state.replace(
        x=write_slots(state.x, x[:, :, None], state.cursor),
        dt=write_slots(state.dt, dt[:, :, None], state.cursor),
        B=write_slots(state.B, B[:, :, None], state.cursor),
    )
    state, _ = in_order(state, ())  # the writes have read the cursor
    state = state.replace(cursor=state.cursor + 1)
    Ch = c.expand_heads(C.astype(f32), H, axis=1)
    y = c.READOUTS[route](state.checkpoint, *unify(state, A), state.cursor, Ch)
    y = _skip_and_gate(y, x, D, z, head_axis=1)
    flush = ((state.cursor == state.buffer_len) | entered_full) & (route != "append")
    state, (y, flush) = in_order(state, (y, flush))
    state = c.flush_where(state, flush, lambda s: unify(s, A))
    if route == "append":
        y, state = c.refuse_full_rows(entered_full, before, y, state)
    return y.astype(x.dtype), state


def mamba2_replay_verify(
    state: Mamba2ReplayState,
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    dt_limit=(0.0, INF),
    tree=None,
    *,
    dt_offset=None,
):
    """Verify a window of W speculative steps (ARCHITECTURE.md, "The verify window"), or a draft tree of W nodes.

    Rows with cursor + W > L flush first. The W outputs are computed from
    the state at the window start (checkpoint plus buffer) and the window's
    own steps, which for Mamba-2 are independent given that state. The W
    records are written at slots cursor .. cursor + W - 1; the cursor and
    the checkpoint are not moved. Follow with
    :func:`replayssm_jax.state.replay_commit`.

    Args:
      state: Mamba2ReplayState with no pending window.
      x: [batch, W, nheads, head_dim]; dt: [batch, W, nheads] (raw);
      B, C: [batch, W, n_groups, d_state]; z: optional like x;
      A, D, dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`. 1 <= W <= L.
      tree: None or a chain (the window), or a
        :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes: node
        t's output reads the state at the window's start and the nodes on
        its path root .. t only (the decays and products along that path);
        the W records still go to slots cursor .. cursor + W - 1 in node
        order.

    Returns:
      (y [batch, W, nheads, head_dim] in x.dtype, new state with window = W):
      y[:, t] is the output of step t assuming steps 0..t-1 of the window
      (of a tree: t's ancestors) are accepted.
      It depends on those steps only: a NaN or inf in a later draft (a
      padded or garbage draft) cannot reach it; from the first draft with a
      non-finite input that enters the state on, the outputs are NaN.
    """
    dt = dt_columns(dt, dt_offset, A.shape[0])
    W = x.shape[1]
    if state.scale is not None:
        state = c.early_flush_8bit(state, W, lambda s: unify(s, A))
        return c.reading_f32_checkpoint(state, lambda s: mamba2_replay_verify(s, x, dt, A, B, C, D, z, dt_bias,
                                                                              dt_softplus, dt_limit, tree))
    H = state.checkpoint.shape[1]
    state = c.make_room(state, W, lambda s: unify(s, A))
    start = c.replay_materialize(state.checkpoint, *unify(state, A), state.cursor)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    u = dt[..., None] * x.astype(f32)
    Bh, Ch = (c.expand_heads(a.astype(f32), H, axis=2) for a in (B, C))
    y, _ = c.chunk_readout(start, u, Bh, Ch, dt * A.astype(f32), ancestors=c.tree_ancestors(tree))
    y = _skip_and_gate(y, x, D, z, head_axis=2)
    state, (y, dt) = in_order(state, (y, dt))  # the buffers are read before the window is written
    state = state.replace(
        x=write_slots(state.x, jnp.swapaxes(x, 1, 2), state.cursor),
        dt=write_slots(state.dt, jnp.swapaxes(dt, 1, 2), state.cursor),
        B=write_slots(state.B, jnp.swapaxes(B, 1, 2), state.cursor),
        window=W,
    )
    return y.astype(x.dtype), state
