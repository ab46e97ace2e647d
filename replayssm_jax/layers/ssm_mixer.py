"""The three modes shared by the SSM token mixers (`Mamba2Mixer`, `GatedDeltaNet`).

A mixer projects its input, runs the causal conv, and hands the SSM inputs to
the ops of its layer type in :mod:`replayssm_jax.ops`:

- `prefill`: the chunked form (`chunked_op`, e.g. ``ops.mamba2_chunked``);
  returns the outputs and an `SSMLayerState` whose ssm_state is the
  checkpoint (final SSM state);
- `decode` with an `SSMLayerState`: one standard step (`step_op`);
- `decode` with a `ReplayLayerState`: one ReplaySSM step (`replay_step_op`),
  on a state built by `to_replay` (`replay_init_op`).

A subclass binds those four class attributes to its layer's functions of
:mod:`replayssm_jax.ops` and gives `_ssm_inputs` (the projections, conv and
splits), `_op_params`, `_replay_init_params` and `_finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax.layers.cache import ReplayLayerState, SSMLayerState


class SSMMixer(nnx.Module):
    """Base of the SSM token mixers: prefill, standard and ReplaySSM decode."""

    # The layer's ops (functions of replayssm_jax.ops), bound by each subclass.
    chunked_op: ClassVar[Callable]  # prefill: (state | None, **inputs, chunk_size, **params) -> (y, state)
    step_op: ClassVar[Callable]  # standard decode: (ssm_state, **inputs, **params) -> (y, ssm_state)
    replay_step_op: ClassVar[Callable]  # ReplaySSM decode: (replay, **inputs, route, **params) -> (y, replay)
    replay_init_op: ClassVar[Callable]  # (checkpoint, buffer_len, heads or groups, buffer_dtype) -> replay state

    # Hooks each layer defines (Mamba2Mixer, GatedDeltaNet); the base has no default.

    def _ssm_inputs(self, u, conv_state, conv):
        """(SSM op inputs as keywords, gate z, new conv_state); `conv` is `self.conv1d`
        (a whole sequence) or `self.conv1d.step` (one token)."""
        raise NotImplementedError(f"{type(self).__name__} must define _ssm_inputs")

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
          (out [batch, T, hidden] of u.dtype, SSMLayerState with conv_state
          [batch, conv_dim, W-1] (u.dtype) and ssm_state = the checkpoint
          (the layer's state layout, ssm_state_dtype)).
        """
        inputs, z, conv_state = self._ssm_inputs(u, None if state is None else state.conv_state, self.conv1d)
        y, ssm_state = self.chunked_op(None if state is None else state.ssm_state, **inputs,
                                       chunk_size=self.chunk_size,
                                       backend=ops.backend_for(self.chunked_op.__name__, backend),
                                       **self._op_params())
        return self._finish(y, z), SSMLayerState(conv_state=conv_state,
                                                 ssm_state=ssm_state.astype(self.ssm_state_dtype))

    def to_replay(self, state: SSMLayerState, buffer_len: int, buffer_dtype=jnp.float32) -> ReplayLayerState:
        """ReplaySSM state whose checkpoint is `state.ssm_state` (cursor 0), buffer of L = buffer_len steps."""
        return ReplayLayerState(conv_state=state.conv_state,
                                replay=self.replay_init_op(state.ssm_state, buffer_len, buffer_dtype=buffer_dtype,
                                                           **self._replay_init_params()))

    def decode(self, u: jax.Array, state: SSMLayerState | ReplayLayerState, *, route: str = "auto",
               backend: str | None = None) -> tuple[jax.Array, SSMLayerState | ReplayLayerState]:
        """One decode step.

        Args:
          u: [batch, hidden], the normalised layer input of the new token.
          state: `SSMLayerState` (standard step) or `ReplayLayerState` (ReplaySSM step).
          route: the ReplaySSM step's route, "output", "state", "direct" (same numbers) or "auto"
            (resolved by replayssm_jax.ops.resolve_route: on the kernel backends the direct route where
            the default replay step is one launch, else the output route).
          backend: passed to replayssm_jax.ops.

        Returns:
          (out [batch, hidden], the new state of the same type).

        Raises:
          TypeError: `state` of another type.
        """
        if not isinstance(state, (SSMLayerState, ReplayLayerState)):
            raise TypeError(f"{type(self).__name__}.decode: `state` must be SSMLayerState or ReplayLayerState; "
                            f"got {type(state).__name__}")
        inputs, z, conv_state = self._ssm_inputs(u, state.conv_state, self.conv1d.step)
        if isinstance(state, SSMLayerState):
            y, ssm_state = self.step_op(state.ssm_state, **inputs, backend=backend, **self._op_params())
            new = SSMLayerState(conv_state=conv_state, ssm_state=ssm_state)
        else:
            y, replay = self.replay_step_op(state.replay, **inputs, route=route, backend=backend,
                                            **self._op_params())
            new = ReplayLayerState(conv_state=conv_state, replay=replay)
        return self._finish(y, z), new
