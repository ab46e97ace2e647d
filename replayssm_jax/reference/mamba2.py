"""Pure-JAX reference of the Mamba-2 SSM ops: standard step, chunked prefill,
and the ReplaySSM step, verify window, materialisation and flush.

Math: Dao & Gu, "Transformers are SSMs" (Mamba-2, 2024), in the convention of
mamba_ssm's `selective_state_update` and `ssd_minimal`; ReplaySSM per
DESIGN.md sections 2 and 3. Per head h with group g = h // (nheads // n_groups):

    dt    = clamp(softplus(dt_raw + dt_bias), dt_limit)
    S     = exp(dt * A) S + (dt * x) B_g^T          S f32[head_dim, d_state]
    y     = S C_g + D x,   then y *= silu(z)

All arithmetic is float32; outputs have x's dtype and states keep their dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from replayssm_jax import _validate as v
from replayssm_jax.reference import _common as c
from replayssm_jax.state import Mamba2ReplayState, check_no_pending_window, check_replay_state, write_slots

f32 = jnp.float32
INF = math.inf


def _check_inputs(dims, x, dt, A, B, C, D, z, dt_bias, dt_limit, seq=None, seq_name="seqlen", groups=None):
    """Validate the inputs of one step (seq None) or of `seq` steps.

    dims = (batch, nheads, head_dim, d_state); groups: the n_groups that B
    must have (a replay state's), or None (any divisor of nheads). Returns
    n_groups.
    """
    batch, H, P, N = dims
    lead, lead_names = ((batch,), "batch") if seq is None else ((batch, seq), f"batch, {seq_name}")
    v.float_arg("x", x, f"{lead_names}, nheads, head_dim", (*lead, H, P))
    v.float_arg("dt", dt, f"{lead_names}, nheads", (*lead, H))
    v.float_arg("A", A, "nheads", (H,))
    v.check_negative("A", A, "A = -exp(A_log)")
    B = v.check_float("B", B)
    v.check_rank("B", B, f"{lead_names}, n_groups, d_state")
    G = B.shape[-2]
    if groups is not None and G != groups:
        raise ValueError(f"`B` must have n_groups = {groups} (the state's); got {G}")
    v.check_divisible("nheads", H, "n_groups = B.shape[-2]", G)
    v.check_shape("B", B, f"{lead_names}, n_groups, d_state", (*lead, G, N))
    C = v.check_float("C", C)
    v.check_rank("C", C, f"{lead_names}, n_groups, d_state")
    if C.shape[-2] != G:
        raise ValueError(f"`C` must have n_groups = {G} (the state's); got {C.shape[-2]}" if groups is not None else
                         f"`B` and `C` must have the same n_groups; got {G} and {C.shape[-2]}")
    v.check_shape("C", C, f"{lead_names}, n_groups, d_state", (*lead, G, N))
    v.optional_float_arg("D", D, "nheads", (H,))
    v.optional_float_arg("z", z, f"{lead_names}, nheads, head_dim", (*lead, H, P))
    v.optional_float_arg("dt_bias", dt_bias, "nheads", (H,))
    v.check_dt_limit(dt_limit)
    return G


def _check_state(state, name="state"):
    state = v.check_float(name, state, v.STATE_DTYPES)
    v.check_rank(name, state, "batch, nheads, head_dim, d_state")
    return state


def process_dt(dt, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF)) -> jax.Array:
    """dt_raw -> clamp(softplus(dt_raw + dt_bias), dt_limit), float32."""
    dt = dt.astype(f32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(f32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    low, high = v.check_dt_limit(dt_limit)
    if low > 0.0 or high < INF:
        dt = jnp.clip(dt, low, high)
    return dt


def _skip_and_gate(y, x, D, z, head_axis):
    """y + D x, then y * silu(z) (mamba_ssm's order)."""
    if D is not None:
        shape = [1] * x.ndim
        shape[head_axis] = -1
        y = y + D.astype(f32).reshape(shape) * x.astype(f32)
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    return y


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF)):
    """One standard Mamba-2 decode step (the selective state update).

    Args:
      state: f32 | bf16[batch, nheads, head_dim, d_state], ssm_state before the step.
      x: [batch, nheads, head_dim], the SSM input (after conv1d and silu).
      dt: [batch, nheads], raw time step (before dt_bias and softplus).
      A: f32[nheads], negative, A = -exp(A_log).
      B, C: [batch, n_groups, d_state]; head h uses group h // (nheads // n_groups).
      D: optional [nheads], skip connection y += D * x.
      z: optional [batch, nheads, head_dim], gate: y *= silu(z).
      dt_bias: optional [nheads], added to dt before softplus.
      dt_softplus: apply softplus to dt (+ dt_bias).
      dt_limit: (low, high), clamp of the processed dt (the model's time_step_limit).

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new_state in state.dtype).

    Raises:
      TypeError: an argument is not a floating array, or the state is not f32/bf16.
      ValueError: a shape does not match, or nheads % n_groups != 0.
    """
    state = _check_state(state)
    _check_inputs(state.shape, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    H = state.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = (c.expand_heads(a.astype(f32), H, axis=1) for a in (B, C))
    decay = jnp.exp(dt * A.astype(f32))
    S = state.astype(f32) * decay[..., None, None]
    S = S + (dt[..., None] * x.astype(f32))[..., None] * Bh[:, :, None, :]
    y = c.einsum("bhpn,bhn->bhp", S, Ch)
    y = _skip_and_gate(y, x, D, z, head_axis=1)
    return y.astype(x.dtype), S.astype(state.dtype)


def mamba2_chunked(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF), chunk_size=64
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
      chunk_size: steps per chunk (any int >= 1; need not divide seqlen).

    Returns:
      (y [batch, seqlen, nheads, head_dim] in x.dtype, final state in
      state.dtype, or float32 if state is None).

    Raises:
      TypeError, ValueError: as :func:`mamba2_step`; also chunk_size < 1.
    """
    x = v.check_float("x", x)
    v.check_rank("x", x, "batch, seqlen, nheads, head_dim")
    batch, T, H, P = x.shape
    B = v.check_float("B", B)
    v.check_rank("B", B, "batch, seqlen, n_groups, d_state")
    N = B.shape[-1]
    if state is None:
        state = jnp.zeros((batch, H, P, N), f32)
    state = _check_state(state)
    v.check_shape("state", state, "batch, nheads, head_dim, d_state", (batch, H, P, N))
    _check_inputs(state.shape, x, dt, A, B, C, D, z, dt_bias, dt_limit, seq=T)
    chunk_size = v.check_positive_int("chunk_size", chunk_size)
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


def _check_replay(state, A):
    check_replay_state(state, Mamba2ReplayState)
    v.float_arg("A", A, "nheads", (state.checkpoint.shape[1],))
    v.check_negative("A", A, "A = -exp(A_log)")


def _check_replay_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_limit):
    """The checks of a replay step: the state, no pending window, the inputs, the state's n_groups."""
    _check_replay(state, A)
    check_no_pending_window(state)
    _check_inputs(state.checkpoint.shape, x, dt, A, B, C, D, z, dt_bias, dt_limit, groups=state.B.shape[1])


def mamba2_replay_materialize(state: Mamba2ReplayState, A) -> jax.Array:
    """The current full SSM state from checkpoint plus buffer.

    Args:
      state: a Mamba2ReplayState; A: f32[nheads] (negative).

    Returns:
      f32[batch, nheads, head_dim, d_state]: the state after `cursor` buffered
      steps, equal to the state a standard decode would hold now. With a
      pending verify window: the state at the window's start.

    Raises:
      TypeError, ValueError: a malformed state, a wrong shape or dtype of
        `A`, or a concrete `A` with an entry >= 0.
    """
    _check_replay(state, A)
    return c.replay_materialize(state.checkpoint, *unify(state, A), state.cursor)


def mamba2_replay_flush(state: Mamba2ReplayState, A) -> Mamba2ReplayState:
    """Write the materialised state of every row as its checkpoint; cursor <- 0.

    Use it to hand a replay state to code that reads only the checkpoint
    (e.g. a standard decode step or a cache export); decoding itself
    flushes a row when its buffer fills.

    Args:
      state: a Mamba2ReplayState without a pending verify window.
      A: f32[nheads], negative (A = -exp(A_log)).

    Returns:
      Mamba2ReplayState: checkpoint = the materialised state (in the
      checkpoint's dtype), cursor 0 in every row; the buffers keep their
      contents (dead slots, never read).

    Raises:
      TypeError, ValueError: a malformed state, a wrong shape or dtype of
        `A`, a concrete `A` with an entry >= 0, or a pending verify window.
    """
    _check_replay(state, A)
    check_no_pending_window(state)
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
        appended): the standard step's traffic, for latency-bound batches;
        the buffer then serves speculative decoding. All three give the
        same numbers up to float32 rounding. "auto" is "output" here; the
        kernels pick by shape (:func:`replayssm_jax.kernels.pick_route`).

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new Mamba2ReplayState).
      y equals :func:`mamba2_step`'s output on the same step sequence.

    Raises:
      TypeError, ValueError: as :func:`mamba2_step`, for a malformed state,
      a pending verify window, or an unknown route.
    """
    _check_replay_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    route = "output" if v.check_route(route) == "auto" else route
    if route == "direct":
        return c.direct_step(state, lambda s: unify(s, A),
                             lambda S: mamba2_step(S, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit))
    H = state.checkpoint.shape[1]
    entered_full = state.cursor == state.buffer_len
    state = c.make_room(state, 1, lambda s: unify(s, A))
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    state = state.replace(
        x=write_slots(state.x, x[:, :, None], state.cursor),
        dt=write_slots(state.dt, dt[:, :, None], state.cursor),
        B=write_slots(state.B, B[:, :, None], state.cursor),
        cursor=state.cursor + 1,
    )
    buffer = unify(state, A)
    Ch = c.expand_heads(C.astype(f32), H, axis=1)
    if route == "output":
        y = c.replay_readout(state.checkpoint, *buffer, state.cursor, Ch)
    else:
        y = c.einsum("bhpn,bhn->bhp", c.replay_materialize(state.checkpoint, *buffer, state.cursor), Ch)
    y = _skip_and_gate(y, x, D, z, head_axis=1)
    flush = (state.cursor == state.buffer_len) | entered_full
    state = c.flush_where(state, flush, lambda s: unify(s, A))
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
):
    """Verify a window of W speculative steps (DESIGN.md section 3).

    Rows with cursor + W > L flush first. The W outputs are computed from
    the state at the window start (checkpoint plus buffer) and the window's
    own steps, which for Mamba-2 are independent given that state. The W
    records are written at slots cursor .. cursor + W - 1; the cursor and
    the checkpoint are not moved. Follow with :func:`replay_commit`.

    Args:
      state: Mamba2ReplayState with no pending window.
      x: [batch, W, nheads, head_dim]; dt: [batch, W, nheads] (raw);
      B, C: [batch, W, n_groups, d_state]; z: optional like x;
      A, D, dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`. 1 <= W <= L.

    Returns:
      (y [batch, W, nheads, head_dim] in x.dtype, new state with window = W):
      y[:, t] is the output of step t assuming steps 0..t-1 of the window
      are accepted.

    Raises:
      TypeError, ValueError: as :func:`mamba2_replay_step`, and W > L.
    """
    _check_replay(state, A)
    check_no_pending_window(state)
    x = v.check_float("x", x)
    v.check_rank("x", x, "batch, W, nheads, head_dim")
    W = x.shape[1]
    if not 1 <= W <= state.buffer_len:
        raise ValueError(f"the window length W = x.shape[1] must be in [1, L = {state.buffer_len}]; got {W}")
    _check_inputs(state.checkpoint.shape, x, dt, A, B, C, D, z, dt_bias, dt_limit, seq=W, seq_name="W",
                  groups=state.B.shape[1])
    H = state.checkpoint.shape[1]
    state = c.make_room(state, W, lambda s: unify(s, A))
    start = c.replay_materialize(state.checkpoint, *unify(state, A), state.cursor)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    u = dt[..., None] * x.astype(f32)
    Bh, Ch = (c.expand_heads(a.astype(f32), H, axis=2) for a in (B, C))
    y, _ = c.chunk_readout(start, u, Bh, Ch, dt * A.astype(f32))
    y = _skip_and_gate(y, x, D, z, head_axis=2)
    state = state.replace(
        x=write_slots(state.x, jnp.swapaxes(x, 1, 2), state.cursor),
        dt=write_slots(state.dt, jnp.swapaxes(dt, 1, 2), state.cursor),
        B=write_slots(state.B, jnp.swapaxes(B, 1, 2), state.cursor),
        window=W,
    )
    return y.astype(x.dtype), state
