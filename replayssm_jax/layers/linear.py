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

    Tensor parallelism (`models.sharding`, inside ``jax.shard_map``): with
    ``reduce_axis`` set (a mesh axis name) the layer is row-parallel: x and
    weight hold this shard's part of in_features, the partial products are
    summed over the axis (``lax.psum``) and the bias, replicated, is added once
    after the sum. With ``gather_axis`` set it is column-parallel with a gathered
    output: weight (and bias) hold this shard's rows of out_features and the
    outputs of the shards are concatenated along the last axis
    (``lax.all_gather(tiled=True)``). Both are None (no collective) unless the
    sharding code sets them.
    """

    reduce_axis: str | None = None
    gather_axis: str | None = None

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
        y = self.project(x)
        if self.reduce_axis is not None:
            y = jax.lax.psum(y, self.reduce_axis)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.gather_axis is not None:
            y = jax.lax.all_gather(y, self.gather_axis, axis=y.ndim - 1, tiled=True)
        return y

    def project(self, x: jax.Array) -> jax.Array:
        """``x @ weight.T``: no bias and no collective (a row-parallel shard's partial product)."""
        return jnp.einsum("...i,oi->...o", x, self.weight[...])


class Embedding(nnx.Module):
    """Token embedding table (torch.nn.Embedding).

    Parameters: ``weight``: [vocab_size, hidden_size].

    Call: ``ids``: int[...] -> [..., hidden_size] of the weight dtype. Ids
    outside [0, vocab_size) are clamped (jnp.take semantics under jit).

    ``attend(h)``: ``h @ weight.T``, the tied LM head: [..., hidden] -> [..., vocab].

    Tensor parallelism (`models.sharding`, inside ``jax.shard_map``): with
    ``vocab_axis`` set (a mesh axis name) the table holds this shard's
    vocab_size rows, ids [shard * vocab_size, (shard + 1) * vocab_size) of the
    full vocabulary: a lookup gives zeros for the ids of other shards and is
    summed over the axis (``lax.psum``, one nonzero term per id: exact), and
    ``attend`` concatenates the shards' logits (``lax.all_gather``). Ids are
    then clamped to the full vocabulary, not to this shard's rows.
    """

    vocab_axis: str | None = None

    def __init__(self, vocab_size: int, hidden_size: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (vocab_size, hidden_size), param_dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.vocab_axis is None:
            return jnp.take(self.weight[...], ids, axis=0, mode="clip")
        rows = self.vocab_size
        shards = jax.lax.axis_size(self.vocab_axis)
        local = jnp.clip(ids, 0, rows * shards - 1) - jax.lax.axis_index(self.vocab_axis) * rows
        mine = (local >= 0) & (local < rows)
        h = jnp.take(self.weight[...], jnp.where(mine, local, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], h, jnp.zeros_like(h)), self.vocab_axis)

    def attend(self, h: jax.Array) -> jax.Array:
        logits = jnp.einsum("...d,vd->...v", h, self.weight[...])
        if self.vocab_axis is not None:
            logits = jax.lax.all_gather(logits, self.vocab_axis, axis=logits.ndim - 1, tiled=True)
        return logits
