"""Argument checks of the public ops (:mod:`replayssm_jax.ops`), shared by every backend.

Each check raises before any computation, with a message that names the
argument, what was expected and what was given, e.g.

    ValueError: `x` must have shape [batch, nheads, head_dim] = (4, 8, 16); got (4, 8, 12)

Arrays of the SSM ops (activations, parameters, states, buffers) must not
be float16: a state entry or an update vector of these recurrences exceeds
float16's largest value (65504) where bfloat16 and float32 hold it, so
:func:`check_ssm_float` raises TypeError for float16 (use bfloat16 or
float32); states must be float32 or bfloat16. The arithmetic is float32
whatever the input dtype.

Checks look only at shapes and dtypes (static under `jax.jit`), except
where values are concrete (outside a trace): :func:`check_int_range`,
:func:`check_negative`, :func:`check_non_positive`, :func:`check_closed_range` and
the replay state's cursor also check values.

Three parts: the generic checks (an argument's dtype, shape, range); the
replay state's checks; and one check per op (`check_mamba2_step`, ...,
`check_replay_commit`), which checks every argument of the op of that name
and returns them in the form the reference and the kernels take (Python
floats and bools for the static arguments, the state as a JAX array).
Dimension letters as in :mod:`replayssm_jax.reference`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from replayssm_jax.kernels.conv import check_pieces
from replayssm_jax.ops.dispatch import BACKENDS
from replayssm_jax.state import CHECKPOINT_DTYPES, ROUNDINGS, GDNReplayState, Mamba2ReplayState, is_quantized

STATE_DTYPES = (jnp.float32, jnp.bfloat16)
FLOAT16_OVERFLOWS = "float16 overflows in these recurrences (its largest value is 65504): use bfloat16 or float32"

# The library's packages (replayssm_jax and models, installed side by side), and JAX's and Flax's (a warning
# raised while `jax.jit` traces a library program): a warning names the first frame outside them, the
# user's call, however deep in the library it was raised.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(folder + os.sep for folder in (
    _PACKAGE, os.path.join(os.path.dirname(_PACKAGE), "models"), os.path.dirname(jax.__file__),
    os.path.dirname(struct.__file__)))


def warn(message: str) -> None:
    """A UserWarning attributed to the caller's own code (the first frame outside the library)."""
    warnings.warn(message, UserWarning, skip_file_prefixes=_LIBRARY_DIRS)


def as_array(name: str, x):
    """Return `x` as a JAX array; raise TypeError if it is not array-like."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.asarray(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.asarray(x)
    raise TypeError(f"`{name}` must be an array; got {type(x).__name__}")


def check_slots(slots, capacity: int, state, rows: tuple[str, object] | None = None) -> jax.Array | None:
    """`slots` (None: no state pool) as i32[batch]: the state pool's slots of a
    step's batch rows, each in -1 .. capacity - 1 (-1: a padding row), no
    slot twice; the values are checked where concrete. `state`: the pool (an
    array or a replay state, whose 8-bit checkpoint's scales and write counts
    are pool arrays too), or None; not read. `rows`: None, or (name, input)
    whose axis 0 is the step's batch, which must be the number of slots.

    Raises:
      TypeError: a non-integer dtype.
      ValueError: not of shape [batch] with batch >= 1, another length than
        the batch of `rows`, a concrete slot outside -1 .. capacity - 1 or
        one used twice.
    """
    if slots is None:
        return None
    concrete = not isinstance(slots, jax.core.Tracer)
    values = np.asarray(slots) if concrete else None
    slots = as_array("slots", values if concrete else slots)
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise TypeError(f"`slots` must have an integer dtype; got {slots.dtype}")
    if slots.ndim != 1 or slots.shape[0] < 1:
        raise ValueError(f"`slots` must have shape [batch] with batch >= 1; got {tuple(slots.shape)}")
    name, x = rows or ("", None)
    batch = getattr(x, "shape", ())[:1]
    if batch and batch != slots.shape:
        raise ValueError(f"`slots` must have one entry per batch row of `{name}` ({name}.shape[0] = {batch[0]}); "
                         f"got {slots.shape[0]} slots")
    if concrete:
        bad = (values < -1) | (values >= capacity)
        if bad.any():
            raise ValueError(f"`slots` must be in [-1, {capacity - 1}] (-1: a padding row; the pool has "
                             f"{capacity} slots); got {values.tolist()}")
        used, counts = np.unique(values[values >= 0], return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"`slots` must not use a slot twice in one batch; slot {int(used[counts > 1][0])} in "
                             f"{values.tolist()}")
    return slots.astype(jnp.int32)


def batch_dims(shape: Sequence[int], slots) -> tuple[int, ...]:
    """A state's shape as a step's inputs see it: axis 0 the batch of `slots` where given (a state pool)."""
    return tuple(shape) if slots is None else (slots.shape[0], *shape[1:])


def check_float(name: str, x, dtypes: Sequence | None = None) -> jax.Array:
    """`x` as an array with a floating dtype (one of `dtypes` if given)."""
    x = as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must have a floating-point dtype; got {x.dtype}")
    if dtypes is not None and x.dtype not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"`{name}` must have dtype in ({names}); got {x.dtype}")
    return x


def check_shape(name: str, x, dims: str, expected: Sequence[int], source: str = "") -> None:
    """Raise ValueError unless `x.shape == expected`; `dims` names the axes, `source` (optional) says
    where `expected` comes from."""
    expected = tuple(int(e) for e in expected)
    if tuple(x.shape) != expected:
        where = f" ({source})" if source else ""
        raise ValueError(f"`{name}` must have shape [{dims}] = {expected}{where}; got {tuple(x.shape)}")


def check_rank(name: str, x, dims: str) -> None:
    """Raise ValueError unless `x` has as many axes as `dims` names, none empty."""
    rank = len(dims.split(","))
    if x.ndim != rank:
        raise ValueError(f"`{name}` must have rank {rank} [{dims}]; got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"`{name}` must have no empty axis [{dims}]; got shape {tuple(x.shape)}")


def check_ssm_float(name: str, x, dtypes: Sequence | None = None) -> jax.Array:
    """:func:`check_float` for an array of an SSM op, which must not be float16
    (TypeError naming `name` and :data:`FLOAT16_OVERFLOWS`)."""
    x = check_float(name, x, dtypes)
    if x.dtype == jnp.float16:
        raise TypeError(f"`{name}` must not be float16: {FLOAT16_OVERFLOWS}; got {x.dtype}")
    return x


def float_arg(name: str, x, dims: str, expected: Sequence[int], check=check_float) -> jax.Array:
    """A floating array argument of an exact shape (its dtype checked by `check`)."""
    x = check(name, x)
    check_shape(name, x, dims, expected)
    return x


def optional_float_arg(name: str, x, dims: str, expected: Sequence[int], check=check_float):
    """Like :func:`float_arg`, passing `None` through."""
    return None if x is None else float_arg(name, x, dims, expected, check)


def ssm_arg(name: str, x, dims: str, expected: Sequence[int]) -> jax.Array:
    """An array argument of an SSM op of an exact shape, not float16."""
    return float_arg(name, x, dims, expected, check_ssm_float)


def optional_ssm_arg(name: str, x, dims: str, expected: Sequence[int]):
    """Like :func:`ssm_arg`, passing `None` through."""
    return optional_float_arg(name, x, dims, expected, check_ssm_float)


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


def check_non_positive(name: str, x, what: str) -> None:
    """Raise ValueError if a concrete `x` has an entry > 0 (-inf passes, and so
    do NaN entries and traced values)."""
    if isinstance(x, jax.core.Tracer):
        return
    values = np.asarray(x, np.float64)
    if np.any(values > 0):
        raise ValueError(f"`{name}` must be <= 0 ({what}); got max {np.nanmax(values):g}")


def check_closed_range(name: str, x, low: float, high: float, what: str) -> None:
    """Raise ValueError if a concrete `x` has an entry outside [low, high] (NaN entries and traced values
    pass)."""
    if isinstance(x, jax.core.Tracer):
        return
    values = np.asarray(x, np.float64)
    if np.any(values < low) or np.any(values > high):
        raise ValueError(f"`{name}` must be in [{low:g}, {high:g}] ({what}); got min {np.nanmin(values):g}, max "
                         f"{np.nanmax(values):g}")


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


# --------------------------------------------------------------------------
# States

MAMBA2_DIMS = "batch, nheads, head_dim, d_state"
GDN_DIMS = "batch, HV, V, K"
SLOTTED_MAMBA2_DIMS = "batch, slots, nheads, head_dim, d_state"
SLOTTED_GDN_DIMS = "batch, slots, HV, V, K"
MAMBA2_LAYOUT = "mamba_ssm's and transformers' ssm_state is [batch, nheads, head_dim, d_state] as well"
GDN_LAYOUT = ("the state is value-major, as FLA's; transformers' cache is [batch, HV, K, V]: transpose its last two "
              "axes (jnp.swapaxes(cache, -1, -2)), also before gdn_replay_init")


def check_state_array(name: str, x, dims: str) -> jax.Array:
    """A recurrent state or checkpoint: an f32 | bf16 array of rank 4, none of its axes empty."""
    check_not_8bit_state(name, x)
    x = check_float(name, x, STATE_DTYPES)  # float16 is not among them
    check_rank(name, x, dims)
    return x


def check_not_8bit_state(name: str, x) -> None:
    """Raise TypeError for an int8 | float8_e4m3fn array where a full state
    is expected: 8-bit states are replay checkpoints only (quantized at a
    flush); a standard step would quantize every step and no kernel takes one."""
    if isinstance(x, (jax.Array, np.ndarray)) and is_quantized(x.dtype):
        raise TypeError(f"`{name}` must have dtype float32 or bfloat16; got {x.dtype}: 8-bit states are supported "
                        "as replay checkpoints only (checkpoint_dtype of *_replay_init), not as a standard step's "
                        "state")


def check_layout(name: str, shape, dims: str, rows: int, cols: int, given_by: str, hint: str) -> None:
    """Raise ValueError if a state of `shape` [..., rows, cols] holds its last
    two axes swapped: [..., cols, rows], with rows != cols. `rows` and `cols`
    are the sizes the other inputs give (`given_by` says which); `hint` says
    where the swapped layout comes from."""
    if rows != cols and tuple(shape[-2:]) == (cols, rows):
        expected = (*shape[:-2], rows, cols)
        raise ValueError(f"`{name}` must have shape [{dims}] = {expected} ({given_by}); got {tuple(shape)}, "
                         f"its last two axes swapped: {hint}")


def check_buffer_dtype(buffer_dtype) -> np.dtype:
    """`buffer_dtype` as a floating dtype other than float16."""
    try:
        dtype = jnp.dtype(buffer_dtype)
    except TypeError:
        raise TypeError(f"`buffer_dtype` must be a floating dtype; got {buffer_dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`buffer_dtype` must be a floating dtype; got {dtype}")
    if dtype == jnp.float16:
        raise TypeError(f"`buffer_dtype` must not be float16: {FLOAT16_OVERFLOWS}; got {dtype}")
    return dtype


def _sequence_dims(rows_name: str, rows, rows_axes: str, cols_name: str, cols, cols_axes: str):
    """(seqlen, state shape (batch, heads, rows, cols)) of a chunked op, read
    off its row input (x or v, [batch, seqlen, heads, rows]) and its column
    input (B or k, [batch, seqlen, groups, cols])."""
    rows = check_ssm_float(rows_name, rows)
    check_rank(rows_name, rows, rows_axes)
    cols = check_ssm_float(cols_name, cols)
    check_rank(cols_name, cols, cols_axes)
    batch, T, heads, R = rows.shape
    return T, (batch, heads, R, cols.shape[-1])


def _check_initial_state(state, dims, names: str, given_by: str, hint: str):
    """None, or the state at a sequence's start as a JAX array of shape `dims`
    (a swapped layout named by :func:`check_layout`)."""
    if state is None:
        return None
    state = check_state_array("state", state, names)
    check_layout("state", state.shape, names, dims[2], dims[3], given_by, hint)
    check_shape("state", state, names, dims)
    return state


def check_replay_state(state, kind: type) -> None:
    """Raise TypeError / ValueError unless `state` is a consistent `kind`
    (:class:`Mamba2ReplayState` or :class:`GDNReplayState`): a checkpoint of
    rank 4, buffers of the shapes it implies with one L, float32 decays, an
    int32 cursor [batch] with concrete values in [0, L]."""
    if not isinstance(state, kind):
        raise TypeError(f"`state` must be a {kind.__name__}; got {type(state).__name__}")
    mamba = kind is Mamba2ReplayState
    check_checkpoint(state, MAMBA2_DIMS if mamba else GDN_DIMS)
    batch, heads, rows, cols = state.checkpoint.shape
    record, key, decay = ("x", "B", "dt") if mamba else ("d", "k", "g")
    axes = ({record: "batch, nheads, L, head_dim", key: "batch, n_groups, L, d_state", decay: "batch, nheads, L"}
            if mamba else {record: "batch, HV, L, V", key: "batch, H, L, K", decay: "batch, HV, L"})
    buffers = {name: getattr(state, name) for name in axes}
    for name, b in buffers.items():
        # records: the buffer dtype (not float16); the decays (processed dt, log g): float32, as init makes
        check_ssm_float(f"state.{name}", b, (jnp.float32,) if name == decay else None)
        check_rank(f"state.{name}", b, axes[name])
    if len({b.shape[2] for b in buffers.values()}) > 1:  # L is axis 2 of each
        raise ValueError("`state`'s buffers must have the same number of slots L (axis 2); got "
                         + ", ".join(f"state.{name} {tuple(b.shape)}" for name, b in buffers.items()))
    if not isinstance(state.cursor, (jax.Array, np.ndarray)):
        raise TypeError(f"`state.cursor` must be an int32 array of shape [batch] = ({batch},); "
                        f"got {type(state.cursor).__name__} {state.cursor!r}")
    L = state.buffer_len
    expected = {record: (batch, heads, L, rows), key: (batch, buffers[key].shape[1], L, cols), decay: (batch, heads, L)}
    source = f"from state.checkpoint's shape {tuple(state.checkpoint.shape)} and L = {L}"
    for name, shape in expected.items():
        check_shape(f"state.{name}", buffers[name], axes[name], shape, source)
    check_shape("state.cursor", state.cursor, "batch", (batch,))
    if state.cursor.dtype != jnp.int32:
        raise TypeError(f"`state.cursor` must be int32; got {state.cursor.dtype}")
    if not isinstance(state.cursor, jax.core.Tracer):  # concrete values are checked; traced ones cannot be
        cursor = np.asarray(state.cursor)
        if ((cursor < 0) | (cursor > L)).any():
            raise ValueError(f"`state.cursor` must be in [0, {L}] (the buffer length) for every row; "
                             f"got {cursor.tolist()}")


def check_checkpoint_dtype(name: str, dtype) -> np.dtype:
    """`dtype` (a replay checkpoint's) as a dtype among
    :data:`replayssm_jax.state.CHECKPOINT_DTYPES` (float32, bfloat16, int8,
    float8_e4m3fn); TypeError naming `name` otherwise."""
    names = ", ".join(d.name for d in CHECKPOINT_DTYPES)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"`{name}` must be a checkpoint dtype ({names}); got {dtype!r}") from None
    if dtype not in CHECKPOINT_DTYPES:
        raise TypeError(f"`{name}` must be a checkpoint dtype ({names}); got {dtype}")
    return dtype


def check_rounding(name: str, rounding) -> str:
    """`rounding` if it is one of :data:`replayssm_jax.state.ROUNDINGS`; ValueError naming `name` otherwise."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, ROUNDINGS))}; got {rounding!r}")
    return rounding


def check_checkpoint(state, dims: str) -> None:
    """A replay state's checkpoint: rank 4, float32 | bfloat16 with no scale
    and no counter, or int8 | float8_e4m3fn with `state.scale` f32[batch,
    heads, V] (one scale per row, over the K axis), `state.counter`
    i32[batch] and a known `state.rounding`."""
    checkpoint = state.checkpoint
    if not isinstance(checkpoint, (jax.Array, np.ndarray)) or not is_quantized(checkpoint.dtype):
        check_state_array("state.checkpoint", checkpoint, dims)
        for name in ("scale", "counter"):
            if getattr(state, name) is not None:
                raise ValueError(f"`state.{name}` must be None for a {checkpoint.dtype} checkpoint (only int8 and "
                                 f"float8_e4m3fn checkpoints are scaled); got an array")
        return
    check_rank("state.checkpoint", checkpoint, dims)
    batch, heads, rows, _ = checkpoint.shape
    if state.scale is None:
        raise ValueError(f"`state.scale` must be an f32 array of shape [{dims.rsplit(', ', 1)[0]}] = "
                         f"{(batch, heads, rows)} for a {checkpoint.dtype} checkpoint; got None")
    check_float("state.scale", state.scale, (jnp.float32,))
    check_shape("state.scale", state.scale, dims.rsplit(", ", 1)[0], (batch, heads, rows))
    if not isinstance(state.counter, (jax.Array, np.ndarray)) or state.counter.dtype != jnp.int32:
        raise TypeError(f"`state.counter` must be an int32 array of shape [batch] = ({batch},) for a "
                        f"{checkpoint.dtype} checkpoint; got {getattr(state.counter, 'dtype', state.counter)!r}")
    check_shape("state.counter", state.counter, "batch", (batch,))
    check_rounding("state.rounding", state.rounding)


def check_no_pending_window(state) -> None:
    """Raise ValueError if `state` holds a verified window not yet committed
    (a step, verify or flush then would drop or double-count its records)."""
    if state.window:
        raise ValueError(f"`state` has a pending verify window (W = {state.window}); call replay_commit first")


def check_window(W: int, L: int, name: str) -> None:
    """Raise ValueError unless 1 <= W <= L (`name`: where W was read)."""
    if not 1 <= W <= L:
        raise ValueError(f"the window length W = {name} must be in [1, L = {L}]; got {W}")


# What the ops read of a draft tree (replayssm_jax.speculative.tree.DraftTree).
TREE_INTERFACE = ("parents", "size", "depth", "ancestors", "path", "is_chain", "tag")


def check_tree(tree, W: int, name: str):
    """A verify's `tree`: None, or a DraftTree of W nodes (`name`: where W
    was read); returns it. A tree needs no more slots than a window of its
    N nodes (N <= L, checked by :func:`check_window`).

    Raises:
      TypeError: not a DraftTree.
      ValueError: a tree of another size than W.
    """
    if tree is None:
        return None
    # The interface of replayssm_jax.speculative.tree.DraftTree (not imported here: the speculative package
    # imports the ops).
    if not all(hasattr(tree, name) for name in TREE_INTERFACE):
        raise TypeError(f"`tree` must be None or a DraftTree; got {type(tree).__name__}")
    if tree.size != W:
        raise ValueError(f"`tree` must have one node per verified position, N = {name} = {W}; got a tree of "
                         f"{tree.size} nodes")
    return tree


def tree_parents(tree) -> tuple[int, ...] | None:
    """What a pending window records of its verify's `tree` (a DraftTree, checked): its parents, or None for a
    chain's window."""
    return None if tree is None else tuple(tree.parents)


def check_commit_path(path, num_accepted: jax.Array, window: int, tree: tuple[int, ...] | None) -> jax.Array | None:
    """A commit's `path` against the pending window's `tree` (the verified draft tree's parents, None after a
    chain's verify): required after a tree's verify, refused after a chain's, then :func:`check_path`.

    Raises:
      TypeError, ValueError: as :func:`check_path`, or a path given (missing) where the window is a chain's
        (a tree's).
    """
    if (path is None) != (tree is None):
        raise ValueError("`path` is required after a draft tree's verify (the accepted nodes, root first)"
                         if path is None else
                         "`path` is for a draft tree's window; the pending window is a chain's (verify without "
                         "`tree`): commit it with path None")
    return check_path(path, num_accepted, window, tree)


def check_path(path, num_accepted: jax.Array, window: int, parents: tuple[int, ...] | None = None) -> jax.Array | None:
    """A commit's `path`: None, or int[batch, P] of node indices of a verified draft tree (1 <= P <=
    window), as i32; values checked where concrete: node indices in 0..window - 1, num_accepted <= P,
    and each row's kept nodes path[b, :m] a path from the root down (node 0 first; with the tree's
    `parents`, as `DraftTree.parents`, each next node a child of the one before).

    Raises:
      TypeError: a non-integer dtype.
      ValueError: another shape, or a concrete value out of range or off the tree.
    """
    if path is None:
        return None
    batch = num_accepted.shape[0]
    path = as_array("path", np.asarray(path) if isinstance(path, (list, tuple)) else path)
    if path.ndim != 2 or path.shape[0] != batch or not 1 <= path.shape[1] <= window:
        raise ValueError(f"`path` must have shape [batch, P] with batch = {batch}, 1 <= P <= W = {window}; got "
                         f"{path.shape}")
    path = check_int_range("path", path, "batch, P", path.shape, 0, window - 1)
    if isinstance(num_accepted, jax.core.Tracer):
        return path.astype(jnp.int32)
    m = np.asarray(num_accepted)
    if int(m.max(initial=0)) > path.shape[1]:
        raise ValueError(f"`num_accepted` must be <= the path length P = {path.shape[1]}; got {int(m.max())}")
    if not isinstance(path, jax.core.Tracer):
        _check_path_nodes(np.asarray(path), m, parents)
    return path.astype(jnp.int32)


def _check_path_nodes(path: np.ndarray, m: np.ndarray, parents: tuple[int, ...] | None) -> None:
    """ValueError unless each row's kept nodes path[b, :m[b]] start at the root (node 0) and, with
    `parents`, each is a child of the one before."""
    for b in range(path.shape[0]):
        kept = path[b, :m[b]]
        if kept.size and kept[0] != 0:
            raise ValueError(f"`path` must start at the root, node 0; row {b} starts at node {kept[0]}")
        if parents is None:
            continue
        for i in range(1, kept.size):
            if parents[kept[i]] != kept[i - 1]:
                raise ValueError(f"`path` must follow the draft tree's edges; row {b}: node {kept[i]} (position "
                                 f"{i}) has parent {parents[kept[i]]}, not node {kept[i - 1]}")


def _check_replay_init(checkpoint, buffer_len, shared, buffer_dtype, dims, shared_name, heads, shared_heads):
    checkpoint = check_state_array("checkpoint", checkpoint, dims)
    L = check_positive_int("buffer_len", buffer_len)
    shared = check_positive_int(shared_name, shared)
    check_divisible(heads, checkpoint.shape[1], shared_heads, shared)
    return checkpoint, L, shared, check_buffer_dtype(buffer_dtype)


def check_mamba2_replay_init(checkpoint, buffer_len, n_groups, buffer_dtype):
    """Checks of :func:`replayssm_jax.ops.mamba2_replay_init`.

    Returns:
      (checkpoint as a JAX array, L, n_groups, buffer_dtype as a dtype).
    """
    return _check_replay_init(checkpoint, buffer_len, n_groups, buffer_dtype, MAMBA2_DIMS, "n_groups", "nheads",
                              "n_groups")


def check_gdn_replay_init(checkpoint, buffer_len, num_k_heads, buffer_dtype):
    """Checks of :func:`replayssm_jax.ops.gdn_replay_init`.

    Returns:
      (checkpoint as a JAX array, L, num_k_heads, buffer_dtype as a dtype).
    """
    return _check_replay_init(checkpoint, buffer_len, num_k_heads, buffer_dtype, GDN_DIMS, "num_k_heads",
                              "HV (value heads)", "H (key heads)")


def check_replay_commit(state, num_accepted) -> jax.Array:
    """Checks of :func:`replayssm_jax.ops.replay_commit`; returns `num_accepted` as i32[batch]."""
    if not isinstance(state, (Mamba2ReplayState, GDNReplayState)):
        raise TypeError(f"`state` must be a Mamba2ReplayState or GDNReplayState; got {type(state).__name__}")
    if state.window == 0:
        raise ValueError("`state` has no pending verify window (window = 0); call a replay verify op before "
                         "replay_commit")
    return check_int_range("num_accepted", num_accepted, "batch", (state.batch,), 0, state.window)


# --------------------------------------------------------------------------
# Mamba-2 ops


def check_dt_offset_value(dt_offset) -> int | None:
    """The ops' dt_offset as a Python int >= 0, or None: a column index fixed at trace time (TypeError for
    a traced value, a non-integer; ValueError below 0)."""
    if dt_offset is None:
        return None
    if isinstance(dt_offset, jax.core.Tracer):
        raise TypeError("`dt_offset` must be a static int (a column fixed at trace time: under jit, a static "
                        f"argument or a constant); got a traced value {dt_offset.aval}")
    return check_positive_int("dt_offset", dt_offset, minimum=0)


def check_dt_offset(dt, dt_offset: int, lead: tuple[int, ...], lead_names: str, H: int) -> None:
    """A dt of [*lead, X] holding the nheads raw values at columns dt_offset .. dt_offset + nheads - 1 (the
    ops' dt_offset, checked by `check_dt_offset_value`: a wider array, such as Mamba-2's in_proj output
    zxbcdt)."""
    offset = dt_offset
    dt = check_ssm_float("dt", dt)
    check_rank("dt", dt, f"{lead_names}, X")
    if tuple(dt.shape[:-1]) != tuple(lead) or dt.shape[-1] < offset + H:
        raise ValueError(f"`dt` with dt_offset = {offset} must have shape [{lead_names}, X] with leading axes "
                         f"{tuple(lead)} and X >= dt_offset + nheads = {offset + H}; got {tuple(dt.shape)}")


def check_mamba2_inputs(dims, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, *, seq=None,
                        seq_name="seqlen", groups=None, state_name="state",
                        dt_offset=None) -> tuple[bool, tuple[float, float]]:
    """The inputs of one Mamba-2 step (seq None) or of `seq` steps.

    Args:
      dims: (batch, nheads, head_dim, d_state), the shape of the state
        `state_name` (whose last two axes are blamed if swapped).
      x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, dt_offset: as
        :func:`replayssm_jax.ops.mamba2_step`, with a `seq` axis after batch
        if `seq` is given (named `seq_name`).
      groups: the n_groups that B and C must have (a replay state's), or
        None (any divisor of nheads).

    Returns:
      (dt_softplus as a bool, dt_limit as a (low, high) pair of floats).
    """
    batch, H, P, N = dims
    lead, lead_names = ((batch,), "batch") if seq is None else ((batch, seq), f"batch, {seq_name}")
    x = check_ssm_float("x", x)
    B = check_ssm_float("B", B)
    if x.ndim and B.ndim:
        check_layout(state_name, dims, MAMBA2_DIMS, x.shape[-1], B.shape[-1], "head_dim of `x`, d_state of `B`",
                     MAMBA2_LAYOUT)
    check_shape("x", x, f"{lead_names}, nheads, head_dim", (*lead, H, P))
    if dt_offset is None:
        ssm_arg("dt", dt, f"{lead_names}, nheads", (*lead, H))
    else:
        check_dt_offset(dt, dt_offset, lead, lead_names, H)
    ssm_arg("A", A, "nheads", (H,))
    check_negative("A", A, "A = -exp(A_log)")
    check_rank("B", B, f"{lead_names}, n_groups, d_state")
    G = B.shape[-2]
    if groups is not None and G != groups:
        raise ValueError(f"`B` must have n_groups = {groups} (the state's); got {G}")
    check_divisible("nheads", H, "n_groups = B.shape[-2]", G)
    check_shape("B", B, f"{lead_names}, n_groups, d_state", (*lead, G, N))
    C = check_ssm_float("C", C)
    check_rank("C", C, f"{lead_names}, n_groups, d_state")
    if C.shape[-2] != G:
        raise ValueError(f"`C` must have n_groups = {G} (the state's); got {C.shape[-2]}" if groups is not None else
                         f"`B` and `C` must have the same n_groups; got {G} and {C.shape[-2]}")
    check_shape("C", C, f"{lead_names}, n_groups, d_state", (*lead, G, N))
    optional_ssm_arg("D", D, "nheads", (H,))
    optional_ssm_arg("z", z, f"{lead_names}, nheads, head_dim", (*lead, H, P))
    optional_ssm_arg("dt_bias", dt_bias, "nheads", (H,))
    return check_bool("dt_softplus", dt_softplus), check_dt_limit(dt_limit)


def check_mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, slots=None, dt_offset=None):
    """Checks of :func:`replayssm_jax.ops.mamba2_step` (`slots`: :func:`check_slots`).

    Returns:
      (state as a JAX array, dt_softplus, dt_limit as :func:`check_mamba2_inputs`, slots).
    """
    state = check_state_array("state", state, MAMBA2_DIMS)
    slots = check_slots(slots, state.shape[0], state, ("x", x))
    return (state, *check_mamba2_inputs(batch_dims(state.shape, slots), x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                        dt_limit, dt_offset=dt_offset), slots)


def check_mamba2_chunked(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, chunk_size, dt_offset=None):
    """Checks of :func:`replayssm_jax.ops.mamba2_chunked`.

    Returns:
      (state: None or a JAX array, dt_softplus, dt_limit, chunk_size as an int).
    """
    T, dims = _sequence_dims("x", x, "batch, seqlen, nheads, head_dim", "B", B, "batch, seqlen, n_groups, d_state")
    state = _check_initial_state(state, dims, MAMBA2_DIMS, "head_dim of `x`, d_state of `B`", MAMBA2_LAYOUT)
    dt_softplus, dt_limit = check_mamba2_inputs(dims, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, seq=T,
                                                dt_offset=dt_offset)
    return state, dt_softplus, dt_limit, check_positive_int("chunk_size", chunk_size)


def check_mamba2_replay_materialize(state, A) -> None:
    """Checks of :func:`replayssm_jax.ops.mamba2_replay_materialize`: the state and `A`."""
    check_replay_state(state, Mamba2ReplayState)
    ssm_arg("A", A, "nheads", (state.checkpoint.shape[1],))
    check_negative("A", A, "A = -exp(A_log)")


def check_mamba2_replay_flush(state, A) -> None:
    """Checks of :func:`replayssm_jax.ops.mamba2_replay_flush`: the state and `A`, no pending window."""
    check_mamba2_replay_materialize(state, A)
    check_no_pending_window(state)


def check_mamba2_replay_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, slots=None, dt_offset=None):
    """Checks of :func:`replayssm_jax.ops.mamba2_replay_step` (but `route`; `slots`: :func:`check_slots`).

    Returns:
      (dt_softplus, dt_limit as :func:`check_mamba2_inputs`, slots).
    """
    check_mamba2_replay_flush(state, A)
    slots = check_slots(slots, state.checkpoint.shape[0], state, ("x", x))
    return (*check_mamba2_inputs(batch_dims(state.checkpoint.shape, slots), x, dt, A, B, C, D, z, dt_bias,
                                 dt_softplus, dt_limit, groups=state.B.shape[1], state_name="state.checkpoint",
                                 dt_offset=dt_offset), slots)


def check_mamba2_replay_verify(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, tree=None, slots=None,
                               dt_offset=None):
    """Checks of :func:`replayssm_jax.ops.mamba2_replay_verify`: also 1 <= W <= L, a `tree` of W nodes
    (`slots`: :func:`check_slots`; a tree not with slots).

    Returns:
      (dt_softplus, dt_limit as :func:`check_mamba2_inputs`, slots).
    """
    check_mamba2_replay_flush(state, A)
    slots = check_slots(slots, state.checkpoint.shape[0], state, ("x", x))
    check_no_tree_with_slots(tree, slots)
    x = check_ssm_float("x", x)
    check_rank("x", x, "batch, W, nheads, head_dim")
    W = x.shape[1]
    check_window(W, state.buffer_len, "x.shape[1]")
    check_tree(tree, W, "x.shape[1]")
    return (*check_mamba2_inputs(batch_dims(state.checkpoint.shape, slots), x, dt, A, B, C, D, z, dt_bias,
                                 dt_softplus, dt_limit, seq=W, seq_name="W", groups=state.B.shape[1],
                                 state_name="state.checkpoint", dt_offset=dt_offset), slots)


def check_no_tree_with_slots(tree, slots) -> None:
    """Raise ValueError for a draft `tree` with `slots`: a state pool verifies chain windows only."""
    if tree is not None and slots is not None:
        raise ValueError("`tree` with `slots`: a verify over a state pool takes chain windows only (tree None)")


def check_slotted_state(state, index, dims: str, W: int, W_name: str, tree=None, slots=None):
    """The slotted standard state of a per-draft verify, its `index` and the window.

    Args:
      state: f32 | bf16[batch, slots, heads, V, K] (`dims` names the axes).
      index: int[batch], each row's slot of the current state, in 0..slots - 1.
      W: the window length, read from `W_name`; 1 <= W <= slots - 1 (the
        current state's slot is never a draft's).
      tree: None or a DraftTree of W nodes.
      slots: None, or the state pool's slots of the batch rows (`state` and
        `index` then hold `capacity` rows; :func:`check_slots`).

    Returns:
      (state as a JAX array, index as i32, the shape of one slot's state
      (batch, heads, V, K), with the slots' batch where given; slots).

    Raises:
      TypeError: an 8-bit, float16 or non-floating state; a non-integer index.
      ValueError: a state of another rank or an empty axis, an index of
        another shape or (concrete) out of range, W outside [1, slots - 1],
        a tree of another size.
    """
    pool_slots = slots
    state = check_state_array("state", state, dims)
    batch, slots = state.shape[:2]
    index = check_int_range("index", index, "batch", (batch,), 0, slots - 1)
    if not 1 <= W <= slots - 1:
        raise ValueError(f"the window length W = {W_name} must be in [1, slots - 1 = {slots - 1}] (`state` has "
                         f"{slots} slots: the current state's and one per draft position); got {W}")
    check_tree(tree, W, W_name)
    slots = check_slots(pool_slots, batch, state)
    check_no_tree_with_slots(tree, slots)
    return state, index, batch_dims((batch, *state.shape[2:]), slots), slots


def check_mamba2_verify(state, index, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, tree=None, slots=None,
                        dt_offset=None):
    """Checks of :func:`replayssm_jax.ops.mamba2_verify`.

    Returns:
      (state, index as i32, dt_softplus, dt_limit, slots) as :func:`check_slotted_state`
      and :func:`check_mamba2_inputs`.
    """
    W, (state, index, dims, slots) = _per_draft_window(state, index, "x", x, "batch, W, nheads, head_dim",
                                                       SLOTTED_MAMBA2_DIMS, tree, slots)
    return (state, index, *check_mamba2_inputs(dims, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, seq=W,
                                               seq_name="W", dt_offset=dt_offset), slots)


def _per_draft_window(state, index, name: str, first, layout: str, dims: str, tree, slots):
    """(W, :func:`check_slotted_state`'s result) of a per-draft verify whose input `name` (`first`, of
    `layout` with W on axis 1) gives the window."""
    first = check_ssm_float(name, first)
    check_rank(name, first, layout)
    W = first.shape[1]
    return W, check_slotted_state(state, index, dims, W, f"{name}.shape[1]", tree, slots)


# --------------------------------------------------------------------------
# Gated DeltaNet ops


class GDNGates(NamedTuple):
    """The gate arguments of a Gated DeltaNet op: g and beta, or the raw a, b,
    A_log and dt_bias (the other form's fields None)."""

    g: Any = None
    beta: Any = None
    a: Any = None
    b: Any = None
    A_log: Any = None
    dt_bias: Any = None

    @property
    def raw(self) -> bool:
        """Whether the gates are the raw projections and parameters."""
        return self.A_log is not None

    def keywords(self) -> dict:
        """The given form's arguments by name (a kernel op's keywords)."""
        return {name: x for name, x in self._asdict().items() if x is not None}


GATE_FORMS = "`g` and `beta`, or the raw `a`, `b`, `A_log` and `dt_bias`"


def check_gdn_gate_form(gates: GDNGates) -> None:
    """Raise TypeError unless `gates` holds exactly one whole form (checked before the shapes)."""
    given = [name for name, x in gates._asdict().items() if x is not None]
    if given not in (["g", "beta"], ["a", "b", "A_log", "dt_bias"]):
        raise TypeError(f"the gates must be given as {GATE_FORMS} (g = -exp(A_log) softplus(a + dt_bias), "
                        f"beta = sigmoid(b)); got {', '.join(f'`{n}`' for n in given) or 'none of them'}")


def _check_gdn_gates(gates: GDNGates, lead: tuple[int, ...], names: str, HV: int) -> None:
    """The gates' shapes and values (`check_gdn_gate_form` first)."""
    check_gdn_gate_form(gates)
    if gates.raw:
        ssm_arg("a", gates.a, f"{names}, HV", (*lead, HV))
        ssm_arg("b", gates.b, f"{names}, HV", (*lead, HV))
        ssm_arg("A_log", gates.A_log, "HV", (HV,))
        ssm_arg("dt_bias", gates.dt_bias, "HV", (HV,))
        return
    ssm_arg("g", gates.g, f"{names}, HV", (*lead, HV))
    check_non_positive("g", gates.g, "a log decay: exp(g) > 1 would amplify the state")
    ssm_arg("beta", gates.beta, f"{names}, HV", (*lead, HV))
    check_closed_range("beta", gates.beta, 0.0, 2.0, "a delta-rule write strength: outside it I - beta k k^T "
                                                     "amplifies the state along a unit k")


def check_gdn_inputs(dims, q, k, v, gates: GDNGates, scale, use_qk_l2norm, *, seq=None, seq_name="seqlen",
                     heads=None, state_name="state") -> tuple[float, bool]:
    """The inputs of one Gated DeltaNet step (seq None) or of `seq` steps.

    Args:
      dims: (batch, HV, V, K), the shape of the state `state_name` (whose
        last two axes are blamed if swapped).
      q, k, v, scale, use_qk_l2norm: as :func:`replayssm_jax.ops.gdn_step`,
        with a `seq` axis after batch if `seq` is given (named `seq_name`).
      gates: a GDNGates of one whole form (TypeError otherwise), a, b, g and
        beta with q's leading axes.
      heads: the key heads H that q and k must have (a replay state's), or
        None (any divisor of HV).

    Returns:
      (scale as a float, K ** -0.5 if None; use_qk_l2norm as a bool).
    """
    batch, HV, V, K = dims
    lead, names = ((batch,), "batch") if seq is None else ((batch, seq), f"batch, {seq_name}")
    q = check_ssm_float("q", q)
    v = check_ssm_float("v", v)
    if q.ndim and v.ndim:
        check_layout(state_name, dims, GDN_DIMS, v.shape[-1], q.shape[-1], "V of `v`, K of `q`", GDN_LAYOUT)
    check_rank("q", q, f"{names}, H, K")
    H = q.shape[-2]
    if heads is not None and H != heads:
        raise ValueError(f"`q` and `k` must have H = {heads} key heads (the state's); got {H}")
    check_divisible("HV (value heads)", HV, "H (key heads) = q.shape[-2]", H)
    check_shape("q", q, f"{names}, H, K", (*lead, H, K))
    k = check_ssm_float("k", k)
    check_rank("k", k, f"{names}, H, K")
    if k.shape[-2] != H:
        raise ValueError(f"`q` and `k` must have the same H (key heads); got {H} and {k.shape[-2]}")
    check_shape("k", k, f"{names}, H, K", (*lead, H, K))
    check_shape("v", v, f"{names}, HV, V", (*lead, HV, V))
    _check_gdn_gates(gates, lead, names, HV)
    scale = check_scale(scale)
    return (K ** -0.5 if scale is None else scale), check_bool("use_qk_l2norm", use_qk_l2norm)


def check_gdn_step(state, q, k, v, gates, scale, use_qk_l2norm, slots=None):
    """Checks of :func:`replayssm_jax.ops.gdn_step` (`slots`: :func:`check_slots`).

    Returns:
      (state as a JAX array, scale, use_qk_l2norm as :func:`check_gdn_inputs`, slots).
    """
    state = check_state_array("state", state, GDN_DIMS)
    slots = check_slots(slots, state.shape[0], state, ("q", q))
    return (state, *check_gdn_inputs(batch_dims(state.shape, slots), q, k, v, gates, scale, use_qk_l2norm), slots)


def check_gdn_conv_step(state, x, columns, start, weight, gates, scale, use_qk_l2norm, activation, activations,
                        num_k_heads):
    """Checks of :func:`replayssm_jax.ops.gdn_conv_step`: the conv's as :func:`check_conv_update` (no bias, x
    holding the C channels alone), the state f32 | bf16[batch, HV, V, K] of x's batch, num_k_heads H a
    positive int dividing HV with C = 2 H K + HV V (a state in transformers' [batch, HV, K, V] layout named
    as such), and the gates, scale and use_qk_l2norm as :func:`check_gdn_inputs`.

    Returns:
      (state, x, columns, start, weight as arrays, scale as a float (K ** -0.5 if None), use_qk_l2norm).
    """
    H = check_positive_int("num_k_heads", num_k_heads)
    if getattr(x, "ndim", None) == 2 and getattr(columns, "ndim", None) == 3 and x.shape[1] != columns.shape[2]:
        raise ValueError(f"`x` must have C = {columns.shape[2]} columns (axis 2 of `columns`: the conv's channels); "
                         f"got {x.shape[1]}")
    x, columns, start, weight, _, activation, _, _ = check_conv_update(x, columns, start, weight, None, activation,
                                                                       activations)
    state = check_state_array("state", state, GDN_DIMS)
    batch, HV, V, K = state.shape
    check_shape("state", state, "batch, HV, V, K", (x.shape[0], HV, V, K), "batch of `x`")
    check_divisible("HV (axis 1 of `state`)", HV, "`num_k_heads`", H)
    C = x.shape[1]
    if C != 2 * H * K + HV * V:
        swapped = (" (K and V swapped: a state in transformers' [batch, HV, K, V] layout; transpose its last two "
                   "axes)" if V != K and C == 2 * H * V + HV * K else "")
        raise ValueError(f"`x` must have C = 2 H K + HV V = {2 * H * K + HV * V} columns (H = {H} `num_k_heads`, "
                         f"HV = {HV}, V = {V}, K = {K} from `state` [batch, HV, V, K]); got {C}{swapped}")
    _check_gdn_gates(gates, (batch,), "batch", HV)
    scale = check_scale(scale)
    return (state, x, columns, start, weight, K ** -0.5 if scale is None else scale,
            check_bool("use_qk_l2norm", use_qk_l2norm))


def check_gdn_chunked(state, q, k, v, gates, scale, use_qk_l2norm, chunk_size):
    """Checks of :func:`replayssm_jax.ops.gdn_chunked`.

    Returns:
      (state: None or a JAX array, scale, use_qk_l2norm, chunk_size as an int).
    """
    T, dims = _sequence_dims("v", v, "batch, seqlen, HV, V", "k", k, "batch, seqlen, H, K")
    state = _check_initial_state(state, dims, GDN_DIMS, "V of `v`, K of `k`", GDN_LAYOUT)
    scale, use_qk_l2norm = check_gdn_inputs(dims, q, k, v, gates, scale, use_qk_l2norm, seq=T)
    return state, scale, use_qk_l2norm, check_positive_int("chunk_size", chunk_size)


def check_gdn_replay_materialize(state) -> None:
    """Checks of :func:`replayssm_jax.ops.gdn_replay_materialize`: the state."""
    check_replay_state(state, GDNReplayState)


def check_gdn_replay_flush(state) -> None:
    """Checks of :func:`replayssm_jax.ops.gdn_replay_flush`: the state, no pending window."""
    check_replay_state(state, GDNReplayState)
    check_no_pending_window(state)


def check_gdn_replay_step(state, q, k, v, gates, scale, use_qk_l2norm, slots=None):
    """Checks of :func:`replayssm_jax.ops.gdn_replay_step` (but `route`; `slots`: :func:`check_slots`).

    Returns:
      (scale, use_qk_l2norm as :func:`check_gdn_inputs`, slots).
    """
    check_gdn_replay_flush(state)
    slots = check_slots(slots, state.checkpoint.shape[0], state, ("q", q))
    return (*check_gdn_inputs(batch_dims(state.checkpoint.shape, slots), q, k, v, gates, scale, use_qk_l2norm,
                              heads=state.k.shape[1], state_name="state.checkpoint"), slots)


def check_gdn_replay_verify(state, q, k, v, gates, scale, use_qk_l2norm, tree=None, slots=None):
    """Checks of :func:`replayssm_jax.ops.gdn_replay_verify`: also 1 <= W <= L, a `tree` of W nodes
    (`slots`: :func:`check_slots`; a tree not with slots).

    Returns:
      (scale, use_qk_l2norm as :func:`check_gdn_inputs`, slots).
    """
    check_gdn_replay_flush(state)
    slots = check_slots(slots, state.checkpoint.shape[0], state, ("q", q))
    check_no_tree_with_slots(tree, slots)
    v = check_ssm_float("v", v)
    check_rank("v", v, "batch, W, HV, V")
    W = v.shape[1]
    check_window(W, state.buffer_len, "v.shape[1]")
    check_tree(tree, W, "v.shape[1]")
    return (*check_gdn_inputs(batch_dims(state.checkpoint.shape, slots), q, k, v, gates, scale, use_qk_l2norm,
                              seq=W, seq_name="W", heads=state.k.shape[1], state_name="state.checkpoint"), slots)


def check_gdn_verify(state, index, q, k, v, gates, scale, use_qk_l2norm, tree=None, slots=None):
    """Checks of :func:`replayssm_jax.ops.gdn_verify`.

    Returns:
      (state, index as i32, scale, use_qk_l2norm, slots) as :func:`check_slotted_state`
      and :func:`check_gdn_inputs`.
    """
    W, (state, index, dims, slots) = _per_draft_window(state, index, "v", v, "batch, W, HV, V", SLOTTED_GDN_DIMS,
                                                       tree, slots)
    return (state, index, *check_gdn_inputs(dims, q, k, v, gates, scale, use_qk_l2norm, seq=W, seq_name="W"),
            slots)


def check_conv_update(x, columns, start, weight, bias, activation, activations, offset=None, splits=()):
    """The arguments of `ops.conv_update` (x [batch, C], or [batch, X] with offset + C <= X where `offset` is
    given; the ring columns [batch, S, C] with S >= W; start i32[batch] in [0, S); weight [C, W]; bias [C]
    or None; activation a name of `activations`; splits increasing in (0, C)); returns them, offset and
    splits as ints (offset None: 0)."""
    x = check_ssm_float("x", x)
    check_rank("x", x, "batch, X")
    batch = x.shape[0]
    columns = check_ssm_float("columns", columns)
    check_rank("columns", columns, "batch, S, C")
    C = columns.shape[2]
    check_shape("columns", columns, "batch, S, C", (batch, columns.shape[1], C), "batch of `x`")
    offset, splits = check_pieces(offset, splits, x.shape[1], C)
    weight = check_ssm_float("weight", weight)
    check_rank("weight", weight, "C, W")
    if weight.shape[0] != C:
        raise ValueError(f"`weight` must have shape [C, W] with C = {C} (axis 2 of `columns`); got "
                         f"{tuple(weight.shape)}")
    W = weight.shape[1]
    if columns.shape[1] < W:
        raise ValueError(f"`columns` must hold at least W = {W} slots (axis 1, S = W - 1 + max_window); "
                         f"got {columns.shape[1]}")
    start = check_int_range("start", start, "batch", (batch,), 0, columns.shape[1] - 1)
    bias = optional_ssm_arg("bias", bias, "C", (C,))
    if activation not in activations:
        raise ValueError(f"`activation` must be one of {sorted(activations)}; got {activation!r}")
    return x, columns, start, weight, bias, activation, offset, splits


ATTENTION_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_attention_decode(q, k, v, length, scale):
    """The arguments of `ops.attention_decode` (q [batch, HQ, D]; k, v [batch, S, HK, D] of q's dtype, HK
    dividing HQ; length int[batch] in [1, S]; scale None or a finite number); returns them with length as
    i32 and scale as a float (None: D ** -0.5)."""
    q = check_float("q", q, ATTENTION_DTYPES)
    check_rank("q", q, "batch, HQ, D")
    batch, heads, d = q.shape
    k = check_float("k", k, (q.dtype,))
    check_rank("k", k, "batch, S, HK, D")
    check_shape("k", k, "batch, S, HK, D", (batch, k.shape[1], k.shape[2], d), "batch and D of `q`")
    v = check_float("v", v, (q.dtype,))
    check_shape("v", v, "batch, S, HK, D", k.shape, "the shape of `k`")
    check_divisible("HQ (axis 1 of `q`)", heads, "HK (axis 2 of `k`)", k.shape[2])
    length = check_int_range("length", length, "batch", (batch,), 1, k.shape[1])
    scale = check_scale(scale)
    return q, k, v, length, d ** -0.5 if scale is None else scale


def check_backend_name(name: str, backend):
    """A backend choice by name, "pallas", "interpret", "xla" or None, checked where it is configured (its
    platform is checked where an op runs: `dispatch.resolve_backend`).

    Raises:
      TypeError: neither a str nor None; ValueError: another name (each naming `name`).
    """
    names = ", ".join(map(repr, BACKENDS))
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"`{name}` must be a str ({names}) or None; got {type(backend).__name__} {backend!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"`{name}` must be one of {names} or None; got {backend!r}")
    return backend
