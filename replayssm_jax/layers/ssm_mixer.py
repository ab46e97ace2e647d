"""The three modes shared by the SSM token mixers (`Mamba2Mixer`, `GatedDeltaNet`).

A mixer projects its input, runs the causal conv, and hands the SSM inputs to
the ops of its layer type in :mod:`replayssm_jax.ops`:

- `prefill`: the chunked form (``ops.<layer>_chunked``); returns the outputs
  and an `SSMLayerState` whose ssm_state is the checkpoint (final SSM state);
- `decode` with an `SSMLayerState`: one standard step (``ops.<layer>_step``);
- `decode` with a `ReplayLayerState`: one ReplaySSM step
  (``ops.<layer>_replay_step``), on a state built by `to_replay`.

A subclass sets `_op` ("mamba2" or "gdn") and gives `_ssm_inputs` (the
projections, conv and splits), `_op_params`, `_replay_init` and `_finish`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax.layers._backend import chunked_backend
from replayssm_jax.layers.cache import ReplayLayerState, SSMLayerState


class SSMMixer(nnx.Module):
    """Base of the SSM token mixers: prefill, standard and ReplaySSM decode."""

    _op: str  # prefix of the layer's ops in replayssm_jax.ops

    # Hooks each layer defines (Mamba2Mixer, GatedDeltaNet); the base has no default.

    def _ssm_inputs(self, u, conv_state, conv):
        """(SSM op inputs as keywords, gate z, new conv_state); `conv` is `self.conv1d`
        (a whole sequence) or `self.conv1d.step` (one token)."""
        raise NotImplementedError(f"{type(self).__name__} must define _ssm_inputs")

    def _op_params(self) -> dict:
        """Keyword parameters of every op call (A, D, dt_bias, ... or use_qk_l2norm)."""
        raise NotImplementedError(f"{type(self).__name__} must define _op_params")

    def _replay_init(self, ssm_state, buffer_len, buffer_dtype):
        """The layer's ReplaySSM state with `ssm_state` as checkpoint and an empty buffer."""
        raise NotImplementedError(f"{type(self).__name__} must define _replay_init")

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
          backend: replayssm_jax.ops backend of the chunked op (None: the platform
            default where it has the op, else "xla"; see layers._backend).

        Returns:
          (out [batch, T, hidden] of u.dtype, SSMLayerState with conv_state
          [batch, conv_dim, W-1] (u.dtype) and ssm_state = the checkpoint
          (the layer's state layout, ssm_state_dtype)).
        """
        inputs, z, conv_state = self._ssm_inputs(u, None if state is None else state.conv_state, self.conv1d)
        name = f"{self._op}_chunked"
        y, ssm_state = getattr(ops, name)(None if state is None else state.ssm_state, **inputs,
                                          chunk_size=self.chunk_size, backend=chunked_backend(name, backend),
                                          **self._op_params())
        return self._finish(y, z), SSMLayerState(conv_state=conv_state,
                                                 ssm_state=ssm_state.astype(self.ssm_state_dtype))

    def to_replay(self, state: SSMLayerState, buffer_len: int, buffer_dtype=jnp.float32) -> ReplayLayerState:
        """ReplaySSM state whose checkpoint is `state.ssm_state` (cursor 0), buffer of L = buffer_len steps."""
        return ReplayLayerState(conv_state=state.conv_state,
                                replay=self._replay_init(state.ssm_state, buffer_len, buffer_dtype))

    def decode(self, u: jax.Array, state: SSMLayerState | ReplayLayerState, *, route: str = "auto",
               backend: str | None = None) -> tuple[jax.Array, SSMLayerState | ReplayLayerState]:
        """One decode step.

        Args:
          u: [batch, hidden], the normalised layer input of the new token.
          state: `SSMLayerState` (standard step) or `ReplayLayerState` (ReplaySSM step).
          route: the ReplaySSM step's route, "output", "state", "direct" (same numbers; see
            replayssm_jax.ops) or "auto" (the kernels pick by shape: replayssm_jax.kernels.pick_route).
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
            y, ssm_state = getattr(ops, f"{self._op}_step")(state.ssm_state, **inputs, backend=backend,
                                                             **self._op_params())
            new = SSMLayerState(conv_state=conv_state, ssm_state=ssm_state)
        else:
            y, replay = getattr(ops, f"{self._op}_replay_step")(state.replay, **inputs, route=route,
                                                                 backend=backend, **self._op_params())
            new = ReplayLayerState(conv_state=conv_state, replay=replay)
        return self._finish(y, z), new
