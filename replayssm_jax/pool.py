"""A state pool: the decode state of `capacity` sequences, allocated once, whose slots the decode
step indexes.

The pool is a `models.HybridCache` whose every array has `capacity` rows on axis 0, one per
slot: each layer's ReplaySSM checkpoint (with an 8-bit checkpoint's scales and write counts),
buffers and cursor (or standard SSM state), conv window, KV cache and length, and the
position. A sequence holds one slot from its prefill to its last token.
``model.decode(tokens, pool.cache, slots=slots)`` (`HybridCausalLM.decode`) steps the
sequences in `slots` (i32[batch]): the SSM kernels index the pool by slot and update the
slot's state in place (`replayssm_jax.kernels.launch.Pool`: no gather or scatter copy of the
states); slot -1 is a padding row, which reads and writes nothing, so a decode step of a fixed
batch size serves any number of running sequences up to it. A pool made with ``max_window =
W`` holds verify windows of up to W positions (conv windows, KV caches, replay buffers; the
standard state in the per-draft layout of W + 1 states per slot):
``model.verify(tokens [batch, W], pool.cache, slots=slots)`` and ``model.commit(cache,
num_accepted, slots=slots)`` run a speculative round over the slots in the same way; the
commit's `slots` must be the verify's (nothing records which slots hold a pending window: a
commit over other slots moves their cursors and lengths over stale records). A standard-state
pool with max_window > 1 steps by verify and commit only: its decode by slot is refused.

A prefilled sequence (a batch-1 cache of the pool's layout) enters a slot with `write` (one
compiled in-place row update); `export` / `restore` take a slot's whole state to the host and
back (:mod:`replayssm_jax.sequence_state`, the pending ReplaySSM records kept), for backup and
for prefix caching.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.sequence_state import SequenceState, export_sequence, import_sequence

__all__ = ["PoolError", "StatePool", "is_abstract"]


def is_abstract(params) -> bool:
    """Whether a model (or its parameters, or any pytree) holds shapes only: an abstract model from
    `nnx.eval_shape`, which can be measured (`Generator.memory_estimate`) but not run."""
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))


class PoolError(ValueError):
    """A full pool, a slot that is not in use or not free, or a sequence of another layout."""


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_row(pool, row, slot):
    """`pool` with slot `slot` (i32 scalar) of every array set to row 0 of `row` (donated: in place)."""
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r[0].astype(a.dtype), slot, 0), pool, row)


class StatePool:
    """The decode state of `capacity` sequences of one model, allocated once.

    Args:
      model: a models.* causal LM (`prefill`, `decode`).
      capacity: slots (sequences held at once), >= 1.
      max_len: positions of every slot's KV caches (prompt + generated tokens).
      buffer_len: ReplaySSM buffer length L (ReplaySSM states), or None
        (standard SSM states).
      buffer_dtype: ReplaySSM record dtype; None (default): each layer's narrowest exact
        one (`SSMMixer.exact_buffer_dtype`: Mamba-2's x and B in the activations' dtype,
        GDN's records in float32).
      backend: SSM op backend of the prefill that fixes the layout (replayssm_jax.ops).
      max_window: the longest verify window W the slots hold (>= 1; 1: plain
        decoding), as `model.prefill(max_window=)`.
      state_dtype, state_rounding: the ReplaySSM checkpoints' dtype (None: the
        model's ssm_state_dtype; float32, bfloat16, int8 or float8_e4m3fn) and an
        8-bit checkpoint's rounding ("nearest" or "stochastic"), as
        `model.prefill(checkpoint_dtype=, checkpoint_rounding=)`: an 8-bit
        checkpoint's scales f32[capacity, heads, V] and write counts
        i32[capacity] are pool arrays, indexed by slot as the rest.

    Attributes:
      cache: the HybridCache of `capacity` rows (all zeros at first: cursors,
        lengths and positions 0).
      capacity, max_len, buffer_len.

    Raises:
      PoolError: a `model` without `prefill`, `decode` and `config`, sharded over
        a mesh (models.sharding.ShardedLM: its entry points take no slots), or abstract;
        capacity, max_len or max_window not an int >= 1; a state_dtype with
        standard states (buffer_len None).
      ValueError: a buffer_len the backend's kernels cannot take, a max_window
        above it, an unknown state_dtype or rounding (`model.prefill`).
      TypeError: a buffer_dtype that is not a floating dtype (`model.prefill`).
    """

    def __init__(self, model, capacity: int, *, max_len: int, buffer_len: int | None = None,
                 buffer_dtype=None, backend: str | None = None, max_window: int = 1, state_dtype=None,
                 state_rounding: str = "nearest"):
        if not all(hasattr(model, attr) for attr in ("prefill", "decode", "config")):
            raise PoolError(f"`model` must be a model of this package (with `prefill`, `decode` and `config`, e.g. "
                            f"from models.load_model); got {type(model).__name__} {model!r:.80}")
        if getattr(model, "mesh", None) is not None:
            raise PoolError(f"`model` is sharded over a mesh ({type(model).__name__}, mesh {dict(model.mesh.shape)}): "
                            "a state pool decodes by slots, which the sharded entry points do not take; serve a "
                            "model on one device (models.load_model without mesh)")
        if is_abstract(nnx.state(model)):
            raise PoolError("`model` is abstract (its parameters are shapes only, as nnx.eval_shape gives them); "
                            "load its weights to allocate a pool")
        for name, value in (("capacity", capacity), ("max_len", max_len), ("max_window", max_window)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise PoolError(f"`{name}` must be an int >= 1; got {value!r}")
        if buffer_len is None and state_dtype is not None:
            raise PoolError(f"`state_dtype` applies to ReplaySSM states (a buffer_len) only; got {state_dtype!r} "
                            "with standard states (buffer_len None)")
        self.capacity, self.max_len, self.buffer_len = int(capacity), int(max_len), buffer_len
        self.max_window = int(max_window)
        self.prefill_options = dict(replay_buffer_len=buffer_len, buffer_dtype=buffer_dtype, backend=backend,
                                    max_window=self.max_window, checkpoint_dtype=state_dtype,
                                    checkpoint_rounding=state_rounding)
        shapes = jax.eval_shape(lambda: model.prefill(jnp.zeros((self.capacity, 1), jnp.int32), self.max_len,
                                                      last_logits_only=True, **self.prefill_options)[1])
        self.cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        self._free = list(range(self.capacity))
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        """Slots not in use."""
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, now in use (the lowest free one). Raises PoolError when the pool is full."""
        if not self._free:
            raise PoolError(f"the state pool is full: all {self.capacity} slots hold a sequence")
        slot = self._free.pop(0)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Return `slot` to the free slots (its arrays are left as they are; a later `write` replaces
        them). Raises PoolError for a slot that is not in use."""
        self._check_used(slot, "release")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort()

    def _check_used(self, slot, what: str) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or slot not in self._used:
            raise PoolError(f"StatePool.{what}: `slot` must be a slot in use (one of {sorted(self._used)}); "
                            f"got {slot!r}")
        return int(slot)

    def write(self, slot: int, row) -> None:
        """Set slot `slot` (in use) to `row`, the batch-1 HybridCache of one prefilled sequence of the
        pool's layout (from `model.prefill(ids [1, T], pool.max_len, **pool.prefill_options)`), in
        place (the pool's arrays donated). The other slots are not touched.

        Raises:
          PoolError: a slot not in use, a `row` of another structure, or an array of `row` of
            another shape or dtype than the pool's (named by its path; before any write).
        """
        slot = self._check_used(slot, "write")
        if jax.tree.structure(row) != jax.tree.structure(self.cache):
            raise PoolError("StatePool.write: `row` has another cache structure than the pool (another model, "
                            "state mode or verify window room)")
        for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(self.cache), jax.tree.leaves(row)):
            name = f"`row{jax.tree_util.keystr(path)}`"
            if tuple(r.shape) != (1, *a.shape[1:]):
                raise PoolError(f"StatePool.write: `row` must be a batch-1 cache of the pool's shapes: {name} has "
                                f"shape {tuple(r.shape)} where the pool's rows are {tuple(a.shape[1:])}")
            if r.dtype != a.dtype:
                raise PoolError(f"StatePool.write: {name} has dtype {r.dtype} where the pool's is {a.dtype} (a "
                                f"prefill with `pool.prefill_options` gives the pool's dtypes)")
        self.cache = _write_row(self.cache, row, jnp.int32(slot))

    def export(self, slot: int, *, model: str | None = None) -> SequenceState:
        """Slot `slot`'s whole decode state on the host (`sequence_state.export_sequence`: a ReplaySSM
        layer's pending records kept). Raises PoolError for a slot not in use."""
        return export_sequence(self.cache, self._check_used(slot, "export"), model=model)

    def restore(self, slot: int, state: SequenceState, *, model: str | None = None) -> None:
        """Set slot `slot` (in use) to an exported sequence state (`sequence_state.import_sequence`);
        a state of another model or layout raises SequenceStateError and leaves the pool as it was."""
        self.cache = import_sequence(self.cache, self._check_used(slot, "restore"), state, model=model)

