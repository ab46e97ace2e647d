"""What the hybrid models share: the model-level decode cache and the functional entry points.

A model is a Flax NNX module with

- ``__call__(input_ids) -> logits``: full causal forward, no cache;
- ``prefill(input_ids, max_len, *, replay_buffer_len=None, max_window=1, ...) -> (logits, HybridCache)``;
- ``decode(tokens, cache, *, route="auto") -> (logits, HybridCache)``;
- ``verify(tokens [batch, W], cache) -> (logits [batch, W, vocab], HybridCache with the window pending)``
  and ``commit(cache, num_accepted)``: a speculative round (ARCHITECTURE.md, "Speculative decoding").

With ``return_hidden=True``, `prefill`, `decode` and `verify` also return the
hidden state after the final norm, the input of the LM head (and of a
multi-token prediction head, `models.mtp`): ``(logits, hidden, HybridCache)``.

`make_prefill` / `make_decode_step` / `make_verify_step` / `make_commit` wrap
these as pure functions of ``(params, ...)`` (via ``nnx.split`` / ``nnx.merge``)
compiled with ``jax.jit``, so that a generation loop can carry the cache
through ``jax.lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from replayssm_jax import ops
from replayssm_jax.compilation import jit
from replayssm_jax.layers.attention import Attention
from replayssm_jax.layers.cache import (
    KVCache,
    ReplayLayerState,
    SSMLayerState,
    check_num_accepted,
    commit_layer_state,
    pending_window,
)
from replayssm_jax.ops.validate import check_commit_path, check_tree, tree_parents

__all__ = ["HybridBlock", "HybridCache", "HybridCausalLM", "make_prefill", "make_decode_step", "make_verify_step",
           "make_commit", "commit_cache", "split_params"]


@struct.dataclass
class HybridCache:
    """Decode state of a whole hybrid model.

    Attributes:
      layers: one entry per layer: `SSMLayerState` or `ReplayLayerState` (Mamba-2 /
        GDN layers), `KVCache` (attention layers), None (MLP / MoE layers).
      position: i32[batch], tokens consumed so far (the position of the next token;
        a verified window moves it only at commit).
      max_window: static int, the longest verify window the cache has room for
        (its conv windows, KV caches and replay buffers; 1: plain decoding).
      tree: static, the parents (`DraftTree.parents`) of the draft tree whose
        window is pending (`verify(tree=...)`), which `commit` needs a path
        of; None: a chain's window, or none pending.
    """

    layers: tuple
    position: jax.Array
    max_window: int = struct.field(pytree_node=False, default=1)
    tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

    @property
    def uses_replay(self) -> bool:
        """True if the SSM layers hold ReplaySSM states."""
        return any(isinstance(s, ReplayLayerState) for s in self.layers)

    @property
    def window(self) -> int:
        """The pending verify window W (0: none; static)."""
        return max((pending_window(s) for s in self.layers), default=0)

    @property
    def bytes_per_sequence(self) -> int:
        """Device bytes of the cache per row: every array's bytes (SSM states or checkpoints with their
        scales, buffers, conv states, KV caches, positions) over the batch; from shapes and dtypes only."""
        total = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(self))
        return total // self.position.shape[0]


_STATE_TYPES = {"mamba": (SSMLayerState, ReplayLayerState), "gdn": (SSMLayerState, ReplayLayerState),
                "attention": (KVCache,), "mlp": (type(None),), "moe": (type(None),)}


def check_cache(cache: HybridCache, layer_types, shape: tuple[int, ...] | None = None, name: str = "tokens") -> None:
    """Raise unless `cache` is a HybridCache with one state of the right type
    per layer (TypeError, ValueError) and, if `shape` (that of the ids given
    with the cache, called `name`) is given, as many rows as its first axis
    (ValueError)."""
    if not isinstance(cache, HybridCache):
        raise TypeError(f"`cache` must be a HybridCache (from `prefill` or `decode`); got {type(cache).__name__}")
    if shape is not None and cache.position.shape != tuple(shape[:1]):
        raise ValueError(f"`{name}` must have {cache.position.shape[0]} rows, the cache's batch; got shape "
                         f"{tuple(shape)}")
    if len(cache.layers) != len(layer_types):
        raise ValueError(f"`cache` has {len(cache.layers)} layer states; the model has {len(layer_types)} layers")
    for i, (kind, state) in enumerate(zip(layer_types, cache.layers)):
        if not isinstance(state, _STATE_TYPES[kind]):
            want = " or ".join(t.__name__ for t in _STATE_TYPES[kind])
            raise ValueError(f"`cache.layers[{i}]` ({kind} layer) must be {want}; got {type(state).__name__}")


class HybridBlock(nnx.Module):
    """Base of the families' decoder blocks: `decode` and `verify` run the block's
    ``_with_state(h, state, mode, **ssm_options)`` (its mixer's ``decode`` or ``verify`` on the
    block's state, `mode` naming which; a block without a state passes None through)."""

    def decode(self, h: jax.Array, state, *, route: str = "auto", backend: str | None = None, slots=None):
        """One token. h: [batch, hidden] -> (h [batch, hidden], new state); `slots`: a state pool's rows
        (`HybridCausalLM.decode`)."""
        return self._with_state(h, state, "decode", route=route, backend=backend, slots=slots)

    def verify(self, h: jax.Array, state, *, backend: str | None = None, tree=None, slots=None):
        """W speculative positions (the nodes of a draft `tree` if given). h: [batch, W, hidden] -> (h
        [batch, W, hidden], state with the window pending; see the mixers' ``verify``); `slots`: a state
        pool's rows (`HybridCausalLM.verify`)."""
        return self._with_state(h, state, "verify", backend=backend, tree=tree, slots=slots)


class HybridCausalLM(nnx.Module):
    """The modes of a hybrid causal LM, over its blocks (each with ``__call__``,
    ``prefill(h, max_len)``, ``decode(h, state)`` and a ``mixer``).

    A subclass sets ``config`` (with ``vocab_size`` and ``layer_types``) and
    gives `_embed` (int ids -> hidden), `_blocks` (the blocks in order),
    `_final_norm` (the model's final norm) and `_lm_head` (normed hidden ->
    logits f32); `_logits` is the two in a row.
    """

    # Hooks each model defines (Nemotron-H, Qwen); the base has no default.

    def _embed(self, ids):
        """int ids [batch, T] -> hidden [batch, T, hidden]."""
        raise NotImplementedError(f"{type(self).__name__} must define _embed")

    @property
    def _blocks(self):
        """The decoder blocks, in order."""
        raise NotImplementedError(f"{type(self).__name__} must define _blocks")

    def _final_norm(self, h):
        """hidden [..., hidden] -> the final norm's output [..., hidden]."""
        raise NotImplementedError(f"{type(self).__name__} must define _final_norm")

    def _lm_head(self, h):
        """normed hidden [..., hidden] -> logits f32 [..., vocab_size] (the LM head, or the tied embedding)."""
        raise NotImplementedError(f"{type(self).__name__} must define _lm_head")

    def _logits(self, h):
        """hidden -> logits f32 (final norm and LM head)."""
        return self._lm_head(self._final_norm(h))

    def set_attention_decode_backend(self, backend: str | None) -> None:
        """Set every attention layer's `decode_backend`: the backend of a decode step's attention over the
        KV cache (`replayssm_jax.ops.attention_decode`), "xla" (the layers' default: XLA's products over
        all max_len positions), "pallas", "interpret" or None (by platform) for its kernel. The next
        `jit` of the model, `Generator` or `Engine` built from it, or `models.sharding.shard_model` of it
        takes the new one; those built before keep theirs (they split the model when built).

        Raises:
          TypeError, ValueError: not a backend name, or a kernel backend for a head_dim above the
            kernel's limit (`Attention.check_decode_backend`), before any layer changes.
        """
        layers = [module for _, module in nnx.iter_modules(self) if isinstance(module, Attention)]
        for layer in layers:
            layer.check_decode_backend(backend, "backend")
        for layer in layers:
            layer.decode_backend = backend

    def __call__(self, input_ids: jax.Array, *, backend: str | None = None) -> jax.Array:
        """Full causal forward, no cache.

        Args:
          input_ids: int[batch, T], batch >= 1, T >= 1, ids in [0, vocab_size).
          backend: SSM op backend (replayssm_jax.ops).

        Returns:
          logits f32[batch, T, vocab_size].

        Raises:
          TypeError: `input_ids` not integers.
          ValueError: `input_ids` not of shape [batch, seqlen], with an empty axis,
            or with an id outside the vocabulary (checked before any op runs).
        """
        h = self._embed(check_input_ids(input_ids, self.config.vocab_size))
        for block in self._blocks:
            h = block(h, backend=backend)
        return self._logits(h)

    def prefill(self, input_ids: jax.Array, max_len: int, *, replay_buffer_len: int | None = None,
                buffer_dtype=None, backend: str | None = None, last_logits_only: bool = False,
                max_window: int = 1, return_hidden: bool = False, checkpoint_dtype=None,
                checkpoint_rounding: str = "nearest", cache: HybridCache | None = None):
        """Prompt forward that builds the decode cache.

        Args:
          input_ids: int[batch, T], prompts without padding; batch >= 1, T >= 1.
          max_len: KV cache length (>= T + tokens to generate), static.
          replay_buffer_len: None: standard SSM states (`SSMLayerState`); an int L:
            ReplaySSM states (`ReplayLayerState`, checkpoint = the prefill's final
            SSM state, cursor 0, L buffer slots).
          buffer_dtype: the ReplaySSM records' dtype; None: each layer's narrowest exact one
            (`SSMMixer.exact_buffer_dtype`: Mamba-2's x and B in the activations' dtype, GDN's
            records in float32).
          backend: SSM op backend.
          last_logits_only: project only the last position (logits f32[batch,
            vocab_size]): generation needs no more, and the full logits of a
            large batch do not fit (256 x 512 x 131k f32 is 69 GB).
          max_window: the longest speculative window W that `verify` will get
            (static, >= 1; 1: plain decoding). The conv windows hold (width - 1)
            + W inputs, the KV caches max_len + W - 1 positions (a last window
            past max_len tokens), and W <= replay_buffer_len is required.
          return_hidden: also return the hidden state after the final norm at
            every position (static).
          checkpoint_dtype, checkpoint_rounding: the ReplaySSM checkpoints'
            dtype (None: the SSM state's; float32, bfloat16, int8 or
            float8_e4m3fn) and an 8-bit checkpoint's rounding ("nearest" or
            "stochastic"), as replayssm_jax.ops.*_replay_init.
          cache: None, or the cache of the prompts' earlier parts (a chunked
            prefill: from a `prefill` with replay_buffer_len None and
            max_window 1); the prompts continue after its positions (its KV
            caches keep their max_len; `max_len` is then not read).

        Returns:
          (logits f32[batch, T, vocab_size] (f32[batch, vocab_size] with
          last_logits_only), HybridCache with position = T (with `cache`: its
          position + T)); with return_hidden,
          (logits, hidden [batch, T, hidden_size] after the final norm (every
          position, also with last_logits_only), HybridCache).

        Raises:
          TypeError: `input_ids` not integers.
          ValueError: `input_ids` not of shape [batch, seqlen], with an empty axis
            or an id outside the vocabulary; max_len not an int >= T (without
            `cache`), an unknown backend, a
            replay_buffer_len that is not an int >= 1 or that the kernels of
            `backend` cannot take; max_window
            not an int >= 1, or above replay_buffer_len; a `cache` of another
            batch, with ReplaySSM states or a max_window other than 1.
          RuntimeError: backend "pallas" without a GPU.
        """
        ids = check_input_ids(input_ids, self.config.vocab_size)
        if cache is not None:
            check_cache(cache, self.config.layer_types, ids.shape, "input_ids")
            if cache.uses_replay or cache.max_window != 1:
                raise ValueError("`cache` (a chunked prefill's earlier parts) must hold standard SSM states and "
                                 f"max_window 1 (prefill with replay_buffer_len None); got uses_replay = "
                                 f"{cache.uses_replay}, max_window = {cache.max_window}")
        if cache is None and (isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer))
                              or max_len < ids.shape[1]):
            raise ValueError(f"`max_len` must be an int >= the prompt length T = {ids.shape[1]}; got {max_len!r}")
        if isinstance(max_window, bool) or not isinstance(max_window, (int, np.integer)) or max_window < 1:
            raise ValueError(f"`max_window` must be an int >= 1; got {max_window!r}")
        max_window = int(max_window)
        if replay_buffer_len is not None:
            if (isinstance(replay_buffer_len, bool) or not isinstance(replay_buffer_len, (int, np.integer))
                    or replay_buffer_len < 1):
                raise ValueError(f"`replay_buffer_len` must be None or an int >= 1; got {replay_buffer_len!r}")
            ops.check_buffer_len(replay_buffer_len, backend, "replay_buffer_len")
            if max_window > replay_buffer_len:
                raise ValueError(f"`max_window` must be <= replay_buffer_len = {replay_buffer_len} (a verify "
                                 f"window fits in the replay buffer); got {max_window}")
        h = self._embed(ids)
        states = []
        earlier = (None,) * len(self._blocks) if cache is None else cache.layers
        for block, prior in zip(self._blocks, earlier):
            h, state = block.prefill(h, max_len + max_window - 1, backend=backend,
                                     **({} if cache is None else {"state": prior}))
            states.append(prefill_layer_states(block.mixer, state, replay_buffer_len=replay_buffer_len,
                                               buffer_dtype=buffer_dtype, max_window=max_window,
                                               checkpoint_dtype=checkpoint_dtype, rounding=checkpoint_rounding))
        batch, seqlen = ids.shape
        position = jnp.full((batch,), seqlen, jnp.int32) if cache is None else cache.position + seqlen
        cache = HybridCache(layers=tuple(states), position=position, max_window=max_window)
        if return_hidden:
            hidden = self._final_norm(h)
            return self._lm_head(hidden[:, -1] if last_logits_only else hidden), hidden, cache
        logits = self._logits(h[:, -1]) if last_logits_only else self._logits(h)
        return logits, cache

    def decode(self, tokens: jax.Array, cache: HybridCache, *, route: str = "auto",
               backend: str | None = None, return_hidden: bool = False, slots=None):
        """One decode step for every sequence.

        Args:
          tokens: int[batch], the newest token of each sequence.
          cache: from `prefill` or a previous `decode`.
          route: the ReplaySSM step's route, "output", "state", "direct", "deferred" (replayssm_jax.ops) or
            "auto": resolved per layer by shape (replayssm_jax.ops.resolve_route: the direct
            route at latency-bound batches, else the deferred route from batch 64 with an f32 or
            bf16 checkpoint, else the output route; the reference takes "output");
            or "append" (the output route without the flush, replayssm_jax.ops.STEP_ROUTES; a row
            whose buffer is full cannot take it: ValueError on a concrete cursor, and under a trace
            NaN logits with that row's SSM states kept while its conv windows, attention caches and
            position move on, which leaves the row unusable).
          backend: SSM op backend.
          return_hidden: also return the hidden state after the final norm (static).
          slots: None, or int[batch]: `cache` is a state pool
            (:class:`replayssm_jax.pool.StatePool`: `capacity` rows) and
            token b continues the sequence in slot slots[b]; -1 is a
            padding row (its logits are unspecified; it reads and writes
            nothing), no slot twice. The SSM kernels index the pool by slot;
            conv windows and KV caches are indexed by XLA (the layers'
            ``decode`` docstrings give the cost).

        Returns:
          (logits f32[batch, vocab_size] for the next token, updated HybridCache);
          with return_hidden, (logits, hidden [batch, hidden_size] after the final
          norm, HybridCache).

        Raises:
          TypeError: `cache` not a HybridCache; `tokens` or `slots` not integers.
          ValueError: an unknown `route` (with standard states too); a cache
            whose layers do not match the model's, `tokens`
            not of shape [batch] with the cache's batch (batch >= 1; with
            slots, the slots' batch), an id outside the vocabulary, or a
            pending verify window; concrete `slots` out of [-1, capacity),
            with a slot twice, or not of the tokens' shape.
        """
        tokens = check_tokens(tokens, self.config.vocab_size)
        ops.check_route(route, ops.STEP_ROUTES)  # also where the cache holds standard states, which ignore it
        if slots is None:
            check_cache(cache, self.config.layer_types, tokens.shape)
        else:
            check_cache(cache, self.config.layer_types)
            slots = ops.validate.check_slots(slots, cache.position.shape[0], None)
            if slots.shape != tokens.shape:
                raise ValueError(f"`slots` must have the shape of `tokens`, [batch] = {tuple(tokens.shape)}; got "
                                 f"{tuple(slots.shape)}")
        _check_no_window(cache)
        h = self._embed(tokens)
        pool = {} if slots is None else {"slots": slots}
        states = []
        for block, state in zip(self._blocks, cache.layers):
            h, state = block.decode(h, state, route=route, backend=backend, **pool)
            states.append(state)
        position = cache.position + 1 if slots is None else ops.put_slots(
            cache.position, slots, ops.take_slots(cache.position, slots) + 1)
        cache = cache.replace(layers=tuple(states), position=position)
        if return_hidden:
            hidden = self._final_norm(h)
            return self._lm_head(hidden), hidden, cache
        return self._logits(h), cache

    def verify(self, tokens: jax.Array, cache: HybridCache, *, backend: str | None = None,
               return_hidden: bool = False, tree=None, slots=None):
        """Verify W speculative positions of every sequence in one call (ARCHITECTURE.md, "Speculative decoding").

        Args:
          tokens: int[batch, W], per row the last accepted token and W - 1 drafts
            (rows with fewer drafts pad with any id; its positions are rejected).
            1 <= W <= cache.max_window, W <= L of the replay layers.
          cache: from `prefill` (with max_window >= W), `decode` or `commit`; no
            window pending.
          backend: SSM op backend (the replay verify ops run on
            ``ops.backend_for``; the standard baseline runs the per-draft verify op, one launch per layer).
          return_hidden: also return the hidden states after the final norm
            at the W positions (static).
          tree: None (a chain), or a
            :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes
            (static): tokens[:, t] follows node parents[t], and every layer
            reads t's path root .. t only (tree speculation).
          slots: None, or int[batch]: `cache` is a state pool
            (:class:`replayssm_jax.pool.StatePool`, prefilled with max_window
            >= W) and row b verifies the sequence in slot slots[b]; -1 is a
            padding row (its logits are unspecified; it reads and writes
            nothing), no slot twice; a chain window only (tree None). The SSM
            kernels index the pool by slot (the replay verify's early flush
            and verify kernel, the per-draft verify); conv windows and KV
            caches are indexed by XLA (the layers' ``verify`` docstrings give
            the cost). Commit with ``commit(cache, num_accepted, slots=)``.

        Returns:
          (logits f32[batch, W, vocab_size]: position t gives the next token
          after tokens[:, :t + 1] (of a tree: after t's path); the HybridCache with the window pending:
          every layer holds the W positions, `commit` keeps the accepted ones.
          `position` is unchanged); with return_hidden, (logits, hidden
          [batch, W, hidden_size] after the final norm, HybridCache).

        Raises:
          TypeError: `cache` not a HybridCache; `tokens` not integers.
          ValueError: layers that do not match, `tokens` not [batch, W] with the
            cache's batch, an id outside the vocabulary, a pending window, W
            above max_window or a replay buffer length L, or (lengths concrete)
            a KV cache without room for W more positions; a `tree` that is
            not a DraftTree of W nodes; `slots` as in `decode`, or with a
            tree. All before any op runs.
        """
        tokens = check_input_ids(tokens, self.config.vocab_size, name="tokens")
        batch, window = tokens.shape
        slots = _check_pool_slots(cache, self.config.layer_types, slots, tokens.shape)
        _check_no_window(cache)
        _check_room(cache, window, slots)
        tree = check_tree(tree, window, "tokens.shape[1]")
        ops.validate.check_no_tree_with_slots(tree, slots)
        h = self._embed(tokens)
        states = []
        for block, state in zip(self._blocks, cache.layers):
            h, state = block.verify(h, state, backend=backend, tree=tree, slots=slots)
            states.append(state)
        cache = cache.replace(layers=tuple(states), tree=tree_parents(tree))
        if return_hidden:
            hidden = self._final_norm(h)
            return self._lm_head(hidden), hidden, cache
        return self._logits(h), cache

    def commit(self, cache: HybridCache, num_accepted: jax.Array, path=None, slots=None) -> HybridCache:
        """Keep the first `num_accepted` (i32[batch], 0..W) positions of the pending window (after a tree's
        verify: of `path`, i32[batch, P], the accepted nodes root first; over a state pool, of the rows
        `slots`, i32[batch]), after checking that `cache` matches the model's layers: `commit_cache` gives
        the arguments, the result and the errors (TypeError, ValueError, before anything changes)."""
        check_cache(cache, self.config.layer_types)
        return commit_cache(cache, num_accepted, path, slots=slots)


def attention_options(options: dict) -> dict:
    """Of a block's SSM options, those its attention layer's ``decode`` / ``verify`` takes: the draft
    `tree` of a verify and the `slots` of a decode over a state pool (the others, route and backend,
    are the SSM ops')."""
    return {name: options[name] for name in ("tree", "slots") if name in options}


def commit_cache(cache: HybridCache, num_accepted, path=None, *, slots=None) -> HybridCache:
    """Keep the first `num_accepted` of the W verified positions of every row, in every layer.

    Args:
      cache: from `HybridCausalLM.verify` (a pending window W).
      num_accepted: int[batch], per row in 0..W (a speculative round gives
        m in 1..W: `replayssm_jax.speculative.Accepted.num_accepted`).
        Checked where concrete; clipped to 0..W inside jit.
      path: None after a chain's verify (the first m positions); after a
        tree's (`cache.tree`), int[batch, P]: per row the accepted nodes,
        root first, each a child of the one before (checked where concrete;
        m <= P); every layer compacts their positions to contiguous ones
        (`replayssm_jax.layers.commit_layer_state`).
      slots: None, or int[batch]: `cache` is a state pool and row b's count
        is slot slots[b]'s (-1: a padding row, whose count is dropped); no
        path. The counts are scattered to one per slot (0 for the slots
        outside the batch, which then keep every value) and the pool
        committed as one cache: per-slot cursor, index, length, start and
        position moves, elementwise over the capacity. They must be the
        slots of the verify whose window this commits: the pool does not
        record which slots hold a pending window, so a commit over other
        slots moves their cursors and lengths over stale records.

    Returns:
      The HybridCache after those positions, no window pending: SSM layers
      (replay: ``cursor += m``; standard: the index moved to the slot of the state after m positions), conv
      windows (start moved by m), KV caches (``length += m``), ``position += m``.

    Raises:
      TypeError: `cache` not a HybridCache; non-integer counts or slots.
      ValueError: no pending window; counts not [batch] or outside 0..W; bad
        `slots` (`ops.validate.check_slots`) or a path with slots; a path
        after a chain's verify, none after a tree's, or (concrete) one off
        the tree (`ops.validate.check_commit_path`). All before anything changes.
    """
    if not isinstance(cache, HybridCache):
        raise TypeError(f"`cache` must be a HybridCache (from `verify`); got {type(cache).__name__}")
    if cache.window == 0:
        raise ValueError("`cache` has no pending verify window; call `verify` before `commit`")
    if slots is not None:
        slots = ops.validate.check_slots(slots, cache.position.shape[0], None)
        if path is not None:
            raise ValueError("`path` with `slots`: a commit over a state pool takes chain windows only (path None)")
        m = check_num_accepted(num_accepted, slots.shape[0], cache.window)
        target = jnp.where(slots < 0, cache.position.shape[0], slots)  # padding rows: out of range, dropped
        num_accepted = jnp.zeros_like(cache.position).at[target].set(m, mode="drop")
    m = check_num_accepted(num_accepted, cache.position.shape[0], cache.window)
    path = check_commit_path(path, m, cache.window, cache.tree)
    m = jnp.clip(m, 0, cache.window if path is None else path.shape[1])
    return cache.replace(layers=tuple(commit_layer_state(s, m, path) for s in cache.layers),
                         position=cache.position + m, tree=None)


def _check_no_window(cache: HybridCache) -> None:
    if cache.window:
        raise ValueError(f"`cache` has a pending verify window (W = {cache.window}); call `commit` first")


def _check_pool_slots(cache: HybridCache, layer_types, slots, shape: tuple[int, ...]):
    """`cache` checked against the model's layers (and, without slots, the batch of `tokens` of `shape`);
    `slots` as checked by `ops.validate.check_slots` (None stays None), of shape [batch] (ValueError
    otherwise)."""
    batch = shape[0]
    if slots is None:
        check_cache(cache, layer_types, shape)
        return None
    check_cache(cache, layer_types)
    slots = ops.validate.check_slots(slots, cache.position.shape[0], None)
    if slots.shape != (batch,):
        raise ValueError(f"`slots` must have shape [batch] = ({batch},) (the batch of `tokens`); got "
                         f"{tuple(slots.shape)}")
    return slots


def _check_room(cache: HybridCache, window: int, slots=None) -> None:
    """Raise ValueError unless every layer of `cache` has room for a verify window of `window` positions
    (over a state pool, in the rows of `slots`)."""
    if window > cache.max_window:
        raise ValueError(f"`tokens` has W = {window} positions; the cache holds verify windows of at most "
                         f"max_window = {cache.max_window} (prefill with a larger max_window)")
    for i, state in enumerate(cache.layers):
        if isinstance(state, ReplayLayerState) and window > state.replay.buffer_len:
            raise ValueError(f"`tokens` has W = {window} positions; layer {i}'s replay buffer has L = "
                             f"{state.replay.buffer_len} slots (W <= L)")
        if isinstance(state, KVCache) and not isinstance(state.length, jax.core.Tracer) and \
                not isinstance(slots, jax.core.Tracer):
            lengths = np.asarray(state.length)
            if slots is not None:
                lengths = lengths[np.asarray(slots)[np.asarray(slots) >= 0]]
            longest = int(np.max(lengths, initial=0))
            if longest + window > state.max_len:
                raise ValueError(f"`tokens` has W = {window} positions; layer {i}'s KV cache holds "
                                 f"{longest} of max_len = {state.max_len} positions in its longest row (the "
                                 f"prefill's max_len + max_window - 1; prefill with a larger max_len)")


def _check_ids(ids, vocab_size: int, name: str, axes: tuple[str, ...]) -> jax.Array:
    """`ids` as int32 with one axis per name in `axes`, none empty, values in [0, vocab_size).

    The values are checked where concrete (inside jit they are traced, and the
    embedding clips them).

    Raises:
      TypeError: a non-integer dtype.
      ValueError: not a rectangular array, the wrong rank, an empty axis, or an
        id outside the vocabulary; the message names `name`.
    """
    layout = f"[{', '.join(axes)}]"
    if not isinstance(ids, jax.core.Tracer):
        try:
            ids = np.asarray(ids)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`{name}` must be a rectangular integer array {layout}; got a "
                             f"{type(ids).__name__} numpy cannot read as one ({e})") from None
    if ids.ndim != len(axes):
        raise ValueError(f"`{name}` must have shape {layout}; got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"`{name}` must be an integer array; got dtype {ids.dtype}")
    if 0 in ids.shape:
        sizes = " and ".join(f"{axis} >= 1" for axis in axes)
        raise ValueError(f"`{name}` must not be empty: shape {layout} with {sizes}; got {ids.shape}")
    if not isinstance(ids, jax.core.Tracer):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"`{name}` has token id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
    return jnp.asarray(ids).astype(jnp.int32)


def check_input_ids(input_ids, vocab_size: int, name: str = "input_ids") -> jax.Array:
    """`input_ids` as int32[batch, seqlen], batch >= 1, seqlen >= 1, ids in [0, vocab_size).

    Raises TypeError on a non-integer dtype, ValueError on another rank, an
    empty axis, a ragged nested list, or an id outside the vocabulary (when the
    ids are concrete); the message names `name`.
    """
    return _check_ids(input_ids, vocab_size, name, ("batch", "seqlen"))


def check_tokens(tokens, vocab_size: int) -> jax.Array:
    """`tokens` as int32[batch], batch >= 1, ids in [0, vocab_size); raises as check_input_ids."""
    return _check_ids(tokens, vocab_size, "tokens", ("batch",))


def split_params(model: nnx.Module):
    """(graphdef, params) of `model` (`flax.nnx.split`): its static structure, which the `make_*`
    functions close over, and its parameters, an `nnx.State` pytree of the checkpoint's arrays (their
    dtypes as loaded), which the functions they return take as their first argument."""
    return nnx.split(model)


def merge_params(graphdef, params) -> nnx.Module:
    """The model of `graphdef` with `params` (`flax.nnx.merge`).

    Raises:
      ValueError: `params` of another structure than `graphdef`'s (e.g. another model's), naming `params`.
    """
    try:
        return nnx.merge(graphdef, params)
    except ValueError as e:
        raise ValueError(f"`params` do not match the model's graphdef: give the params that `split_params` returned "
                         f"with this graphdef ({e})") from None


def make_prefill(graphdef, *, max_len: int, replay_buffer_len: int | None = None, buffer_dtype=None,
                 last_logits_only: bool = False, backend: str | None = None, max_window: int = 1,
                 return_hidden: bool = False, checkpoint_dtype=None, checkpoint_rounding: str = "nearest"):
    """A jitted ``prefill(params, input_ids) -> (logits, HybridCache)`` (``(logits, hidden,
    HybridCache)`` with return_hidden, as `HybridCausalLM.prefill`). The ids are traced, so, as in
    `make_decode_step`, an id outside the vocabulary is clamped by the embedding, not refused.

    Args:
      graphdef: from `split_params`.
      max_len: KV cache length (prompt + generated tokens).
      replay_buffer_len: None for standard SSM states, else the ReplaySSM buffer length L.
      buffer_dtype: the ReplaySSM records' dtype (None: each layer's narrowest exact one).
      last_logits_only: return logits [batch, vocab] of the last prompt token only.
      backend: SSM op backend (replayssm_jax.ops).
      max_window: the longest speculative verify window (1: plain decoding).
      return_hidden: also return the hidden states after the final norm (static).
      checkpoint_dtype, checkpoint_rounding: the ReplaySSM checkpoints' dtype (None: the model's
        ssm_state_dtype; int8 or float8_e4m3fn: 8-bit) and an 8-bit checkpoint's rounding, as
        `HybridCausalLM.prefill` takes them.
    """

    @jit
    def prefill(params, input_ids):
        model = merge_params(graphdef, params)
        return model.prefill(input_ids, max_len, replay_buffer_len=replay_buffer_len, buffer_dtype=buffer_dtype,
                             backend=backend, last_logits_only=last_logits_only, max_window=max_window,
                             return_hidden=return_hidden, checkpoint_dtype=checkpoint_dtype,
                             checkpoint_rounding=checkpoint_rounding)

    return prefill


def make_decode_step(graphdef, *, route: str = "auto", backend: str | None = None, donate_cache: bool = False,
                     return_hidden: bool = False):
    """A jitted ``decode_step(params, cache, tokens, slots=None) -> (logits [batch, vocab], HybridCache)``
    (``(logits, hidden [batch, hidden], HybridCache)`` with return_hidden, as `HybridCausalLM.decode`;
    `slots`: the rows of a state pool).

    ``donate_cache=True`` donates the cache argument (in-place state updates on GPU). The values of
    `tokens` are traced, so an id outside the vocabulary is not refused here (`HybridCausalLM.decode`
    refuses it where the ids are concrete): the embedding lookup clamps it, and its logits are wrong.
    """

    def decode_step(params, cache, tokens, slots=None):
        model = merge_params(graphdef, params)
        return model.decode(tokens, cache, route=route, backend=backend, return_hidden=return_hidden,
                            **({} if slots is None else {"slots": slots}))

    return jit(decode_step, donate_argnums=(1,) if donate_cache else ())


def make_verify_step(graphdef, *, backend: str | None = None, donate_cache: bool = True,
                     return_hidden: bool = False, tree=None):
    """A jitted ``verify(params, cache, tokens) -> (logits f32[batch, W, vocab], HybridCache)``
    (``(logits, hidden [batch, W, hidden], HybridCache)`` with return_hidden; `HybridCausalLM.verify`,
    of the draft `tree` if given), the cache donated by default."""

    def verify(params, cache, tokens):
        model = merge_params(graphdef, params)
        return model.verify(tokens, cache, backend=backend, return_hidden=return_hidden, tree=tree)

    return jit(verify, donate_argnums=(1,) if donate_cache else ())


def make_commit(*, donate_cache: bool = True):
    """A jitted ``commit(cache, num_accepted i32[batch], path=None | i32[batch, P]) -> HybridCache``
    (`commit_cache`, which gives the arguments' meaning: it needs no parameters), the cache donated by
    default. Under jit the counts are clipped to 0..W and a path is not checked against the tree: check
    concrete values with `commit_cache` (or `HybridCausalLM.commit`) where they matter."""
    return jit(commit_cache, donate_argnums=(0,) if donate_cache else ())


def prefill_layer_states(mixer, state, *, replay_buffer_len, buffer_dtype, max_window: int = 1, checkpoint_dtype=None,
                         rounding: str = "nearest"):
    """An SSM layer's prefill state with a conv window for `max_window` positions, converted to
    ReplaySSM if asked, its checkpoint in `checkpoint_dtype` (KV caches and None pass through)."""
    if not isinstance(state, SSMLayerState):
        return state
    if replay_buffer_len is not None:  # first: the replay state is made from the plain state
        state = mixer.to_replay(state, replay_buffer_len, buffer_dtype, checkpoint_dtype, rounding)
    if max_window != 1:  # a standard state: the slotted layout of max_window + 1 states
        state = mixer.with_window(state, max_window)
    return state
