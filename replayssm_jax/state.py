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

The functions here hold the data and its bookkeeping only; their arguments
are validated by their namesakes in :mod:`replayssm_jax.ops` (also exported
as `replayssm_jax.mamba2_replay_init`, ...), which call them. Called
directly with bad arguments they may fail with JAX's own errors, or not at
all; use the ops' versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


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


def mamba2_replay_init(checkpoint: jax.Array, buffer_len: int, n_groups: int,
                       buffer_dtype=jnp.float32) -> Mamba2ReplayState:
    """A Mamba-2 ReplaySSM state with an empty buffer (cursor 0 in every row):
    `checkpoint` f32 | bf16[batch, nheads, head_dim, d_state], L = buffer_len
    slots of x and B records in `buffer_dtype` (dt in float32), `n_groups`
    groups of B. Arguments as validated by :func:`replayssm_jax.ops.mamba2_replay_init`."""
    batch, nheads, head_dim, d_state = checkpoint.shape
    return Mamba2ReplayState(
        checkpoint=checkpoint,
        x=jnp.zeros((batch, nheads, buffer_len, head_dim), buffer_dtype),
        dt=jnp.zeros((batch, nheads, buffer_len), jnp.float32),
        B=jnp.zeros((batch, n_groups, buffer_len, d_state), buffer_dtype),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def gdn_replay_init(checkpoint: jax.Array, buffer_len: int, num_k_heads: int,
                    buffer_dtype=jnp.float32) -> GDNReplayState:
    """A Gated DeltaNet ReplaySSM state with an empty buffer (cursor 0 in every
    row): `checkpoint` f32 | bf16[batch, HV, V, K] (value-major), L =
    buffer_len slots of d and k records in `buffer_dtype` (g in float32),
    `num_k_heads` key heads. Arguments as validated by
    :func:`replayssm_jax.ops.gdn_replay_init`."""
    batch, HV, V, K = checkpoint.shape
    return GDNReplayState(
        checkpoint=checkpoint,
        d=jnp.zeros((batch, HV, buffer_len, V), buffer_dtype),
        k=jnp.zeros((batch, num_k_heads, buffer_len, K), buffer_dtype),
        g=jnp.zeros((batch, HV, buffer_len), jnp.float32),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def replay_commit(state: ReplayState, num_accepted: jax.Array) -> ReplayState:
    """Accept the first `num_accepted` (int[batch]) steps of the pending
    verify window: `cursor += num_accepted`, `window = 0` (DESIGN.md section 3).
    The counts are clipped to 0..W, which keeps the cursor in 0..L where
    they cannot be checked (inside jit). Arguments as validated by
    :func:`replayssm_jax.ops.replay_commit`."""
    num_accepted = jnp.clip(num_accepted, 0, state.window)
    return state.replace(cursor=state.cursor + num_accepted, window=0)


def slot_mask(count: jax.Array, L: int) -> jax.Array:
    """bool[batch, L]: slot i is live when i < count[row]."""
    return jnp.arange(L)[None, :] < count[:, None]


def write_slots(buffer: jax.Array, records: jax.Array, start: jax.Array) -> jax.Array:
    """Write `records` [batch, heads, W, ...] into `buffer` [batch, heads, L, ...]
    at slots start[row] .. start[row] + W - 1 of each row (start + W <= L).

    XLA writes the slots in place when every read of the old `buffer` is
    ordered before the write (see :func:`in_order`).
    """

    def one_row(buf, rec, s):
        index = (0, s) + (0,) * (buf.ndim - 2)
        return jax.lax.dynamic_update_slice(buf, rec.astype(buf.dtype), index)

    return jax.vmap(one_row)(buffer, records, start)


def in_order(first, then):
    """(first, then), returned through `jax.lax.optimization_barrier`: whatever
    consumes the returned values runs after all of both was computed.

    A replay step reads its old buffers and cursor, then overwrites them; XLA
    updates a loop-carried array in place only where every read of the old
    value is ordered (by data) before the write, and copies it otherwise.
    Passing the old arrays (`first`) together with the values read from them
    (`then`) through one barrier gives the writes that order.
    """
    return jax.lax.optimization_barrier((first, then))
