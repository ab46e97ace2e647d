"""Argument checks shared by every backend.

Each check raises before any computation, with a message that names the
argument, what was expected and what was given, e.g.

    ValueError: `x` must have shape [batch, nheads, head_dim] = (4, 8, 16); got (4, 8, 12)

Checks look only at shapes and dtypes (static under `jax.jit`), except
:func:`check_int_range`, which also checks values when they are concrete
(outside a trace).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

STATE_DTYPES = (jnp.float32, jnp.bfloat16)


def as_array(name: str, x):
    """Return `x` as a JAX array; raise TypeError if it is not array-like."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.asarray(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.asarray(x)
    raise TypeError(f"`{name}` must be an array; got {type(x).__name__}")


def check_float(name: str, x, dtypes: Sequence | None = None) -> jax.Array:
    """`x` as an array with a floating dtype (one of `dtypes` if given)."""
    x = as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must have a floating-point dtype; got {x.dtype}")
    if dtypes is not None and x.dtype not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"`{name}` must have dtype in ({names}); got {x.dtype}")
    return x


def check_shape(name: str, x, dims: str, expected: Sequence[int]) -> None:
    """Raise ValueError unless `x.shape == expected`; `dims` names the axes."""
    expected = tuple(int(e) for e in expected)
    if tuple(x.shape) != expected:
        raise ValueError(f"`{name}` must have shape [{dims}] = {expected}; got {tuple(x.shape)}")


def check_rank(name: str, x, dims: str) -> None:
    """Raise ValueError unless `x` has as many axes as `dims` names, none empty."""
    rank = len(dims.split(","))
    if x.ndim != rank:
        raise ValueError(f"`{name}` must have rank {rank} [{dims}]; got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"`{name}` must have no empty axis [{dims}]; got shape {tuple(x.shape)}")


def float_arg(name: str, x, dims: str, expected: Sequence[int]) -> jax.Array:
    """A floating array argument of an exact shape."""
    x = check_float(name, x)
    check_shape(name, x, dims, expected)
    return x


def optional_float_arg(name: str, x, dims: str, expected: Sequence[int]):
    """Like :func:`float_arg`, passing `None` through."""
    return None if x is None else float_arg(name, x, dims, expected)


def check_divisible(what: str, numerator: int, denominator_name: str, denominator: int) -> None:
    """Raise ValueError unless `denominator` divides `numerator`."""
    if denominator < 1 or numerator % denominator != 0:
        raise ValueError(f"{what} = {numerator} must be divisible by {denominator_name} = {denominator}")


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """A Python int >= minimum (static configuration such as L, W, chunk_size)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}; got {value}")
    return int(value)


def check_int_range(name: str, x, dims: str, expected: Sequence[int], low: int, high) -> jax.Array:
    """An integer array of an exact shape with values in [low, high].

    `high` may be an int or an int array broadcastable to the shape. Values
    are checked only when `x` is concrete; inside `jax.jit` only the shape
    and dtype are.
    """
    concrete = not isinstance(x, jax.core.Tracer) and not isinstance(high, jax.core.Tracer)
    values = np.asarray(x) if concrete and isinstance(x, (np.ndarray, np.generic, list, tuple)) else None
    x = as_array(name, np.asarray(x) if isinstance(x, (list, tuple)) else x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype; got {x.dtype}")
    check_shape(name, x, dims, expected)
    if concrete:
        values = np.asarray(x) if values is None else values  # the caller's values, before any int32 cast
        bound = np.broadcast_to(np.asarray(high), values.shape)
        bad = (values < low) | (values > bound)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise ValueError(
                f"`{name}` must be in [{low}, {int(bound.flat[row]) if bound.ndim else int(bound)}]"
                f" for every row; got {values.tolist()}"
            )
    return x.astype(jnp.int32)


def check_negative(name: str, x, what: str) -> None:
    """Raise ValueError if a concrete `x` has an entry >= 0 (traced values pass)."""
    if isinstance(x, jax.core.Tracer):
        return
    values = np.asarray(x, np.float64)
    if not np.all(values < 0):
        raise ValueError(f"`{name}` must be negative ({what}); got max {values.max():g}")


def check_scale(scale):
    """None, or a finite real number as a Python float: a Python or NumPy
    scalar, or a concrete 0-d array (the kernels take it as a static number)."""
    if scale is None:
        return None
    if (isinstance(scale, (jax.Array, np.ndarray)) and not isinstance(scale, jax.core.Tracer) and scale.ndim == 0
            and (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer))):
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) or not math.isfinite(scale):
        raise TypeError(f"`scale` must be a finite real number (a concrete scalar) or None; got {scale!r}")
    return float(scale)


def check_bool(name: str, x) -> bool:
    """A Python or NumPy bool (a static switch), as a Python bool."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool; got {type(x).__name__} {x!r}")
    return bool(x)


def check_dt_limit(dt_limit) -> tuple[float, float]:
    """`dt_limit` as a (low, high) pair of floats with 0 <= low <= high."""
    try:
        low, high = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"`dt_limit` must be a pair of floats (low, high); got {dt_limit!r}") from None
    if not (0.0 <= low <= high) or math.isnan(high):
        raise ValueError(f"`dt_limit` must satisfy 0 <= low <= high; got {dt_limit!r}")
    return low, high


ROUTES = ("output", "state", "direct", "auto")


def check_route(route: str) -> str:
    """The replay step's route: 'output', 'state', 'direct' or 'auto' (the
    kernels pick the route by shape; the reference takes 'output')."""
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {', '.join(map(repr, ROUTES))}; got {route!r}")
    return route
