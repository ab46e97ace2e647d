"""Per-layer decode states, as typed pytrees (`flax.struct` dataclasses).

An SSM layer (Mamba-2 mixer or Gated DeltaNet) decodes from either

- `SSMLayerState`: the standard path: a `ConvWindow` plus the full recurrent
  ``ssm_state``, read and written every step; or
- `ReplayLayerState`: the ReplaySSM path: a `ConvWindow` plus a
  `replayssm_jax.state.Mamba2ReplayState` / `GDNReplayState` (checkpoint, ring
  buffer of the last inputs, per-row cursor).

An attention layer decodes from a `KVCache` of fixed maximum length with one
length per sequence. Layers without state (MLP, MoE) use ``None``.

The layer's ``decode`` method dispatches on the type of the state it is given;
the choice is static (part of the pytree structure), so one jitted decode step
serves one path.

Speculative decoding (ARCHITECTURE.md, "The verify window" and "Speculative decoding"): a layer's ``verify`` runs W
positions at once and returns its state with the window *pending*; `commit`
then keeps the first m of them (m = num_accepted, 0..W per row):

- `ConvWindow`: the W new conv inputs are written into free ring slots; commit
  moves the ring's start by m (an offset, no copy);
- `SSMLayerState` (the standard baseline, as vLLM and tpu-inference do it):
  in the slotted layout (W + 1 states per row, ``index`` the current one)
  verify writes the state after each of the W positions to its own slot in
  one launch; commit moves the index to the m-th (m = 0: unchanged), with
  no copy;
- `ReplayLayerState`: verify writes W records after the cursor; commit is
  ``cursor += m`` (`replayssm_jax.ops.replay_commit`);
- `KVCache`: verify writes K/V at length..length+W-1; commit is ``length += m``
  (the rejected entries are overwritten later).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from replayssm_jax import state as _state
from replayssm_jax.ops import validate
from replayssm_jax.ops.validate import check_commit_path
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

__all__ = ["ConvWindow", "SSMLayerState", "ReplayLayerState", "KVCache", "LayerState", "commit_layer_state",
           "committed_index", "pending_window", "check_num_accepted", "check_commit_path"]


@struct.dataclass
class ConvWindow:
    """The last conv inputs of one layer, in a ring that steps and rolls back in place.

    With conv width W (config `conv_kernel`), the live inputs are the last
    W - 1, at ring slots start, start + 1, ..., start + W - 2 (mod S), oldest
    first. A decode step writes its input at slot start + W - 1 and moves
    start by one; a verify of T <= max_window inputs writes them at slots
    start + W - 1 .. start + W + T - 2 and leaves start alone; a commit of m of
    them moves start by m. The S = (W - 1) + max_window slots hold the live
    inputs and a whole window at once, so a commit of 0 still finds the
    inputs before the window. Every update writes only the new columns.

    Attributes:
      columns: [batch, S, conv_dim], the ring (time-major, activation dtype).
      start: i32[batch], ring slot of the oldest live input, in [0, S).
      width: static int, W.
    """

    columns: jax.Array
    start: jax.Array
    width: int = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.columns.shape[0]

    @property
    def slots(self) -> int:
        """S, the ring length (static)."""
        return self.columns.shape[1]

    @property
    def max_window(self) -> int:
        """The most inputs one verify may write (static): S - (W - 1)."""
        return self.slots - (self.width - 1)

    @classmethod
    def from_conv_state(cls, conv_state: jax.Array, max_window: int = 1) -> "ConvWindow":
        """The ring holding `conv_state` [batch, conv_dim, W - 1] (oldest first) at slots 0..W-2,
        with room for verify windows of up to `max_window` (>= 1) inputs."""
        batch, channels, live = conv_state.shape
        columns = jnp.zeros((batch, live + max_window, channels), conv_state.dtype)
        columns = columns.at[:, :live].set(jnp.swapaxes(conv_state, 1, 2))
        return cls(columns=columns, start=jnp.zeros((batch,), jnp.int32), width=live + 1)

    def ring_slots(self, offset: int, count: int) -> jax.Array:
        """i32[batch, count]: the ring slots of positions offset .. offset + count - 1 after start."""
        return (self.start[:, None] + offset + jnp.arange(count, dtype=jnp.int32)[None, :]) % self.slots

    def live(self) -> jax.Array:
        """[batch, W - 1, conv_dim]: the live inputs, oldest first."""
        return jnp.take_along_axis(self.columns, self.ring_slots(0, self.width - 1)[:, :, None], axis=1)

    def conv_state(self) -> jax.Array:
        """[batch, conv_dim, W - 1]: the live inputs in the mamba_ssm `conv_state` layout."""
        return jnp.swapaxes(self.live(), 1, 2)

    def write(self, x: jax.Array) -> "ConvWindow":
        """Write x [batch, T, conv_dim] (T <= max_window) after the live inputs; start unchanged."""
        # One select per new column over the ring (elementwise; T <= max_window is small). A scatter at the
        # per-row slots compiles, in an XLA decode loop on the CPU, to one more copy of the ring per step.
        slots = self.ring_slots(self.width - 1, x.shape[1])
        ring = jnp.arange(self.slots, dtype=jnp.int32)[None, :, None]
        columns = self.columns
        for t in range(x.shape[1]):
            columns = jnp.where(ring == slots[:, t, None, None], x[:, t, None, :].astype(columns.dtype), columns)
        return self.replace(columns=columns)

    def keep_path(self, path: jax.Array, count: jax.Array) -> "ConvWindow":
        """After a verify of a draft tree's T nodes (node j's input at position W - 1 + j after start):
        positions W - 1 + i hold the inputs of nodes path[:, i] for i < count (i32[batch]), the path
        root first, so that ``advance(count)`` keeps the accepted path; start unchanged.

        path: i32[batch, P], increasing along each row (a parent precedes its child), so every input is
        read before a write could reach it.
        """
        offset = self.width - 1
        sources = (self.start[:, None] + offset + path) % self.slots  # [batch, P]
        taken = jnp.take_along_axis(self.columns, sources[:, :, None], axis=1)  # [batch, P, conv_dim]
        targets = self.ring_slots(offset, path.shape[1])
        ring = jnp.arange(self.slots, dtype=jnp.int32)[None, :, None]
        columns = self.columns
        for i in range(path.shape[1]):
            here = (ring == targets[:, i, None, None]) & (i < count)[:, None, None]
            columns = jnp.where(here, taken[:, i, None, :], columns)
        return self.replace(columns=columns)

    def advance(self, count: jax.Array | int) -> "ConvWindow":
        """Move start by `count` (int or i32[batch]): the newest written inputs become live."""
        return self.replace(start=(self.start + count) % self.slots)


@struct.dataclass
class SSMLayerState:
    """Standard decode state of one SSM layer, plain or slotted.

    Plain (``index`` None): ``ssm_state`` is the recurrent state, read and
    written by every step. Slotted (the per-draft layout of speculative
    decoding, as vLLM keeps it): ``ssm_state`` holds S states per row and
    ``index`` the slot of each row's current state; a verify of W <= S - 1
    positions writes the state after position t (of a tree: node t) to
    slot (index + 1 + t) mod S, never to the current slot, and a commit of
    m positions moves the index to the accepted position's slot (m = 0:
    unchanged), copying no state. `SSMMixer.with_window` makes the slotted
    layout (S = max_window + 1) once, before the first verify; a decode
    step on it is a verify of one position and a commit of one.

    Attributes:
      conv_state: `ConvWindow`, the last W - 1 conv inputs.
      ssm_state: the recurrent state(s), f32 | bf16. Plain: Mamba-2 [batch,
        nheads, head_dim, d_state]; GDN [batch, HV, V, K] (value-major;
        transformers stores [.., K, V]). Slotted: [batch, S, ...] of those.
      index: None (plain), or i32[batch] in 0..S - 1 (slotted).
      window: static int, the pending verify window W (0 if none): its
        states are written, ``index`` not yet moved.
      tree: static, the parents of the pending window's draft tree (None:
        no window, or a chain's), which ``commit`` checks a path against.
    """

    conv_state: ConvWindow
    ssm_state: jax.Array
    index: jax.Array | None = None
    window: int = struct.field(pytree_node=False, default=0)
    tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def slots(self) -> int:
        """S, the states kept per row (static; 0: the plain layout)."""
        return 0 if self.index is None else self.ssm_state.shape[1]

    def current_state(self) -> jax.Array:
        """The recurrent state of every row, [batch, heads, V, K] (a gather of the slotted layout's
        current slots; no window may be pending). Raises ValueError with a pending window."""
        if self.window:
            raise ValueError(f"`state` has a pending verify window (W = {self.window}); commit it first")
        if self.index is None:
            return self.ssm_state
        return jnp.take_along_axis(self.ssm_state, self.index.reshape((-1,) + (1,) * (self.ssm_state.ndim - 1)),
                                   axis=1)[:, 0]

    def slotted(self, slots: int) -> "SSMLayerState":
        """This state in the slotted layout of `slots` (>= 2) states per row, the current state at slot 0:
        one copy, made when speculation starts. A slotted state of `slots` slots is returned as is."""
        if self.slots == slots:
            return self
        current = self.current_state()
        ssm_state = jnp.zeros((current.shape[0], slots, *current.shape[1:]), current.dtype).at[:, 0].set(current)
        return self.replace(ssm_state=ssm_state, index=jnp.zeros((current.shape[0],), jnp.int32))


@struct.dataclass
class ReplayLayerState:
    """ReplaySSM decode state of one SSM layer.

    Attributes:
      conv_state: `ConvWindow`, the last W - 1 conv inputs.
      replay: Mamba2ReplayState (Mamba-2) or GDNReplayState (GDN); its
        ``checkpoint`` has the layout of SSMLayerState.ssm_state and its
        static ``window`` is the pending verify window (0 if none).
    """

    conv_state: ConvWindow
    replay: Mamba2ReplayState | GDNReplayState

    @property
    def window(self) -> int:
        """The pending verify window W (0 if none; static)."""
        return self.replay.window

    @property
    def tree(self) -> tuple[int, ...] | None:
        """The parents of the pending window's draft tree (None: no window, or a chain's; static)."""
        return self.replay.tree


@struct.dataclass
class KVCache:
    """Fixed-length key/value cache of one attention layer.

    Attributes:
      k: [batch, max_len, num_key_value_heads, head_dim], keys after RoPE / k_norm.
      v: [batch, max_len, num_key_value_heads, head_dim].
      length: i32[batch], valid positions per sequence; the next token is
        written at (and has position) ``length``. Nothing checks for overflow
        under jit: a write at length >= max_len is clamped by XLA onto the last
        slots, so callers size max_len for prompt + new tokens.
      window: static int, the pending verify window W (0 if none): K/V of
        positions length..length+W-1 are written, length not yet moved.
      tree: static, as :class:`SSMLayerState`.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    window: int = struct.field(pytree_node=False, default=0)
    tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @classmethod
    def zeros(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache (length 0 everywhere)."""
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32))


LayerState = SSMLayerState | ReplayLayerState | KVCache | None


def pending_window(state: LayerState) -> int:
    """The pending verify window W of one layer's state (0: none, or a state-less layer; static)."""
    return 0 if state is None else state.window


def commit_layer_state(state: LayerState, num_accepted: jax.Array, path: jax.Array | None = None) -> LayerState:
    """Keep the first `num_accepted` (i32[batch], clipped to 0..W) positions of a verified window.

    The counts are validated by the callers (`replayssm_jax.layers` ``commit``
    methods, ``HybridCausalLM.commit``); inside jit they are clipped to 0..W.
    `SSMLayerState` (slotted): the index moves to the slot of the state
    after m positions (m = 0: unchanged; `committed_index`), no copy;
    `ReplayLayerState`: ``cursor += m``; `KVCache`: ``length += m``; the
    conv window's start moves by m. None (MLP, MoE) passes through.

    With `path` (i32[batch, P], a verified draft tree's accepted nodes per
    row, root first; m <= P), the positions kept are those of nodes
    path[:, :m], first compacted to contiguous positions: the replay
    records (:func:`replayssm_jax.state.replay_commit`), the K/V entries
    (length + i <- length + path[i]) and the conv inputs
    (`ConvWindow.keep_path`); `SSMLayerState`'s index moves to the slot
    of node path[:, m - 1]. path None: the first m positions (a chain).
    """
    if state is None:
        return None
    m = jnp.clip(num_accepted, 0, state.window).astype(jnp.int32)
    if path is not None:
        m = jnp.minimum(m, path.shape[1])
    if isinstance(state, KVCache):
        if path is not None:
            state = state.replace(**{name: _state.gather_path(getattr(state, name), state.length, path, m, axis=1)
                                     for name in ("k", "v")})
        return state.replace(length=state.length + m, window=0, tree=None)
    conv_state = state.conv_state if path is None else state.conv_state.keep_path(path, m)
    conv_state = conv_state.advance(m)
    if isinstance(state, ReplayLayerState):
        return ReplayLayerState(conv_state=conv_state, replay=_state.replay_commit(state.replay, m, path))
    return state.replace(conv_state=conv_state, index=committed_index(state.index, state.slots, m, path), window=0,
                         tree=None)


def committed_index(index: jax.Array, slots: int, num_accepted: jax.Array, path: jax.Array | None = None):
    """i32[batch]: a slotted standard state's index after a commit of `num_accepted` (i32[batch], in
    0..W) positions of a per-draft verify (node t's state at slot (index + 1 + t) mod slots): the slot
    of the last kept position (of a tree: node path[:, m - 1]); index where m = 0."""
    last = jnp.maximum(num_accepted - 1, 0)  # the last kept position (or node)
    if path is not None:
        last = jnp.take_along_axis(path, last[:, None], axis=1)[:, 0]
    return jnp.where(num_accepted == 0, index, (index + 1 + last) % slots).astype(jnp.int32)


def check_sizes(owner: str, **sizes) -> None:
    """Check a layer's sizes at construction: each an int >= 1.

    Raises:
      TypeError: a size not an int; ValueError: a size below 1; each naming `owner` (e.g. "Attention")
      and the argument.
    """
    for name, value in sizes.items():
        try:
            validate.check_positive_int(name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}") from None


def check_input(where: str, name: str, x, hidden: int, batch: int | None, seq: str | None = None) -> None:
    """Check a layer's input `x`: [batch, hidden], or with `seq` (the axis letter, "T" or "W")
    [batch, seq, hidden] with seq >= 1; `batch` None: any batch.

    Raises:
      TypeError: `x` of a dtype other than float32 or bfloat16 (an integer dtype, or float16, which
        overflows in the SSM recurrences: replayssm_jax.ops.validate).
      ValueError: naming `where` (e.g. "Attention.decode") and `name`, with the shape asked and given.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.dtype(dtype) not in validate.STATE_DTYPES:
        why = f" ({validate.FLOAT16_OVERFLOWS})" if jnp.dtype(dtype) == jnp.float16 else ""
        raise TypeError(f"{where}: `{name}` must have dtype float32 or bfloat16; got {jnp.dtype(dtype)}{why}")
    shape = getattr(x, "shape", None)
    fits = (shape is not None and len(shape) == (3 if seq else 2) and shape[-1] == hidden
            and (batch is None or shape[0] == batch) and (not seq or shape[1] >= 1))
    if not fits:
        axes = f"[batch, {seq}, hidden]" if seq else "[batch, hidden]"
        want = f"hidden = {hidden}" + ("" if batch is None else f", batch = {batch}") + (f", {seq} >= 1" if seq else "")
        got = f"shape {tuple(shape)}" if shape is not None else f"a {type(x).__name__}"
        raise ValueError(f"{where}: `{name}` must have shape {axes} with {want}; got {got}")


def check_num_accepted(num_accepted, batch: int, window: int) -> jax.Array:
    """`num_accepted` as i32[batch] in 0..window (values checked where concrete).

    Raises:
      TypeError: a non-integer dtype.
      ValueError: another shape, or a concrete count outside 0..window.
    """
    return validate.check_int_range("num_accepted", num_accepted, "batch", (batch,), 0, window)
