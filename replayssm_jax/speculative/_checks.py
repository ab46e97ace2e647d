"""Argument checks and per-row randomness shared by the acceptance rules and
the drafters. Checks look at shapes and dtypes only (static under `jax.jit`),
except where a docstring says that concrete values are checked too."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.ops import validate as v


def int_array(name: str, x, dims: str, expected: Sequence[int] | None = None) -> jax.Array:
    """`x` as an i32 array with an integer dtype, of rank len(dims) and, if
    given, of shape `expected`.

    Raises:
      TypeError: `x` is not an array, or its dtype is not an integer one.
      ValueError: wrong rank, an empty axis, or a shape other than `expected`.
    """
    x = v.as_array(name, np.asarray(x) if isinstance(x, (list, tuple)) else x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype; got {x.dtype}")
    v.check_rank(name, x, dims)
    if expected is not None:
        v.check_shape(name, x, dims, expected)
    return x.astype(jnp.int32)


def check_key(key) -> jax.Array:
    """A single PRNG key: a typed key of shape () (`jax.random.key(seed)`) or
    a raw u32[2] key (`jax.random.PRNGKey(seed)`).

    Raises:
      TypeError: anything else.
    """
    if isinstance(key, jax.Array):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == jnp.uint32 and key.shape == (2,):
            return key
    shape = getattr(key, "shape", None)
    dtype = getattr(key, "dtype", type(key).__name__)
    raise TypeError(
        f"`key` must be one PRNG key (jax.random.key(seed), or u32[2] from jax.random.PRNGKey); "
        f"got {dtype} with shape {shape}"
    )


def row_keys(key: jax.Array, batch: int, streams: int) -> jax.Array:
    """Independent keys [streams, batch] for each row: row i's keys come from
    fold_in(key, i) (as in :func:`replayssm_jax.sampling.sample_tokens`), so
    a row's draws do not depend on the other rows or on the batch size."""
    per_row = jax.vmap(lambda row: jax.random.split(jax.random.fold_in(key, row), streams))(jnp.arange(batch))
    return jnp.swapaxes(per_row, 0, 1)


def prefix_length(ok: jax.Array) -> jax.Array:
    """i32[batch]: the number of leading True entries of each row of bool[batch, K]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
