"""Dense projection and token embedding, stored in PyTorch's layout.

Weights keep the layout of the Hugging Face checkpoint (``nn.Linear.weight`` is
[out_features, in_features]) so that loading is a rename, never a transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Linear", "Embedding", "default_rngs"]


def default_rngs(rngs: nnx.Rngs | None) -> nnx.Rngs:
    """The given `rngs`, or a fixed ``nnx.Rngs(0)`` (weights are normally loaded)."""
    return rngs if rngs is not None else nnx.Rngs(0)


class Linear(nnx.Module):
    """``y = x @ weight.T + bias`` (torch.nn.Linear).

    Args:
      in_features, out_features: sizes.
      bias: whether there is a ``bias`` parameter.
      param_dtype: parameter dtype.
      rngs: for the random init (normal, std 0.02), used by tests only.

    Parameters: ``weight``: [out_features, in_features]; ``bias``: [out_features].

    Call: ``x``: [..., in_features] -> [..., out_features] in the promoted dtype
    of x and weight.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (out_features, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear: `x` last axis must be in_features = {self.in_features}; got shape {x.shape}")
        y = jnp.einsum("...i,oi->...o", x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embedding table (torch.nn.Embedding).

    Parameters: ``weight``: [vocab_size, hidden_size].

    Call: ``ids``: int[...] -> [..., hidden_size] of the weight dtype. Ids
    outside [0, vocab_size) are clamped (jnp.take semantics under jit).

    ``attend(h)``: ``h @ weight.T``, the tied LM head: [..., hidden] -> [..., vocab].
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (vocab_size, hidden_size), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0, mode="clip")

    def attend(self, h: jax.Array) -> jax.Array:
        return jnp.einsum("...d,vd->...v", h, self.weight[...])
