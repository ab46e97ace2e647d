"""Export and import of one sequence's whole decode state: backup, restore, and moving a
sequence from one decode cache to another.

A sequence's decode state is its row of every array of a model's decode
cache (`models.HybridCache`, or any pytree of the per-layer states of
:mod:`replayssm_jax.layers.cache` whose arrays have the batch on axis 0):

- ReplaySSM layers: the checkpoint (with an 8-bit checkpoint's scales and
  write count), the buffered records and the cursor, as they are. The
  pending records are kept, not folded into the checkpoint, so a restored
  sequence continues with the same buffer, flushes at the same step and
  gives the same outputs (a backup that folded the buffer, or dropped it,
  would change the numbers or lose steps): bit for bit in a cache of the
  same batch size, at the same row where the checkpoint rounds
  stochastically (its rounding noise is keyed by the batch row); XLA may
  round a batch of another size differently, about 1e-7 relative;
- standard SSM layers: the state; conv layers: the ring of conv inputs and
  its start;
- attention layers: the K/V of the positions before the row's length (the
  slots past it hold nothing the row reads), and the length;
- the position.

A cache with a pending verify window cannot be exported (commit it
first): the window's records and K/V are not yet the sequence's.

:func:`export_sequence` takes the row to host memory as a
:class:`SequenceState`, :func:`import_sequence` writes one into a row of
another cache of the same model and layout (the KV caches may be longer
than the sequence), and :func:`save_sequence` / :func:`load_sequence`
store it as a safetensors file (each array under its path in the cache,
bit for bit, dtypes in the metadata).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from replayssm_jax.layers.cache import KVCache

__all__ = ["SequenceState", "SequenceStateError", "export_sequence", "import_sequence", "save_sequence",
           "load_sequence"]

FORMAT = "replayssm-jax.sequence-state/1"
_KV_FIELDS = ("k", "v")  # a KVCache's arrays with a sequence axis (axis 1 of the cache's)
_RECORD_FIELDS = ("x", "B", "d", "k")  # the ReplaySSM records whose dtype is the buffer_dtype


class SequenceStateError(ValueError):
    """A sequence state that does not fit the cache it is imported into, or a malformed file."""


@dataclasses.dataclass(frozen=True)
class SequenceState:
    """One sequence's decode state, on the host.

    Attributes:
      arrays: {path in the cache: the row's array without the batch axis}
        (NumPy, the cache's dtypes; a KV cache's k / v cut to the row's length).
      structure: the cache's tree structure as text, static fields included
        (state types, verify windows, conv widths, 8-bit rounding), and the tp
        of the mesh of a sharded model's cache (tp > 1): an import requires
        the same.
      model: a name of the model the state belongs to (the caller's, e.g. a
        checkpoint folder), or None; an import that names one requires the same.
    """

    arrays: dict[str, np.ndarray]
    structure: str
    model: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays."""
        return sum(a.nbytes for a in self.arrays.values())


def _leaves(cache) -> list[tuple[str, jax.Array, bool]]:
    """(path, array, is a KV cache's k / v) of every array of `cache`, in tree order."""
    out = []
    flat, _ = jax.tree_util.tree_flatten_with_path(cache)
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        out.append((name, leaf, _in_kv_cache(cache, path)))
    return out


def _in_kv_cache(cache, path) -> bool:
    """Whether the leaf at `path` is the k or v array of a KVCache."""
    node = cache
    for key in path[:-1]:
        node = node[key.idx] if isinstance(key, jax.tree_util.SequenceKey) else getattr(node, key.name)
    last = path[-1]
    return isinstance(node, KVCache) and getattr(last, "name", None) in _KV_FIELDS


def _kv_lengths(cache) -> dict[str, jax.Array]:
    """{path prefix of each KVCache: its length i32[batch]}."""
    lengths = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(cache, is_leaf=lambda x: isinstance(x, KVCache))
    for path, node in flat:
        if isinstance(node, KVCache):
            lengths[jax.tree_util.keystr(path)] = node.length
    return lengths


def _kv_prefix(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _batch(cache) -> int:
    leaves = jax.tree.leaves(cache)
    if not leaves:
        raise SequenceStateError("`cache` has no arrays")
    return int(leaves[0].shape[0])


def _check_row(row, batch: int) -> int:
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        raise TypeError(f"`row` must be an int; got {type(row).__name__}")
    if not 0 <= row < batch:
        raise SequenceStateError(f"`row` must be in [0, {batch}) (the cache's batch); got {row}")
    return int(row)


def _check_committed(cache, what: str) -> None:
    is_state = lambda x: hasattr(x, "window")  # noqa: E731  (a HybridCache or a layer's state)
    windows = [s.window for s in jax.tree.leaves(cache, is_leaf=is_state) if is_state(s)]
    if any(windows):
        raise SequenceStateError(f"{what}: the cache has a pending verify window (W = {max(windows)}); commit it "
                                 "first")


def _model_name(model, where: str) -> str | None:
    """`model` as stored with a state: a str, a path (os.PathLike, e.g. a checkpoint folder) as its str,
    or None. Raises TypeError naming `where`'s `model` otherwise."""
    if model is None or isinstance(model, str):
        return model
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    raise TypeError(f"{where}: `model` must be a str, a path or None; got {type(model).__name__} {model!r}")


# The mesh axis of tensor parallelism (models.sharding): a cache sharded over it keeps each conv window's
# channels in its shards' order, so a row moves only between caches of the same tp.
_TP_AXIS = "tp"


def _tp(leaf) -> int:
    """The tp of the mesh that `leaf` is sharded over (1: no mesh, or no tp axis)."""
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return mesh.shape[_TP_AXIS] if mesh is not None and _TP_AXIS in mesh.axis_names else 1


def _structure(cache) -> str:
    """The cache's tree structure as text, and, for a cache on a mesh with tp > 1, its tp: the layout that
    an imported row must share."""
    tp = max((_tp(leaf) for leaf in jax.tree.leaves(cache)), default=1)
    return str(jax.tree.structure(cache)) + (f" on a mesh of tp = {tp}" if tp > 1 else "")


def export_sequence(cache, row: int, *, model: str | os.PathLike | None = None) -> SequenceState:
    """Row `row` of `cache` as a :class:`SequenceState` on the host (the cache is not changed).

    Args:
      cache: a decode cache (`models.HybridCache` or a pytree of layer states)
        with no pending verify window.
      row: the batch row, in [0, batch).
      model: the model's name to store with the state (a path, e.g. the
        checkpoint folder, is stored as its str; None: none).

    Returns:
      The row's arrays without the batch axis; each KV cache's k / v up to
      the row's length.

    Raises:
      TypeError: a `row` that is not an int, a `model` that is not a str, a path or None.
      SequenceStateError: `row` out of range, a pending verify window, a cache without arrays.
    """
    model = _model_name(model, "export_sequence")
    row = _check_row(row, _batch(cache))
    _check_committed(cache, "export_sequence")
    lengths = {k: int(v[row]) for k, v in _kv_lengths(cache).items()}
    arrays = {}
    for name, leaf, kv in _leaves(cache):
        value = np.asarray(jax.device_get(leaf[row]))
        arrays[name] = value[: lengths[_kv_prefix(name)]] if kv else value
    return SequenceState(arrays, _structure(cache), model)


def import_sequence(cache, row: int, state: SequenceState, *, model: str | os.PathLike | None = None):
    """`cache` with row `row` replaced by `state` (a new cache; `cache` is not changed).

    Args:
      cache: a decode cache of the same model and layout as the exported one
        (state types, buffer length, dtypes, heads; its KV caches at least as
        long as the sequence), with no pending verify window.
      row: the batch row to write, in [0, batch).
      state: from :func:`export_sequence` or :func:`load_sequence`.
      model: if given, the model name `state` must carry (a path compared as its str).

    Returns:
      The cache with the row's every array set from `state`; a KV cache's
      slots past the sequence's length zeroed.

    Raises:
      TypeError: a `row` that is not an int, `state` not a SequenceState, a
        `model` that is not a str, a path or None.
      SequenceStateError: `row` out of range, a pending window, another
        model name, another tree structure (another model, state mode,
        checkpoint format, verify window room, rounding, or another tp of
        the mesh that a sharded model's cache lives on; the message
        shows where the two first differ), an array of another shape or dtype
        (named by its path in the cache), a KV cache shorter than the sequence.
    """
    if not isinstance(state, SequenceState):
        raise TypeError(f"`state` must be a SequenceState; got {type(state).__name__}")
    model = _model_name(model, "import_sequence")
    row = _check_row(row, _batch(cache))
    _check_committed(cache, "import_sequence")
    if model is not None and state.model != model:
        raise SequenceStateError(f"`state` belongs to model {state.model!r}; expected {model!r}")
    structure = _structure(cache)
    if state.structure != structure:
        raise SequenceStateError("`state` has another cache structure than `cache` (another model, state mode, "
                                 "checkpoint format (8-bit or not), verify window room, rounding or tensor "
                                 "parallelism); "
                                 + _first_difference(state.structure, structure))
    leaves = _leaves(cache)
    missing = sorted(set(name for name, _, _ in leaves) ^ set(state.arrays))
    if missing:
        raise SequenceStateError(f"`state` and `cache` differ in their arrays: {missing}")
    new = [_checked_row(name, leaf, kv, state.arrays[name]) for name, leaf, kv in leaves]
    updated = [leaf.at[row].set(value) for (_, leaf, _), value in zip(leaves, new)]
    return jax.tree.unflatten(jax.tree.structure(cache), updated)


def _first_difference(state: str, cache: str, context: int = 70) -> str:
    """Where two structures' texts first differ, with `context` characters on each side."""
    at = next((i for i, (a, b) in enumerate(zip(state, cache)) if a != b), min(len(state), len(cache)))
    start = max(0, at - context)

    def window(text):
        return ("..." if start else "") + text[start:at + context] + ("..." if at + context < len(text) else "")

    return f"they first differ at character {at}:\n  state: {window(state)}\n  cache: {window(cache)}"


def _checked_row(name: str, leaf: jax.Array, kv: bool, value: np.ndarray) -> jax.Array:
    """`value` as row `name` of `leaf` (a KV cache's k / v padded with zeros to its length), checked."""
    want = tuple(leaf.shape[1:])
    if np.dtype(value.dtype) != np.dtype(leaf.dtype):
        record = ".replay." in name and name.rsplit(".", 1)[-1] in _RECORD_FIELDS
        hint = (" (a ReplaySSM record: its dtype is the `buffer_dtype` the cache was made with; None, the "
                "default, takes each layer's exact one, float32 takes float32)") if record else ""
        raise SequenceStateError(f"`state` array {name} has dtype {value.dtype}; the cache's is {leaf.dtype}{hint}")
    if kv:
        if value.shape[1:] != want[1:] or value.shape[0] > want[0]:
            raise SequenceStateError(f"`state` array {name} has shape {value.shape}; the cache's rows are {want} "
                                     f"(a sequence of at most {want[0]} positions)")
        value = np.concatenate([value, np.zeros((want[0] - value.shape[0], *want[1:]), value.dtype)])
    elif value.shape != want:
        raise SequenceStateError(f"`state` array {name} has shape {value.shape}; the cache's rows are {want}")
    return jnp.asarray(value)


def save_sequence(path: str | os.PathLike, state: SequenceState) -> None:
    """Write `state` to a safetensors file: each array under its path in the cache, stored as
    unsigned integers of its width (bit for bit, whatever its dtype), with the dtypes, the
    structure and the model name in the metadata.

    Raises:
      TypeError: `state` not a SequenceState.
      FileNotFoundError: `path`'s folder does not exist (nothing is written).
    """
    if not isinstance(state, SequenceState):
        raise TypeError(f"`state` must be a SequenceState; got {type(state).__name__}")
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"save_sequence: the folder of `path` {os.fspath(path)!r} does not exist ({folder})")
    tensors = {name: np.array(a, order="C").view(f"u{a.dtype.itemsize}") for name, a in state.arrays.items()}
    dtypes = {name: a.dtype.name for name, a in state.arrays.items()}
    metadata = {"format": FORMAT, "structure": state.structure, "dtypes": json.dumps(dtypes),
                "model": json.dumps(state.model)}
    save_file(tensors, os.fspath(path), metadata=metadata)


def load_sequence(path: str | os.PathLike) -> SequenceState:
    """Read a file written by :func:`save_sequence`.

    Raises:
      FileNotFoundError: no file at `path`.
      SequenceStateError: not a safetensors file, one of another format, or a
        damaged one (metadata missing or unreadable, arrays that disagree
        with its dtypes).
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no sequence state file {path}")
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise SequenceStateError(f"{path}: not a sequence state file (not a safetensors file: {e})") from None
    if metadata.get("format") != FORMAT:
        raise SequenceStateError(f"{path}: not a sequence state file (format {metadata.get('format')!r}; expected "
                                 f"{FORMAT!r})")
    missing = [key for key in ("dtypes", "structure", "model") if key not in metadata]
    if missing:
        raise SequenceStateError(f"{path}: a damaged sequence state file (its metadata lacks {', '.join(missing)})")

    def damaged(e):
        return SequenceStateError(f"{path}: a damaged sequence state file ({type(e).__name__}: {e})")

    try:
        dtypes, model = json.loads(metadata["dtypes"]), json.loads(metadata["model"])
        raw = load_file(path)
    except (ValueError, SafetensorError) as e:  # the metadata's JSON, or the arrays
        raise damaged(e) from None
    if not isinstance(dtypes, dict) or set(raw) != set(dtypes):
        raise SequenceStateError(f"{path}: its arrays and its metadata's dtypes name different arrays")
    try:
        arrays = {name: raw[name].view(jnp.dtype(dtypes[name])) for name in dtypes}
    except (ValueError, TypeError) as e:  # a dtype name, or one whose size does not divide the bytes
        raise damaged(e) from None
    return SequenceState(arrays, metadata["structure"], model)
