"""The ReplaySSM decode state of one SSM layer, as pytrees.

ReplaySSM (ARCHITECTURE.md, "The math") keeps the recurrent state in memory only as a
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

**8-bit checkpoints.** A checkpoint of dtype int8 or float8_e4m3fn
(:data:`QUANTIZED_DTYPES`) is stored with one float32 scale per row of the
state: `scale` f32[batch, heads, V], taken over the K axis (Mamba-2: one
scale per (head, head_dim row), over d_state; GDN: per (value head, value
row), over the key dim), as FlashInfer's `checkpointing_ssu` stores int8 /
fp8 state. It reads as

    S_c = checkpoint.astype(f32) * scale[..., None]        (:func:`dequantize`)

and every write of the checkpoint (a flush, the direct route's step, an
8-bit init) quantizes the f32 state row by row (:func:`quantize_rows`):
scale = max_k |S[v, k]| / qmax (qmax 127 for int8, 448 for e4m3; a row of
zeros gets scale 1), then S / scale rounded to the format's grid, to
nearest or stochastically (`rounding`, static). Stochastic rounding draws
its uniforms from a counter-based hash (:func:`rounding_uniforms`, integer
ops only, so that the Pallas kernels compute the same bits in-kernel) keyed
by the row's write count `counter` i32[batch], the batch row, the head and
the element: a run is reproducible, and each flush draws fresh numbers.
With a float32 or bfloat16 checkpoint `scale` and `counter` are None.

The functions here hold the data and its bookkeeping only; their arguments
are validated by their namesakes in :mod:`replayssm_jax.ops` (also exported
as `replayssm_jax.mamba2_replay_init`, ...), which call them. Called
directly with bad arguments they may fail with JAX's own errors, or not at
all; use the ops' versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

f32 = jnp.float32

# The 8-bit checkpoint dtypes and the largest magnitude each stores (qmax):
# int8 uses the symmetric range [-127, 127]; float8_e4m3fn's largest finite
# value is 448 = 1.75 * 2^8.
QUANTIZED_DTYPES = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# The checkpoint dtypes of a replay state.
CHECKPOINT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), *QUANTIZED_DTYPES)
# How an 8-bit checkpoint write rounds.
ROUNDINGS = ("nearest", "stochastic")

# e4m3's smallest normal exponent and its mantissa bits: in [2^e, 2^(e+1))
# its grid step is 2^(e - 3); below 2^-6 (subnormals) the step is 2^-9.
_E4M3_MIN_EXP, _E4M3_MANTISSA = -6, 3


def is_quantized(dtype) -> bool:
    """Whether `dtype` is an 8-bit checkpoint dtype (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QUANTIZED_DTYPES


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (Wellons' lowbias32: xorshift-multiply rounds) of uint32 `x`."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_seeds(counter: jax.Array, heads: int) -> jax.Array:
    """u32[batch, heads]: the stochastic rounding's key of each (batch row,
    head) at the row's write count `counter` i32[batch]; a hash of the three."""
    batch = counter.shape[0]
    b = jax.lax.broadcasted_iota(jnp.uint32, (batch, heads), 0)
    h = jax.lax.broadcasted_iota(jnp.uint32, (batch, heads), 1)
    c = jnp.broadcast_to(counter.astype(jnp.uint32)[:, None], (batch, heads))
    return _mix32(_mix32(_mix32(c) ^ (b * np.uint32(0x9E3779B9))) ^ (h * np.uint32(0x85EBCA6B)))


def rounding_uniforms(seed: jax.Array, rows: jax.Array, cols: jax.Array, K: int) -> jax.Array:
    """f32 uniforms in [0, 1) (multiples of 2^-24) for the elements (rows,
    cols) of a V x K state under the key `seed` (u32, from :func:`row_seeds`):
    the top 24 bits of a hash of (seed, row * K + col). Broadcasts its
    arguments; integer ops only, so a Pallas kernel draws the same numbers
    for its tile (rows: global row ids, cols: column ids)."""
    index = rows.astype(jnp.uint32) * np.uint32(K) + cols.astype(jnp.uint32)
    bits = _mix32(seed ^ _mix32(index))
    return (bits >> 8).astype(jnp.int32).astype(f32) * (2.0 ** -24)


def quantize_rows(S: jax.Array, dtype, noise) -> tuple[jax.Array, jax.Array]:
    """Quantize f32 state rows to an 8-bit dtype with one scale per row.

    Args:
      S: f32[..., K], rows of a state (the last axis is the reduction axis).
      dtype: int8 or float8_e4m3fn.
      noise: f32 broadcastable to S, in [0, 1): 0.5 rounds to nearest
        (ties away from -inf), uniforms (:func:`rounding_uniforms`) round
        stochastically, so that E[dequantized] = S.

    Returns:
      (values dtype[..., K], scale f32[...]) with scale = max|row| / qmax
      (1 for a row of zeros: no division by zero) and values = S / scale
      rounded to the format's grid: integers in [-127, 127] for int8; for
      e4m3 multiples of 2^(e - 3) where 2^e <= |S / scale| < 2^(e + 1)
      (2^-9 below 2^-6), within [-448, 448]. Each rounds down when
      frac + noise < 1 and up otherwise. A row with NaN or inf gets a NaN
      or inf scale, so it reads back non-finite, as an f32 state would be.
    """
    dtype = jnp.dtype(dtype)
    qmax = QUANTIZED_DTYPES[dtype]
    amax = jnp.max(jnp.abs(S), axis=-1)
    scale = jnp.where(amax == 0.0, 1.0, amax / qmax)
    x = S / scale[..., None]
    if dtype == jnp.dtype(jnp.int8):
        q = jnp.clip(jnp.floor(x + noise), -qmax, qmax)
        return q.astype(dtype), scale
    # The grid step at |x|: its power of two (the exponent bits of x), times
    # 2^-3, at least the subnormal step.
    binade = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.int32) & 0x7F800000, f32)
    step = jnp.maximum(binade, 2.0 ** _E4M3_MIN_EXP) * (2.0 ** -_E4M3_MANTISSA)
    q = jnp.clip(jnp.floor(x / step + noise) * step, -qmax, qmax)
    return q.astype(dtype), scale


def dequantize(checkpoint: jax.Array, scale: jax.Array | None) -> jax.Array:
    """The checkpoint as f32 values: `checkpoint.astype(f32) * scale[..., None]`
    for an 8-bit checkpoint (scale f32[batch, heads, V]); the checkpoint as
    stored (f32 or bf16) when `scale` is None."""
    if scale is None:
        return checkpoint
    return checkpoint.astype(f32) * scale[..., None]


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
      tree: static, the parents (`DraftTree.parents`) of the draft tree
        whose window is pending, or None (no window, or a chain's): what
        :func:`replayssm_jax.ops.replay_commit` checks a `path` against.
      scale: f32[batch, nheads, head_dim] for an int8 | float8_e4m3fn
        checkpoint (one scale per head_dim row, over d_state), else None.
      counter: i32[batch], checkpoint writes per row (the stochastic
        rounding's key), for an 8-bit checkpoint; else None.
      rounding: static, "nearest" or "stochastic": how an 8-bit checkpoint
        write rounds.
    """

    checkpoint: jax.Array
    x: jax.Array
    dt: jax.Array
    B: jax.Array
    cursor: jax.Array
    window: int = struct.field(pytree_node=False, default=0)
    scale: jax.Array | None = None
    counter: jax.Array | None = None
    rounding: str = struct.field(pytree_node=False, default="nearest")
    tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def buffer_len(self) -> int:
        """L, the number of buffer slots (static)."""
        return self.dt.shape[-1]

    @property
    def batch(self) -> int:
        return self.checkpoint.shape[0]

    @staticmethod
    def buffer_fields() -> tuple[str, ...]:
        """The names of the buffers (one record field each, slot axis 2)."""
        return ("x", "dt", "B")


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
      tree: static, as :class:`Mamba2ReplayState`.
      scale: f32[batch, HV, V] for an int8 | float8_e4m3fn checkpoint (one
        scale per value row, over the key dim K), else None.
      counter, rounding: as :class:`Mamba2ReplayState`.
    """

    checkpoint: jax.Array
    d: jax.Array
    k: jax.Array
    g: jax.Array
    cursor: jax.Array
    window: int = struct.field(pytree_node=False, default=0)
    scale: jax.Array | None = None
    counter: jax.Array | None = None
    rounding: str = struct.field(pytree_node=False, default="nearest")
    tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def buffer_len(self) -> int:
        """L, the number of buffer slots (static)."""
        return self.g.shape[-1]

    @property
    def batch(self) -> int:
        return self.checkpoint.shape[0]

    @staticmethod
    def buffer_fields() -> tuple[str, ...]:
        """The names of the buffers (one record field each, slot axis 2)."""
        return ("d", "k", "g")


ReplayState = Mamba2ReplayState | GDNReplayState


def as_f32_checkpoint(state: ReplayState) -> ReplayState:
    """`state` with an 8-bit checkpoint read as f32 (:func:`dequantize`; scale
    and counter None): a plain replay state on the same numbers. A float32
    or bfloat16 state is returned as it is."""
    if state.scale is None:
        return state
    return state.replace(checkpoint=dequantize(state.checkpoint, state.scale), scale=None, counter=None)


def write_noise(shape, counter: jax.Array, rounding: str) -> jax.Array | float:
    """The rounding noise of a write of a whole checkpoint of `shape`
    (batch, heads, V, K): 0.5 (nearest) or f32[batch, heads, V, K] uniforms
    (stochastic) at the rows' write counts `counter` i32[batch]."""
    if rounding == "nearest":
        return 0.5
    _, heads, V, K = shape
    seeds = row_seeds(counter, heads)[:, :, None, None]
    rows = jax.lax.broadcasted_iota(jnp.int32, (V, K), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (V, K), 1)
    return rounding_uniforms(seeds, rows, cols, K)


def quantized_checkpoint(S: jax.Array, dtype, rounding: str = "nearest", counter: jax.Array | None = None):
    """(checkpoint, scale, counter) of a replay state whose checkpoint holds
    f32 `S` [batch, heads, V, K] in `dtype`: S cast (scale, counter None) for
    f32 | bf16; for an 8-bit dtype, S quantized (:func:`quantize_rows`) with
    write count 0 (or `counter`), as the first write of the rows."""
    if not is_quantized(dtype):
        return S.astype(dtype), None, None
    counter = jnp.zeros((S.shape[0],), jnp.int32) if counter is None else counter
    values, scale = quantize_rows(S.astype(f32), dtype, write_noise(S.shape, counter, rounding))
    return values, scale, counter


def write_checkpoint(state: ReplayState, S: jax.Array, rows: jax.Array | None = None) -> ReplayState:
    """`state` with checkpoint <- S (f32[batch, heads, V, K]) in the rows
    where `rows` (bool[batch]; None: every row), in the checkpoint's dtype:
    a cast for f32 | bf16, a row-wise quantization for an 8-bit checkpoint
    (its scale written with it, its write count advanced by one in those
    rows). The cursor is not moved."""
    if state.scale is None:
        values = S.astype(state.checkpoint.dtype)
        if rows is not None:
            values = jnp.where(rows[:, None, None, None], values, state.checkpoint)
        return state.replace(checkpoint=values)
    values, scale = quantize_rows(S, state.checkpoint.dtype,
                                  write_noise(S.shape, state.counter, state.rounding))
    written = jnp.ones_like(state.cursor, bool) if rows is None else rows
    return state.replace(checkpoint=jnp.where(written[:, None, None, None], values, state.checkpoint),
                         scale=jnp.where(written[:, None, None], scale, state.scale),
                         counter=state.counter + written.astype(jnp.int32))


def step_writes(state: ReplayState, route: str) -> jax.Array:
    """bool[batch]: the rows whose checkpoint a replay step on `route` writes:
    every row on the direct route, none on the append route, the full rows
    (cursor == L at entry) on the deferred route, else the rows that flush
    (cursor >= L - 1 at entry)."""
    if route == "direct":
        return jnp.ones_like(state.cursor, bool)
    if route == "append":
        return jnp.zeros_like(state.cursor, bool)
    return state.cursor >= state.buffer_len - (route != "deferred")


def window_writes(state: ReplayState, W: int) -> jax.Array:
    """bool[batch]: the rows whose checkpoint a verify window of W steps
    writes: the early flush's, cursor + W > L."""
    return state.cursor + W > state.buffer_len


def advance_counter(state: ReplayState, written: jax.Array) -> ReplayState:
    """`state` with the write count of the rows where `written` (bool[batch])
    advanced by one (an 8-bit checkpoint written by the kernels); unchanged
    for f32 | bf16."""
    if state.counter is None:
        return state
    return state.replace(counter=state.counter + written.astype(jnp.int32))


def _initial_checkpoint(checkpoint, checkpoint_dtype, rounding) -> dict:
    """The checkpoint fields of a new replay state: `checkpoint` as given
    (checkpoint_dtype None), or stored in `checkpoint_dtype`."""
    if checkpoint_dtype is None:
        return dict(checkpoint=checkpoint)
    values, scale, counter = quantized_checkpoint(checkpoint, checkpoint_dtype, rounding)
    return dict(checkpoint=values, scale=scale, counter=counter, rounding=rounding)


def mamba2_replay_init(checkpoint: jax.Array, buffer_len: int, n_groups: int, buffer_dtype=jnp.float32,
                       checkpoint_dtype=None, rounding: str = "nearest") -> Mamba2ReplayState:
    """A Mamba-2 ReplaySSM state with an empty buffer (cursor 0 in every row):
    `checkpoint` f32 | bf16[batch, nheads, head_dim, d_state], stored in
    `checkpoint_dtype` (None: its own; int8 | float8_e4m3fn: quantized with
    `rounding`), L = buffer_len slots of x and B records in `buffer_dtype`
    (dt in float32), `n_groups` groups of B. Arguments as validated by
    :func:`replayssm_jax.ops.mamba2_replay_init`."""
    batch, nheads, head_dim, d_state = checkpoint.shape
    return Mamba2ReplayState(
        **_initial_checkpoint(checkpoint, checkpoint_dtype, rounding),
        x=jnp.zeros((batch, nheads, buffer_len, head_dim), buffer_dtype),
        dt=jnp.zeros((batch, nheads, buffer_len), jnp.float32),
        B=jnp.zeros((batch, n_groups, buffer_len, d_state), buffer_dtype),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def gdn_replay_init(checkpoint: jax.Array, buffer_len: int, num_k_heads: int, buffer_dtype=jnp.float32,
                    checkpoint_dtype=None, rounding: str = "nearest") -> GDNReplayState:
    """A Gated DeltaNet ReplaySSM state with an empty buffer (cursor 0 in every
    row): `checkpoint` f32 | bf16[batch, HV, V, K] (value-major), stored in
    `checkpoint_dtype` as :func:`mamba2_replay_init`, L = buffer_len slots of
    d and k records in `buffer_dtype` (g in float32), `num_k_heads` key
    heads. Arguments as validated by :func:`replayssm_jax.ops.gdn_replay_init`."""
    batch, HV, V, K = checkpoint.shape
    return GDNReplayState(
        **_initial_checkpoint(checkpoint, checkpoint_dtype, rounding),
        d=jnp.zeros((batch, HV, buffer_len, V), buffer_dtype),
        k=jnp.zeros((batch, num_k_heads, buffer_len, K), buffer_dtype),
        g=jnp.zeros((batch, HV, buffer_len), jnp.float32),
        cursor=jnp.zeros((batch,), jnp.int32),
    )


def replay_commit(state: ReplayState, num_accepted: jax.Array, path: jax.Array | None = None) -> ReplayState:
    """Accept the first `num_accepted` (int[batch]) steps of the pending
    verify window: `cursor += num_accepted`, `window = 0` (ARCHITECTURE.md, "The verify window").
    The counts are clipped to 0..W, which keeps the cursor in 0..L where
    they cannot be checked (inside jit). Arguments as validated by
    :func:`replayssm_jax.ops.replay_commit`.

    With `path` i32[batch, P] (a verified draft tree's accepted nodes, root
    first), the records of nodes path[b, :m] are first gathered to slots
    cursor .. cursor + m - 1 of row b (:func:`gather_path`); node j's
    record is at slot cursor + j after the verify."""
    num_accepted = jnp.clip(num_accepted, 0, state.window)
    if path is not None:
        num_accepted = jnp.minimum(num_accepted, path.shape[1])
        buffers = {name: gather_path(getattr(state, name), state.cursor, path, num_accepted)
                   for name in state.buffer_fields()}
        state = state.replace(**buffers)
    return state.replace(cursor=state.cursor + num_accepted, window=0, tree=None)


def gather_path(buffer: jax.Array, start: jax.Array, path: jax.Array, count: jax.Array, axis: int = 2) -> jax.Array:
    """`buffer` [batch, ..., L, ...] (slots on `axis`) with slot start + i of
    row b set to slot start + path[b, i] for i < count[b], the other slots as
    they are: a verified tree's records (node j at slot start + j) compacted
    to the accepted path root .. path[b, count[b] - 1].

    A path's nodes increase (a parent precedes its child), so path[i] >= i:
    one gather of the old buffer. XLA runs it in place where the buffer is
    donated.
    """
    L = buffer.shape[axis]
    slot = jnp.arange(L, dtype=jnp.int32)[None, :]  # [1, L]
    i = slot - start[:, None]  # the depth each slot takes, where it is in the accepted range
    taken = (i >= 0) & (i < count[:, None])
    node = jnp.take_along_axis(path, jnp.clip(i, 0, path.shape[1] - 1), axis=1)
    source = jnp.where(taken, start[:, None] + node, slot)  # [batch, L]
    shape = [1] * buffer.ndim
    shape[0], shape[axis] = buffer.shape[0], L
    index = jnp.broadcast_to(source.reshape(shape), buffer.shape)
    return jnp.take_along_axis(buffer, index, axis=axis)


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
        zero = jnp.zeros((), s.dtype)  # indices of one dtype (Python 0 is int64 under jax_enable_x64)
        index = (zero, s) + (zero,) * (buf.ndim - 2)
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
