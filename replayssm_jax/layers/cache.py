"""Per-layer decode states, as typed pytrees (`flax.struct` dataclasses).

An SSM layer (Mamba-2 mixer or Gated DeltaNet) decodes from either

- `SSMLayerState`: the standard path: conv_state plus the full recurrent
  ``ssm_state``, read and written every step; or
- `ReplayLayerState`: the ReplaySSM path: conv_state plus a
  `replayssm_jax.state.Mamba2ReplayState` / `GDNReplayState` (checkpoint, ring
  buffer of the last inputs, per-row cursor).

An attention layer decodes from a `KVCache` of fixed maximum length with one
length per sequence. Layers without state (MLP, MoE) use ``None``.

The layer's ``decode`` method dispatches on the type of the state it is given;
the choice is static (part of the pytree structure), so one jitted decode step
serves one path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

__all__ = ["SSMLayerState", "ReplayLayerState", "KVCache", "LayerState"]


@struct.dataclass
class SSMLayerState:
    """Standard decode state of one SSM layer.

    Attributes:
      conv_state: [batch, conv_dim, W - 1], the last W - 1 conv inputs (activation dtype).
      ssm_state: the recurrent state, f32 | bf16. Mamba-2: [batch, nheads, head_dim,
        d_state]; GDN: [batch, HV, V, K] (value-major; transformers stores [.., K, V]).
    """

    conv_state: jax.Array
    ssm_state: jax.Array


@struct.dataclass
class ReplayLayerState:
    """ReplaySSM decode state of one SSM layer.

    Attributes:
      conv_state: [batch, conv_dim, W - 1].
      replay: Mamba2ReplayState (Mamba-2) or GDNReplayState (GDN); its
        ``checkpoint`` has the layout of SSMLayerState.ssm_state.
    """

    conv_state: jax.Array
    replay: Mamba2ReplayState | GDNReplayState


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
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @classmethod
    def zeros(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache (length 0 everywhere)."""
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=jnp.zeros((batch,), jnp.int32))


LayerState = SSMLayerState | ReplayLayerState | KVCache | None
