"""The ReplaySSM decode state of one SSM layer, as pytrees.

ReplaySSM (DESIGN.md section 2) keeps the recurrent state in memory only as a
*checkpoint* S_c and buffers the per-step inputs of the recurrence since that
checkpoint in a ring of L slots. Slot i < cursor holds step i + 1 after the
checkpoint. With log decays lg_i and G_j = lg_1 + ... + lg_j, the state after
j buffered steps is

    S_j = exp(G_j) S_c + sum_{i <= j} exp(G_j - G_i) u_i k_i^T

(Mamba-2: u = dt * x, k = B, lg = dt * A; Gated DeltaNet: u = d, the delta-rule
update vector, k = the L2-normalised key, lg = g).

Both states are `flax.struct` dataclasses: they go through `jax.jit`,
`jax.lax.scan` and donation as they are. `window` is static (part of the
tree structure): 0, or the length W of a verified speculative window that
:func:`replay_commit` has not yet resolved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from replayssm_jax import _validate as v


@struct.dataclass
class Mamba2ReplayState:
    """ReplaySSM state of a Mamba-2 layer.

    Attributes:
      checkpoint: f32 | bf16[batch, nheads, head_dim, d_state], the SSM state
        at the last flush (mamba_ssm's `ssm_state` layout).
      x: [batch, nheads, L, head_dim], the buffered inputs x (buffer dtype).
      dt: f32[batch, nheads, L], the buffered time steps, already processed
        (dt_bias added, softplus, clamped to dt_limit).
      B: [batch, n_groups, L, d_state], the buffered input projections B.
      cursor: i32[batch], steps buffered since the checkpoint, 0..L.
      window: static int, the pending verify window W (0 if none).
    """

    checkpoint: jax.Array
    x: jax.Array
    dt: jax.Array
    B: jax.Array
    cursor: jax.Array
    window: int = struct.field(pytree_node=False, default=0)

    @property
    def buffer_len(self) -> int:
        """L, the number of buffer slots (static)."""
        return self.dt.shape[-1]

    @property
    def batch(self) -> int:
        return self.checkpoint.shape[0]


@struct.dataclass
class GDNReplayState:
    """ReplaySSM state of a Gated DeltaNet layer.

    Attributes:
      checkpoint: f32 | bf16[batch, HV, V, K], the state at the last flush,
        value-major (transformers stores [batch, HV, K, V]).
      d: [batch, HV, L, V], the buffered delta-rule update vectors
        d_t = beta_t * (v_t - exp(g_t) S_{t-1} k_t) (buffer dtype).
      k: [batch, H, L, K], the buffered keys, L2-normalised, not scaled.
      g: f32[batch, HV, L], the buffered log decays (<= 0).
      cursor: i32[batch], steps buffered since the checkpoint, 0..L.
      window: static int, the pending verify window W (0 if none).
    """

    checkpoint: jax.Array
    d: jax.Array
    k: jax.Array
    g: jax.Array
    cursor: jax.Array
    window: int = struct.field(pytree_node=False, default=0)

    @property
    def buffer_len(self) -> int:
        """L, the number of buffer slots (static)."""
        return self.g.shape[-1]

    @property
    def batch(self) -> int:
        return self.checkpoint.shape[0]


ReplayState = Mamba2ReplayState | GDNReplayState


def _check_checkpoint(checkpoint, dims: str) -> jax.Array:
    checkpoint = v.check_float("checkpoint", checkpoint, v.STATE_DTYPES)
    v.check_rank("checkpoint", checkpoint, dims)
    return checkpoint


def mamba2_replay_init(checkpoint, buffer_len: int, n_groups: int, buffer_dtype=jnp.float32) -> Mamba2ReplayState:
    """A Mamba-2 ReplaySSM state with an empty buffer.

    Args:
      checkpoint: f32 | bf16[batch, nheads, head_dim, d_state], the SSM state
        to start from (zeros for an empty prefix, or a prefill's final state).
      buffer_len: L >= 1, the number of buffered steps between flushes.
      n_groups: G, the number of B/C groups; must divide nheads.
      buffer_dtype: dtype of the x and B records (dt is always float32).
        Use the activation dtype (e.g. bfloat16) to halve buffer traffic;
        records of bf16 activations are then stored exactly.

    Returns:
      Mamba2ReplayState with cursor 0 for every row.

    Raises:
      TypeError: non-float checkpoint or buffer_dtype, or non-int sizes.
      ValueError: wrong rank, L < 1, or nheads not divisible by n_groups.
    """
    checkpoint = _check_checkpoint(checkpoint, "batch, nheads, head_dim, d_state")
    L = v.check_positive_int("buffer_len", buffer_len)
    G = v.check_positive_int("n_groups", n_groups)
    batch, nheads, head_dim, d_state = checkpoint.shape
    v.check_divisible("nheads", nheads, "n_groups", G)
    buffer_dtype = _check_buffer_dtype(buffer_dtype)
    return Mamba2ReplayState(
        checkpoint=checkpoint,
        x=jnp.zeros((batch, nheads, L, head_dim), buffer_dtype),
        dt=jnp.zeros((batch, nheads, L), jnp.float32),
        B=jnp.zeros((batch, G, L, d_state), buffer_dtype),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def gdn_replay_init(checkpoint, buffer_len: int, num_k_heads: int, buffer_dtype=jnp.float32) -> GDNReplayState:
    """A Gated DeltaNet ReplaySSM state with an empty buffer.

    Args:
      checkpoint: f32 | bf16[batch, HV, V, K], the value-major state to start
        from (transpose the last two axes of a transformers cache).
      buffer_len: L >= 1, the number of buffered steps between flushes.
      num_k_heads: H, the number of key heads; must divide HV.
      buffer_dtype: dtype of the d and k records (g is always float32).

    Returns:
      GDNReplayState with cursor 0 for every row.

    Raises:
      TypeError: non-float checkpoint or buffer_dtype, or non-int sizes.
      ValueError: wrong rank, L < 1, or HV not divisible by H.
    """
    checkpoint = _check_checkpoint(checkpoint, "batch, HV, V, K")
    L = v.check_positive_int("buffer_len", buffer_len)
    H = v.check_positive_int("num_k_heads", num_k_heads)
    batch, HV, V, K = checkpoint.shape
    v.check_divisible("HV (value heads)", HV, "H (key heads)", H)
    buffer_dtype = _check_buffer_dtype(buffer_dtype)
    return GDNReplayState(
        checkpoint=checkpoint,
        d=jnp.zeros((batch, HV, L, V), buffer_dtype),
        k=jnp.zeros((batch, H, L, K), buffer_dtype),
        g=jnp.zeros((batch, HV, L), jnp.float32),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def _check_buffer_dtype(buffer_dtype):
    try:
        dtype = jnp.dtype(buffer_dtype)
    except TypeError:
        raise TypeError(f"`buffer_dtype` must be a floating dtype; got {buffer_dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`buffer_dtype` must be a floating dtype; got {dtype}")
    return dtype


def check_replay_state(state, kind: type) -> None:
    """Raise TypeError / ValueError unless `state` is a consistent `kind`."""
    if not isinstance(state, kind):
        raise TypeError(f"`state` must be a {kind.__name__}; got {type(state).__name__}")
    mamba = kind is Mamba2ReplayState
    v.check_float("state.checkpoint", state.checkpoint, v.STATE_DTYPES)
    v.check_rank("state.checkpoint", state.checkpoint,
                 "batch, nheads, head_dim, d_state" if mamba else "batch, HV, V, K")
    batch, heads, rows, cols = state.checkpoint.shape
    record, key, decay = ("x", "B", "dt") if mamba else ("d", "k", "g")
    axes = ({record: "batch, nheads, L, head_dim", key: "batch, n_groups, L, d_state", decay: "batch, nheads, L"}
            if mamba else {record: "batch, HV, L, V", key: "batch, H, L, K", decay: "batch, HV, L"})
    buffers = {name: getattr(state, name) for name in axes}
    for name, b in buffers.items():
        # records: any floating dtype (the buffer dtype); the decays (processed dt, log g): float32, as init makes
        v.check_float(f"state.{name}", b, (jnp.float32,) if name == decay else None)
        v.check_rank(f"state.{name}", b, axes[name])
    if len({b.shape[2] for b in buffers.values()}) > 1:  # L is axis 2 of each
        raise ValueError("`state`'s buffers must have the same number of slots L (axis 2); got "
                         + ", ".join(f"state.{name} {tuple(b.shape)}" for name, b in buffers.items()))
    if not isinstance(state.cursor, (jax.Array, np.ndarray)):
        raise TypeError(f"`state.cursor` must be an int32 array of shape [batch] = ({batch},); "
                        f"got {type(state.cursor).__name__} {state.cursor!r}")
    L = state.buffer_len
    expected = {record: (batch, heads, L, rows), key: (batch, buffers[key].shape[1], L, cols), decay: (batch, heads, L)}
    for name, shape in expected.items():
        v.check_shape(f"state.{name}", buffers[name], axes[name], shape)
    v.check_shape("state.cursor", state.cursor, "batch", (batch,))
    if state.cursor.dtype != jnp.int32:
        raise TypeError(f"`state.cursor` must be int32; got {state.cursor.dtype}")
    if not isinstance(state.cursor, jax.core.Tracer):  # concrete values are checked; traced ones cannot be
        cursor = np.asarray(state.cursor)
        if ((cursor < 0) | (cursor > L)).any():
            raise ValueError(f"`state.cursor` must be in [0, {L}] (the buffer length) for every row; "
                             f"got {cursor.tolist()}")


def check_no_pending_window(state) -> None:
    """Raise ValueError if `state` holds a verified window not yet committed
    (a step, verify or flush then would drop or double-count its records)."""
    if state.window:
        raise ValueError(f"`state` has a pending verify window (W = {state.window}); call replay_commit first")


def replay_commit(state: ReplayState, num_accepted) -> ReplayState:
    """Accept the first `num_accepted` steps of the pending verify window.

    Commit is a cursor move (DESIGN.md section 3): `cursor += num_accepted`;
    the rejected records stay in their slots as dead entries and are
    overwritten later. The checkpoint is not touched. A row whose cursor
    reaches L is flushed by its next step or verify.

    Args:
      state: a Mamba2ReplayState or GDNReplayState returned by a verify
        (`state.window = W > 0`).
      num_accepted: int[batch], per-sequence counts in 0..W.

    Returns:
      The state with the cursor moved and `window = 0`.

    Raises:
      TypeError: not a replay state, or non-integer counts.
      ValueError: no pending window, counts of the wrong shape, or (when
        the counts are concrete) a count outside 0..W. Inside jit, counts
        are clipped to 0..W.
    """
    if not isinstance(state, (Mamba2ReplayState, GDNReplayState)):
        raise TypeError(f"`state` must be a Mamba2ReplayState or GDNReplayState; got {type(state).__name__}")
    if state.window == 0:
        raise ValueError("`state` has no pending verify window (window = 0); call a replay verify op before replay_commit")
    num_accepted = v.check_int_range("num_accepted", num_accepted, "batch", (state.batch,), 0, state.window)
    # Inside jit the counts cannot be checked; clipping keeps the cursor in 0..L.
    num_accepted = jnp.clip(num_accepted, 0, state.window)
    return state.replace(cursor=state.cursor + num_accepted, window=0)


def slot_mask(count: jax.Array, L: int) -> jax.Array:
    """bool[batch, L]: slot i is live when i < count[row]."""
    return jnp.arange(L)[None, :] < count[:, None]


def write_slots(buffer: jax.Array, records: jax.Array, start: jax.Array) -> jax.Array:
    """Write `records` [batch, heads, W, ...] into `buffer` [batch, heads, L, ...]
    at slots start[row] .. start[row] + W - 1 of each row (start + W <= L)."""

    def one_row(buf, rec, s):
        index = (0, s) + (0,) * (buf.ndim - 2)
        return jax.lax.dynamic_update_slice(buf, rec.astype(buf.dtype), index)

    return jax.vmap(one_row)(buffer, records, start)
