"""The three modes shared by the SSM token mixers (`Mamba2Mixer`, `GatedDeltaNet`).

A mixer projects its input, runs the causal conv, and hands the SSM inputs to
the ops of its layer type in :mod:`replayssm_jax.ops`:

- `prefill`: the chunked form (`chunked_op`, e.g. ``ops.mamba2_chunked``);
  returns the outputs and an `SSMLayerState` whose ssm_state is the
  checkpoint (final SSM state);
- `decode` with an `SSMLayerState`: one standard step (`step_op`; on the
  slotted layout, a per-draft verify of one position and its commit);
- `decode` with a `ReplayLayerState`: one ReplaySSM step (`replay_step_op`),
  on a state built by `to_replay` (`replay_init_op`);
- `verify` of W speculative positions and `commit` of the first m of them
  (ARCHITECTURE.md, "Speculative decoding"): with a `ReplayLayerState` the op's verify window
  (`replay_verify_op`) and ``replay_commit``; with an `SSMLayerState` (the
  standard baseline, in its slotted layout) the per-draft verify
  (`verify_op`: one launch writes the state after each position to its own
  slot) and an index move.

A subclass binds those six class attributes to its layer's functions of
:mod:`replayssm_jax.ops` and gives `_ssm_inputs` (the projections, conv and
splits), `_op_params`, `_replay_init_params` and `_finish`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax.ops import validate
from replayssm_jax.layers.cache import (
    ConvWindow,
    ReplayLayerState,
    SSMLayerState,
    check_input,
    check_num_accepted,
    check_commit_path,
    check_sizes,
    commit_layer_state,
)

# The name scope of the SSM state ops in decode and verify: a profile or roofline tells their work (the
# kernels, or the reference's XLA ops and dots on the "xla" backend) from the layer's projections by it.
SSM_SCOPE = "ssm_state_op"


class SSMMixer(nnx.Module):
    """Base of the SSM token mixers: prefill, standard and ReplaySSM decode."""

    # The layer's ops (functions of replayssm_jax.ops), bound by each subclass.
    chunked_op: ClassVar[Callable]  # prefill: (state | None, **inputs, chunk_size, **params) -> (y, state)
    step_op: ClassVar[Callable]  # standard decode: (ssm_state, **inputs, **params) -> (y, ssm_state)
    replay_step_op: ClassVar[Callable]  # ReplaySSM decode: (replay, **inputs, route, **params) -> (y, replay)
    replay_init_op: ClassVar[Callable]  # (checkpoint, buffer_len, heads or groups, buffer_dtype, checkpoint_dtype,
    #                                     rounding) -> replay state
    replay_verify_op: ClassVar[Callable]  # (replay, **inputs [batch, W, ...], **params) -> (y, replay with window W)
    verify_op: ClassVar[Callable]  # per-draft standard verify: (slotted ssm_state, index, **inputs [batch, W, ...],
    #                                **params, tree) -> (y, slotted ssm_state)

    # Hooks each layer defines (Mamba2Mixer, GatedDeltaNet); the base has no default.

    def _ssm_inputs(self, u, conv_state, conv):
        """(SSM op inputs as keywords, gate z, new conv_state); `conv` is `self.conv1d` (a whole sequence),
        `self.conv1d.verify` (a window) or `self.conv1d.step` (one token), each called as
        ``conv(x, conv_state, offset=, splits=)`` on a packed projection."""
        raise NotImplementedError(f"{type(self).__name__} must define _ssm_inputs")

    def _fused_step(self, u, state: SSMLayerState, backend: str | None):
        """(out, new state) of a standard decode step whose conv runs inside the SSM step's launch, where
        the layer has such a kernel and takes it for this step (GatedDeltaNet), else None: the conv and
        the step as two ops."""
        del u, state, backend
        return None

    def _op_params(self) -> dict:
        """Keyword parameters of every op call (A, D, dt_bias, ... or use_qk_l2norm)."""
        raise NotImplementedError(f"{type(self).__name__} must define _op_params")

    def _replay_init_params(self) -> dict:
        """Keyword parameters of `replay_init_op` besides the checkpoint, L and buffer dtype (n_groups or
        num_k_heads)."""
        raise NotImplementedError(f"{type(self).__name__} must define _replay_init_params")

    def _finish(self, y, z):
        """The layer output from the SSM output y and gate z (gated norm, then out_proj)."""
        raise NotImplementedError(f"{type(self).__name__} must define _finish")

    def state_dims(self) -> tuple[int, int, int]:
        """The ssm_state's (heads, rows, columns) per batch row: Mamba-2 (H, P, N), GDN (HV, V, K)."""
        raise NotImplementedError(f"{type(self).__name__} must define state_dims")

    def exact_buffer_dtype(self, state: SSMLayerState):
        """The narrowest dtype that holds this layer's ReplaySSM records exactly, for `state` (the dtype
        `to_replay` takes for buffer_dtype None)."""
        raise NotImplementedError(f"{type(self).__name__} must define exact_buffer_dtype")

    def __call__(self, u: jax.Array, *, backend: str | None = None) -> jax.Array:
        """Full forward, no cache. u: [batch, T, hidden] -> [batch, T, hidden]."""
        return self.prefill(u, backend=backend)[0]

    def prefill(self, u: jax.Array, state: SSMLayerState | None = None, *,
                backend: str | None = None) -> tuple[jax.Array, SSMLayerState]:
        """Chunked prefill.

        Args:
          u: [batch, T, hidden], the normalised layer input.
          state: None (empty prefix) or an `SSMLayerState` to continue from.
          backend: the model's replayssm_jax.ops backend; the chunked op runs on
            ``ops.backend_for(op, backend)`` (its XLA form where it has no kernel).

        Returns:
          (out [batch, T, hidden] of the layer's compute dtype (jnp.result_type
          of u and the parameters: float32 unless both are bfloat16; so are
          decode's and verify's outputs), SSMLayerState with conv_state a
          `ConvWindow` (columns [batch, W, conv_dim] of that dtype: a ring of the
          last W - 1 conv inputs and one free slot, max_window 1) and
          ssm_state = the checkpoint (the layer's state layout,
          ssm_state_dtype)).

        Raises:
          TypeError: `state` not an `SSMLayerState`; `u` not float32 or bfloat16.
          ValueError: `u` not [batch, T, hidden] with T >= 1 (and the state's batch); a state of another
            layer's shape, or with a pending verify window.
        """
        if state is not None:
            self._check_state(state, "prefill", (SSMLayerState,))
        self._check_input(u, "prefill", None if state is None else state.conv_state.batch, window=True)
        inputs, z, conv_state = self._ssm_inputs(u, None if state is None else state.conv_state.conv_state(),
                                                 self.conv1d)
        y, ssm_state = self.chunked_op(None if state is None else state.current_state(), **inputs,
                                       chunk_size=self.chunk_size,
                                       backend=ops.backend_for(self.chunked_op.__name__, backend),
                                       **self._op_params())
        return self._finish(y, z), SSMLayerState(conv_state=ConvWindow.from_conv_state(conv_state),
                                                 ssm_state=ssm_state.astype(self.ssm_state_dtype))

    def to_replay(self, state: SSMLayerState, buffer_len: int, buffer_dtype=None, checkpoint_dtype=None,
                  rounding: str = "nearest") -> ReplayLayerState:
        """ReplaySSM state whose checkpoint is `state.ssm_state` (cursor 0), buffer of L = buffer_len steps
        (>= 1; <= 64 for the kernel backends, replayssm_jax.ops.check_buffer_len) of records in
        `buffer_dtype` (None: `exact_buffer_dtype`, the narrowest that holds them exactly); the checkpoint
        stored in `checkpoint_dtype` (None: the state's dtype; int8 or float8_e4m3fn: quantized per row
        with `rounding`, "nearest" or "stochastic": replayssm_jax.ops.*_replay_init).

        The result shares `state`'s arrays (its conv window, and its ssm_state as the checkpoint where no
        cast is asked): donating it to a `jax.jit` deletes them in `state` too. To decode both from one
        prefill, copy first: ``jax.tree.map(jnp.copy, state)``.

        Raises:
          TypeError: `state` not an `SSMLayerState` (a `ReplayLayerState` is one already).
          ValueError: a state of another layer's shape, or with a pending verify window; the op's
            checks (replayssm_jax.ops.*_replay_init).
        """
        self._check_state(state, "to_replay", (SSMLayerState,))
        if buffer_dtype is None:
            buffer_dtype = self.exact_buffer_dtype(state)
        replay = self.replay_init_op(state.current_state(), buffer_len, buffer_dtype=buffer_dtype,
                                     checkpoint_dtype=checkpoint_dtype, rounding=rounding, **self._replay_init_params())
        return ReplayLayerState(conv_state=state.conv_state, replay=replay)

    def with_window(self, state: SSMLayerState | ReplayLayerState, max_window: int):
        """`state` with a conv window that holds verify windows of up to `max_window` (>= 1) positions;
        an `SSMLayerState` also in the slotted layout of max_window + 1 states per row (one copy, once:
        `SSMLayerState.slotted`), so that verify and commit copy no state.

        Raises:
          ValueError: max_window < 1, or a state with a pending verify window.
        """
        if not isinstance(max_window, int) or max_window < 1:
            raise ValueError(f"{type(self).__name__}.with_window: `max_window` must be an int >= 1; "
                             f"got {max_window!r}")
        self._check_state(state, "with_window", (SSMLayerState, ReplayLayerState))
        state = state.replace(conv_state=ConvWindow.from_conv_state(state.conv_state.conv_state(), max_window))
        return state.slotted(max_window + 1) if isinstance(state, SSMLayerState) else state

    def decode(self, u: jax.Array, state: SSMLayerState | ReplayLayerState, *, route: str = "auto",
               backend: str | None = None, slots=None) -> tuple[jax.Array, SSMLayerState | ReplayLayerState]:
        """One decode step.

        Args:
          u: [batch, hidden], the normalised layer input of the new token.
          state: `SSMLayerState` (standard step) or `ReplayLayerState` (ReplaySSM step).
          route: the ReplaySSM step's route, "output", "state", "direct", "deferred" (same numbers) or "auto"
            (resolved by replayssm_jax.ops.resolve_route: on the kernel backends the direct route where
            the default replay step is one launch, else the deferred route from batch 64 with an f32 or
            bf16 checkpoint outside a state pool, else the output route), or "append" (the output
            route without the flush, for a schedule that flushes the rows itself; on a row with a full
            buffer: ValueError on a concrete cursor, and under a trace NaN outputs, the SSM state kept
            and the conv window moved on).
          backend: passed to replayssm_jax.ops.
          slots: None, or i32[batch]: `state` is a state pool of capacity
            slots (:mod:`replayssm_jax.pool`) and row b steps slot slots[b]
            (-1: a padding row, which changes nothing). The SSM op indexes
            the pool by slot; the conv window, small ([S, conv_dim] per
            slot), is gathered for the batch's slots and its rows scattered
            back (XLA: two copies of batch x S x conv_dim values per step).

        Returns:
          (out [batch, hidden], the new state of the same type).

        Raises:
          TypeError: `state` of another type; `u` not float32 or bfloat16.
          ValueError: `u` not [batch, hidden] (the state's batch, or the
            number of `slots`); an unknown `route` (also with a standard
            state, which takes none); a state of another layer's shape, or
            with a pending verify window (commit it first); bad `slots`
            (replayssm_jax.ops.validate.check_slots), or `slots` with a standard
            state in the per-draft layout.
        """
        ops.check_route(route, ops.STEP_ROUTES)  # also with a standard state, which takes no route
        self._check_state(state, "decode", (SSMLayerState, ReplayLayerState))
        slots = validate.check_slots(slots, state.conv_state.batch, None, ("u", u))
        self._check_input(u, "decode", state.conv_state.batch if slots is None else slots.shape[0])
        slotted = isinstance(state, SSMLayerState) and state.index is not None
        if slotted and slots is not None:
            raise ValueError(f"{type(self).__name__}.decode: `slots` with a standard state in the per-draft "
                             "layout (`index` set, from `with_window`, e.g. a StatePool with max_window > 1) is not "
                             "supported; decode such a pool by verify windows of one position (`verify` + `commit`)")
        if isinstance(state, SSMLayerState) and not slotted and slots is None:
            fused = self._fused_step(u, state, backend)
            if fused is not None:
                return fused
        conv_rows = state.conv_state if slots is None else ops.take_slots(state.conv_state, slots)
        inputs, z, conv_rows = self._ssm_inputs(u, conv_rows, functools.partial(self.conv1d.step, backend=backend))
        pool = {} if slots is None else {"slots": slots}
        with jax.named_scope(SSM_SCOPE):
            if slotted:  # verify one position, commit it
                y, ssm_state = self.verify_op(state.ssm_state, state.index,
                                              **{k: v[:, None] for k, v in inputs.items()}, backend=backend,
                                              **self._op_params())
                y = y[:, 0]
            elif isinstance(state, SSMLayerState):
                y, ssm_state = self.step_op(state.ssm_state, **inputs, backend=backend, **pool, **self._op_params())
            else:
                y, replay = self.replay_step_op(state.replay, **inputs, route=route, backend=backend, **pool,
                                                **self._op_params())
        conv_state = conv_rows if slots is None else ops.put_slots(state.conv_state, slots, conv_rows)
        if slotted:
            new = state.replace(conv_state=conv_state, ssm_state=ssm_state, index=(state.index + 1) % state.slots)
        elif isinstance(state, SSMLayerState):
            new = SSMLayerState(conv_state=conv_state, ssm_state=ssm_state)
        else:
            new = ReplayLayerState(conv_state=conv_state, replay=replay)
        return self._finish(y, z), new

    def verify(self, u: jax.Array, state: SSMLayerState | ReplayLayerState, *, backend: str | None = None,
               tree=None, slots=None) -> tuple[jax.Array, SSMLayerState | ReplayLayerState]:
        """W speculative positions at once; the state comes back with the window pending.

        Args:
          u: [batch, W, hidden], the normalised layer inputs of the W positions;
            1 <= W <= the conv window's max_window (and <= L for a replay state).
          state: `SSMLayerState` or `ReplayLayerState` without a pending window.
          backend: passed to replayssm_jax.ops (the replay verify op runs on
            ``ops.backend_for``, its reference where it has no kernel).
          tree: None (a chain), or a
            :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes:
            position t follows its parent node (conv and SSM read t's path
            only; the standard state steps from its parent's state).
          slots: None, or i32[batch] (checked:
            replayssm_jax.ops.validate.check_slots): `state` is a state
            pool of capacity slots and row b verifies slot slots[b]
            (-1: a padding row, which reads and writes nothing); a chain
            window only (tree None), and a standard state already in the
            slotted layout of >= W + 1 states (a pool prefilled with
            max_window >= W). The SSM verify op indexes the pool by slot;
            the conv window is gathered for the batch's slots and its rows
            scattered back (XLA: two copies of batch x S x conv_dim values).

        Returns:
          (out [batch, W, hidden], where position t assumes positions 0..t-1
          (of a tree: t's ancestors) are accepted; the state with the window
          pending: the conv inputs written; `ReplayLayerState`: the W records
          after the cursor (``replay.window = W``); `SSMLayerState`: slotted
          (a plain one is first put in the layout of W + 1 slots), the state
          after position (node) t at slot index + 1 + t mod S, ``index``
          unchanged, ``window = W``). `commit` resolves it.

        Raises:
          TypeError: `state` of another type; `u` not float32 or bfloat16.
          ValueError: a pending window, u not [batch, W, hidden], W above the
            conv window's max_window or the replay buffer length L; a `tree`
            that is not a DraftTree of W nodes; with `slots`, a tree or a
            standard state without W + 1 slotted states.
        """
        self._check_state(state, "verify", (SSMLayerState, ReplayLayerState))
        slots = validate.check_slots(slots, state.conv_state.batch, None, ("u", u))
        self._check_input(u, "verify", state.conv_state.batch if slots is None else slots.shape[0], window=True)
        window = u.shape[1]
        limit = state.conv_state.max_window
        if isinstance(state, ReplayLayerState):
            limit = min(limit, state.replay.buffer_len)
        if window > limit:
            raise ValueError(f"{type(self).__name__}.verify: the window W = {window} (axis 1 of `u`) must be <= "
                             f"{limit} (the conv window's max_window = {state.conv_state.max_window}"
                             + (f", the buffer length L = {state.replay.buffer_len}"
                                if isinstance(state, ReplayLayerState) else "") + ")")
        tree = validate.check_tree(tree, window, "u.shape[1]")
        validate.check_no_tree_with_slots(tree, slots)
        if slots is not None and isinstance(state, SSMLayerState) and state.slots < window + 1:
            raise ValueError(f"{type(self).__name__}.verify: `slots` with a standard state of {state.slots} slotted "
                             f"states per row; a window of W = {window} needs W + 1 (a state pool prefilled with "
                             f"max_window >= {window})")
        conv_rows = state.conv_state if slots is None else ops.take_slots(state.conv_state, slots)
        inputs, z, conv_rows = self._ssm_inputs(u, conv_rows, functools.partial(self.conv1d.verify, tree=tree))
        conv_state = conv_rows if slots is None else ops.put_slots(state.conv_state, slots, conv_rows)
        params = self._op_params()
        pool = {} if slots is None else {"slots": slots}
        if isinstance(state, ReplayLayerState):
            with jax.named_scope(SSM_SCOPE):
                y, replay = self.replay_verify_op(state.replay, **inputs, **params, tree=tree, **pool,
                                                  backend=ops.backend_for(self.replay_verify_op.__name__, backend))
            return self._finish(y, z), ReplayLayerState(conv_state=conv_state, replay=replay)
        if state.slots < window + 1:  # a plain state, or too few slots: the slotted layout, once
            state = state.slotted(window + 1)
        with jax.named_scope(SSM_SCOPE):
            y, ssm_state = self.verify_op(state.ssm_state, state.index, **inputs, **params, tree=tree,
                                          backend=backend, **pool)
        return self._finish(y, z), state.replace(conv_state=conv_state, ssm_state=ssm_state, window=window,
                                                 tree=validate.tree_parents(tree))

    def commit(self, state: SSMLayerState | ReplayLayerState, num_accepted,
               path=None) -> SSMLayerState | ReplayLayerState:
        """Keep the first `num_accepted` positions of the pending verify window (of a tree: of `path`).

        Args:
          state: from `verify` (a pending window W).
          num_accepted: int[batch], per row in 0..W (checked where concrete;
            clipped to 0..W inside jit).
          path: None after a chain's verify; after a tree's (required),
            int[batch, P]: per row the accepted nodes, root first
            (`commit_layer_state`).

        Returns:
          The state after those positions, no window pending:
          `SSMLayerState`: the index moved to the slot of the state after
          position m - 1 (m = 0: unchanged); `ReplayLayerState`: ``cursor += m``; the conv
          window's start moved by m.

        Raises:
          TypeError: `state` of another type, non-integer counts.
          ValueError: no pending window, counts not [batch] or outside 0..W;
            a path after a chain's verify, none after a tree's, or
            (concrete) one off the verified tree (`validate.check_commit_path`).
        """
        self._check_state(state, "commit", (SSMLayerState, ReplayLayerState), pending=True)
        m = check_num_accepted(num_accepted, state.conv_state.batch, state.window)
        return commit_layer_state(state, m, check_commit_path(path, m, state.window, state.tree))


    def _check_input(self, u, what: str, batch: int | None, *, window: bool = False) -> None:
        """`check_input` of the mode `what`'s input `u` ([batch, T, hidden] for prefill, [batch, W, hidden]
        with `window`, else [batch, hidden])."""
        check_input(f"{type(self).__name__}.{what}", "u", u, self.hidden_size, batch,
                    ("T" if what == "prefill" else "W") if window else None)

    def _check_state(self, state, what: str, types: tuple, *, pending: bool = False) -> None:
        """TypeError unless `state` is one of `types`; ValueError unless it has this layer's shape (conv
        channels and width, state dims) and a pending verify window exactly when `pending`."""
        name = type(self).__name__
        if not isinstance(state, types):
            want = " or ".join(t.__name__ for t in types)
            raise TypeError(f"{name}.{what}: `state` must be {want}; got {type(state).__name__}")
        conv = state.conv_state
        field, array = (("ssm_state", state.ssm_state) if isinstance(state, SSMLayerState)
                        else ("replay.checkpoint", state.replay.checkpoint))
        have = (conv.columns.shape[-1], conv.width, tuple(array.shape[-3:]))
        want = (self.conv_dim, self.conv1d.kernel_size, tuple(self.state_dims()))
        if have != want:
            raise ValueError(f"{name}.{what}: `state` is not this layer's: its conv window has {have[0]} channels of "
                             f"width {have[1]} and its {field} {have[2]} per row (heads, rows, columns); this "
                             f"layer's are {want[0]} channels of width {want[1]} and {want[2]}")
        if pending and state.window == 0:
            raise ValueError(f"{name}.{what}: `state` has no pending verify window; call verify first")
        if not pending and state.window:
            raise ValueError(f"{name}.{what}: `state` has a pending verify window (W = {state.window}); "
                             f"commit it first")


def check_mixer_config(owner: str, ssm_state_dtype, **sizes) -> None:
    """Check a mixer's sizes (ints >= 1) and its ssm_state dtype (float32 or bfloat16) at construction.

    Raises:
      TypeError: a size not an int, or another state dtype (float16 overflows these recurrences).
      ValueError: a size below 1; each message names `owner` (e.g. "Mamba2Mixer") and the argument.
    """
    check_sizes(owner, **sizes)
    try:
        dtype = jnp.dtype(ssm_state_dtype)
    except TypeError:
        dtype = None
    if dtype not in validate.STATE_DTYPES:
        why = f" ({validate.FLOAT16_OVERFLOWS})" if dtype == jnp.float16 else ""
        given = ssm_state_dtype if dtype is None else dtype.name
        raise TypeError(f"{owner}: `ssm_state_dtype` must be float32 or bfloat16; got {given!r}{why}")
