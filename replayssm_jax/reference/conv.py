"""Reference of the short causal conv's decode step (the conv1d update of Mamba-2 and GDN).

Letters: batch, C channels (conv_dim), W the conv width, S the ring's slots.
The conv is depthwise and causal (torch ``nn.Conv1d(C, C, W, groups=C,
padding=W-1)``, cut to the current output), and a decode step keeps its
inputs in a ring (`replayssm_jax.layers.cache.ConvWindow`): columns
[batch, S, C], the oldest of the W - 1 live inputs at slot `start`. With
xp_j = columns[b, (start + j) mod S] for j < W - 1 and xp_{W-1} = x,

    y[b, c] = act(bias[c] + sum_{j < W} weight[c, j] * xp_j[b, c])

and x is written at slot (start + W - 1) mod S (start is not moved here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax.state import in_order


def _relu2(x):
    return jnp.square(jax.nn.relu(x))


# transformers' `hidden_act` names.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu2": _relu2,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "identity": lambda x: x,
}


def conv_update(x, columns, start, weight, bias=None, activation: str = "silu", offset: int = 0,
                splits: tuple[int, ...] = ()):
    """One decode step of the conv (module docstring).

    Args:
      x: [batch, C], the new inputs; or [batch, X], holding them at columns offset .. offset + C - 1.
      columns: [batch, S, C], the ring, S >= W.
      start: i32[batch], the ring slot of each row's oldest live input.
      weight: [C, W]; bias: [C] or None.
      activation: a name of ACTIVATIONS.
      offset: the column of x where the C inputs start.
      splits: increasing channel indices in (0, C) where y is cut (as `jnp.split`'s).

    Returns:
      (y [batch, C] of x.dtype, computed in f32, or its pieces with `splits`; the ring with x's C inputs
      at slot (start + W - 1) mod S).
    """
    S, C, W = columns.shape[1], columns.shape[2], weight.shape[1]
    x = x[:, offset:offset + C]
    slots = (start[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]) % S  # [batch, W]: live inputs, then x's
    live = jnp.take_along_axis(columns, slots[:, :W - 1, None], axis=1).astype(jnp.float32)  # [batch, W - 1, C]
    xp = jnp.concatenate([live, x[:, None, :].astype(jnp.float32)], axis=1)
    w = weight.astype(jnp.float32)
    acc = sum(xp[:, j] * w[:, j] for j in range(W))
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    y = ACTIVATIONS[activation](acc).astype(x.dtype)
    columns, y = in_order(columns, y)  # the live inputs read before the ring is written: in place in a loop
    ring = jnp.arange(S, dtype=jnp.int32)[None, :, None]
    columns = jnp.where(ring == slots[:, W - 1, None, None], x[:, None, :].astype(columns.dtype), columns)
    return (tuple(jnp.split(y, splits, axis=1)) if splits else y), columns
