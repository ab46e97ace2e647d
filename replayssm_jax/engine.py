"""Continuous batching over a state pool: requests enter and leave a running batch.

:class:`Engine` holds a :class:`~replayssm_jax.pool.StatePool` of `capacity` slots and a queue
of requests. Each :meth:`Engine.step`

1. admits waiting requests into free slots (first come, first served);
2. dispatches one chunk of at most `prefill_chunk` prompt tokens of the oldest admitted request
   (a chunked prefill, `HybridCausalLM.prefill(..., cache=)`: a long prompt takes several steps
   and does not stall the decoding rows), in one call with the chunks of up to `prefill_batch`
   - 1 more admitted requests whose chunks have its length and kind (all first chunks, or all
   continuing a cache; all last chunks or none). With `prefill_batch` > 1 the requests admitted
   together look the prefix cache up together, before any of them keeps a block;
3. dispatches one compiled decode step of `batch_size` rows over the running requests that may
   take another token (``model.decode(tokens, pool, slots=)``; the rows past them are padding
   rows, slot -1), without waiting for it. Each row's next token is chosen inside the step:
   the argmax, or a draw with the request's sampling, whose parameters are per-row arrays
   (`sampling.BatchSampling`), so one compiled step serves every mix of greedy and sampled
   requests. A row that the previous step served consumes that step's token on the device;
4. after the prompt's last chunk, writes the request's state (converted to ReplaySSM where the
   engine runs it) into its slot (`StatePool.write`) and emits its first token, chosen inside
   the compiled prefill (the host waits for the prefill here, while the decode step runs); the
   request decodes from the next step on;
5. reads the previous step's tokens to the host (the step just dispatched runs meanwhile) and
   emits them, finishing the requests that emitted a stop token or reached `max_new_tokens`
   and freeing their slots.

So the host's bookkeeping overlaps the device's decode step. A request is never dispatched past
its max_new_tokens (the host counts its tokens in flight), but one whose stop token the host
reads after the next step was dispatched is computed once more: that token is dropped, and its
slot is freed. The device runs the pool's work in dispatch order (each step or write takes the
pool arrays that the one before returned, donated), so a request admitted into a freed slot is
written after every step that used the slot for its previous request, and the released request
is in no later step. A sampled request's draws are keyed by fold_in(fold_in(key, request id),
token index): its tokens are the same in any batch (of one engine mode: a speculative engine
draws by the acceptance rule, so its sampled tokens differ from a plain engine's). After `run_until_done` a decode step whose
rows all finished may still be in flight; the next step reads it (and drops its tokens).

Prefix caching (``prefix_caching=True``): the chunks of every prompt end at multiples of
`prefill_chunk` tokens (the block), and the state after each whole block of a prompt that
ends before the prompt's end is kept (the last chunk's state enters the pool's layout),
keyed by a hash of the prompt's ids up to there: the chunked prefill's batch-1 cache (standard
SSM states, nothing pending), on the device as it is (`prefix_store="device"`, the default: no
copy, since the prefill does not donate its cache; a later chunk reads the kept arrays) or on
the host (`prefix_store="host"`: `sequence_state.export_sequence`, a device-to-host copy per
kept block and a copy back per restore, for prefixes that do not fit the device). A later
request whose prompt starts with a kept prefix restores the longest one and prefills only the
rest; the chunks after the restored prefix are those of a prefill without the cache, so the
outputs are the same bit for bit.

Speculative decoding (``speculative=SpeculativeConfig(method, K)``, methods "ngram" and
"oracle"): step 3 is one compiled speculative round over the running requests instead of a
decode step: the drafter proposes K tokens per row from the request's own token history (a
per-slot array of max_len ids on the engine; "oracle": from the reference given to
`add_request`), the target verifies W = K + 1 positions over the pool by slot
(``model.verify(tokens, pool, slots=)``), each row accepts greedily or with the distribution-
preserving rejection rule of its request's sampling (`speculative.acceptance.accept_drafts_batch`,
per-row parameters as arrays: one compiled round for every mix of requests), and the pool
commits the accepted count by slot (``model.commit(cache, m, slots=)``). A request gets 1..W
tokens per step; a stop token or max_new_tokens among them ends it (the tokens after it are
dropped). The round is synchronous: the next round's drafter reads the token history that the
host keeps, so each step reads its round's tokens (after the prefill's, step 4).

Greedy decoding gives each request the tokens it gets alone (`Generator`, batch 1), whatever
the other requests and their arrival times, with or without speculation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.compilation import jit
from replayssm_jax.generation import GenerationError, SpeculativeConfig, _check_state_dtype
from replayssm_jax.ops.dispatch import ROUTES
from replayssm_jax.pool import PoolError, StatePool
from replayssm_jax.sampling import BatchSampling, SamplingParams, sample_tokens_batch
from replayssm_jax.sequence_state import export_sequence, import_sequence
from replayssm_jax.speculative.acceptance import accept_drafts_batch
from replayssm_jax.speculative.drafters import Drafts, NgramDrafter, OracleDrafter

__all__ = ["Engine", "EngineError", "RequestOutput", "ENGINE_SPECULATIVE_METHODS"]

# The speculative methods the engine runs: drafters that read the token history only (a drafter with a
# state of its own, "mtp" or "draft", would need its state in the pool).
ENGINE_SPECULATIVE_METHODS = ("ngram", "oracle")


class EngineError(ValueError):
    """A bad engine option or request (named, with the expected and the given value)."""


@dataclasses.dataclass
class RequestOutput:
    """A finished request.

    Attributes:
      request_id: the id `Engine.add_request` returned.
      sequence: the prompt followed by the generated ids (a stop token included).
      num_generated: generated tokens in `sequence`.
      finish_reason: "stop" (a stop token), "length" (max_new_tokens) or
        "abort" (`Engine.abort`).
      arrival_s, token_s: `time.perf_counter()` seconds at `add_request` and
        when the host read each generated token (token_s[0]: the first token,
        after the prefill).
      cached_tokens: prompt tokens restored from the prefix cache (not prefilled).
    """

    request_id: int
    sequence: list[int]
    num_generated: int
    finish_reason: str
    arrival_s: float
    token_s: list[float]
    cached_tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams | None
    stop_ids: frozenset
    arrival_s: float
    reference: list | None = None  # the oracle drafter's reference (prompt included)
    slot: int = -1
    prefilled: int = 0  # prompt tokens whose state the request holds
    cached_tokens: int = 0
    cache: object = None  # the chunked prefill's cache between chunks (batch 1, standard states)
    generated: list = dataclasses.field(default_factory=list)
    token_s: list = dataclasses.field(default_factory=list)
    pending: int = 0  # tokens of dispatched steps that the host has not read
    done: bool = False


@dataclasses.dataclass
class _Chunk:
    """A dispatched prefill of one chunk of each of its requests: their tokens i32[n] (on the device; after
    the prompts' last chunk their first tokens; n >= the requests: padding rows repeat the first), the
    batch-1 cache of each after it, and whether the chunks are the prompts' last."""

    requests: list
    tokens: jax.Array
    caches: tuple
    final: bool


@dataclasses.dataclass
class _Dispatched:
    """A dispatched decode step or speculative round: the requests of its first rows, its tokens on the
    device (i32[batch_size], or a round's i32[batch_size, W]) and a round's accepted counts i32[batch_size]."""

    rows: list
    tokens: jax.Array
    accepted: jax.Array | None = None


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """`ids` (a 1-D sequence of integer token ids, each in [0, vocab_size)) as a list of ints."""
    if isinstance(ids, (str, bytes)):
        raise EngineError(f"`{name}` must be a sequence of integer token ids; got a {type(ids).__name__}")
    try:
        array = np.asarray(ids)
    except ValueError as e:  # ragged nesting
        raise EngineError(f"`{name}` must be a 1-D sequence of integer token ids; got {ids!r:.80}") from e
    if array.ndim == 0:
        raise EngineError(f"`{name}` must be a 1-D sequence of integer token ids; got the scalar {ids!r:.80}")
    if array.ndim != 1:
        raise EngineError(f"`{name}` must be a 1-D sequence of integer token ids; got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise EngineError(f"`{name}` must hold integer token ids; got dtype {array.dtype}")
    bad = array[(array < 0) | (array >= vocab_size)]
    if bad.size:
        raise EngineError(f"`{name}` has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in array]


def _is_int(value) -> bool:
    """Whether `value` is an int (NumPy integers accepted, bools not)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if not _is_int(value) or value < minimum:
        raise EngineError(f"`{name}` must be an int >= {minimum}; got {value!r}")
    return int(value)


def _choose(logits, key, request_ids, counts, sampling: BatchSampling):
    """i32[batch]: each row's next token from logits f32[batch, vocab]: the argmax for a greedy row, else a
    draw with the row's sampling and the key fold_in(fold_in(key, request_ids[b]), counts[b]) (i32[batch]: the
    request's id and the token's index), so a request's draws depend only on it and the engine's key."""
    keys = jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(key, r), n))(request_ids, counts)
    return sample_tokens_batch(logits, keys, sampling)


@functools.lru_cache(maxsize=32)
def _compiled_prefill(graphdef, max_len: int, options: tuple):
    """The jitted chunk prefill of n requests at once, for a model structure and pool layout (shared by the
    engines of one model):

    prefill(params, ids i32[n, T], caches (n batch-1 caches) | None, key, request_ids i32[n], sampling:
    BatchSampling of n rows, final) -> (tokens i32[n], n batch-1 caches); after the prompts' last chunk
    (`final`) each request's first token (`_choose`, token index 0), before it 0. The n caches are stacked
    into one batch for the model's prefill and split again inside the program.
    """

    def prefill(params, ids, caches, key, request_ids, sampling, final):
        model = nnx.merge(graphdef, params)
        chunk_options = dict(options)
        length = max_len
        if not final:  # the earlier chunks keep standard states (continued by the next chunk), no window
            window = chunk_options["max_window"]
            chunk_options.update(replay_buffer_len=None, max_window=1, checkpoint_dtype=None)
            length = max_len + window - 1  # the KV caches' length of the pool's layout (the last chunk keeps it)
        cache = None if caches is None else jax.tree.map(lambda *rows: jnp.concatenate(rows), *caches)
        logits, cache = model.prefill(ids, length, last_logits_only=True, cache=cache, **chunk_options)
        n = ids.shape[0]
        rows = tuple(jax.tree.map(lambda a, i=i: a[i:i + 1], cache) for i in range(n))
        if not final:
            return jnp.zeros((n,), jnp.int32), rows
        return _choose(logits, key, request_ids, jnp.zeros((n,), jnp.int32), sampling), rows

    return jit(prefill, static_argnames=("final",))


@functools.lru_cache(maxsize=32)
def _compiled_decode(graphdef, route: str, backend: str | None):
    """The jitted decode step over a pool, the pool donated:

    decode(params, cache, previous i32[batch], source i32[batch], host_tokens i32[batch], slots i32[batch], key,
    request_ids i32[batch], counts i32[batch], sampling: BatchSampling) -> (tokens i32[batch], cache).

    Row b consumes previous[source[b]] (the token an earlier step chose on the device, not yet read by the
    host) where source[b] >= 0, else host_tokens[b]; its next token is chosen on the device (`_choose`, with
    counts[b] the token's index), so one program serves every mix of greedy and sampled rows.
    """

    def decode(params, cache, previous, source, host_tokens, slots, key, request_ids, counts, sampling):
        model = nnx.merge(graphdef, params)
        tokens = jnp.where(source >= 0, previous[jnp.maximum(source, 0)], host_tokens)
        logits, cache = model.decode(tokens, cache, route=route, backend=backend, slots=slots)
        return _choose(logits, key, request_ids, counts, sampling), cache

    return jit(decode, donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def _compiled_round(graphdef, backend: str | None):
    """The jitted speculative round over a pool, the pool donated:

    round(params, cache, drafter, history i32[batch, max_len], lengths i32[batch], limit i32[batch], slots
    i32[batch], request_ids i32[batch], generated i32[batch], sampling: BatchSampling, key, draft_key) ->
    (tokens i32[batch, W], num_accepted i32[batch] in 1..W, cache).

    Row b's known tokens are history[b, :lengths[b]] (the last one not yet consumed by its slot); the
    drafter proposes at most limit[b] tokens; the row accepts greedily or with the rejection rule of its
    sampling (`accept_drafts_batch`, traced: one program for every mix of rows), drawing with the key
    fold_in(fold_in(key, request_ids[b]), generated[b]) (so a request's draws depend only on it and the
    engine's key); the drafter draws with draft_key.
    """

    def round_(params, cache, drafter, history, lengths, limit, slots, request_ids, generated, sampling, key,
               draft_key):
        model = nnx.merge(graphdef, params)
        proposed, _ = drafter.draft(model, None, history, lengths, draft_key)
        K = drafter.num_speculative_tokens
        num_drafts = jnp.minimum(proposed.num_drafts, limit)
        drafts = jnp.where(jnp.arange(K)[None, :] < num_drafts[:, None], proposed.tokens, 0)
        last = jnp.take_along_axis(history, (lengths - 1)[:, None], axis=1)
        logits, cache = model.verify(jnp.concatenate([last, drafts], axis=1), cache, backend=backend, slots=slots)
        keys = jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(key, r), n))(request_ids, generated)
        accepted = accept_drafts_batch(logits, Drafts(drafts, num_drafts), keys, sampling)
        return accepted.tokens, accepted.num_accepted, model.commit(cache, accepted.num_accepted, slots=slots)

    return jit(round_, donate_argnums=(1,))


def _prefill_rows(requests: int, prefill_batch: int) -> int:
    """The rows of a prefill call of `requests` requests: the next power of two, at most prefill_batch (a
    handful of compiled shapes per chunk length)."""
    return min(1 << (requests - 1).bit_length(), prefill_batch)


def _prefix_key(ids: Sequence[int]) -> str:
    """The prefix cache's key of a prompt prefix: a hash of its ids (and so of its length)."""
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()


class Engine:
    """Continuous batching of generation requests over a state pool (module docstring).

    Args:
      model: a models.* causal LM (Flax NNX module with `prefill` and `decode`).
      capacity: pool slots, the most requests held at once (prefilling or decoding), >= 1.
      state: "replay" (ReplaySSM, buffer of `buffer_len` records) or "standard".
      buffer_len: L for state "replay" (default 16); must be None for "standard".
      buffer_dtype: ReplaySSM record dtype; None (default): each layer's narrowest exact
        one (`SSMMixer.exact_buffer_dtype`: Mamba-2's x and B in the activations' dtype,
        GDN's records in float32).
      batch_size: rows of the compiled decode step (>= 1; default: capacity); at most
        that many running requests decode per step (in arrival order, round robin
        when more are running).
      prefill_chunk: prompt tokens prefilled per request and step (>= 1); with prefix
        caching also the block whose boundaries the cache keeps. Each distinct chunk
        length compiles a prefill (whole chunks and the rest; first chunks, later ones
        and restored prefixes apart; each row count of prefill_batch apart).
      prefill_batch: requests whose next chunks one step prefills together (>= 1; the
        chunks of one length, in one call of 1, 2, 4, ... rows up to prefill_batch,
        padded by repeating a row). 1: one request per step.
      max_len: positions per slot (prompt + max_new_tokens of any request).
      prefix_caching: keep and reuse prompt prefixes' states (module docstring).
      prefix_cache_size: prefixes kept (least recently used dropped first), >= 1.
      prefix_store: where kept prefixes live, "device" (the default; each holds a batch-1
        cache of max_len positions in device memory) or "host" (module docstring).
      backend: SSM op backend (replayssm_jax.ops); route: the ReplaySSM step's route.
      seed: int in [0, 2**32 - 1], the PRNG seed of the sampled requests (a request's draws depend only on it,
        its id and the token's index) and of the oracle drafter.
      speculative: None, or a `replayssm_jax.generation.SpeculativeConfig` of
        method "ngram" (max_ngram, min_ngram as given) or "oracle" (alpha as
        given; each request's reference passed to `add_request` as
        `draft_reference`, so the config's `reference` must be empty, e.g.
        ``()``), without a tree: each step runs one speculative round of
        W = num_draft + 1 verified positions (module docstring).
      state_dtype, state_rounding: the ReplaySSM checkpoints' dtype (None: the
        model's ssm_state_dtype; float32, bfloat16, int8 or float8_e4m3fn) and an
        8-bit checkpoint's rounding ("nearest" or "stochastic"), as `Generator`
        takes them. Stochastic rounding keys its noise by pool slot, so a
        request's tokens depend on its slot there (not with "nearest").

    Attributes:
      pool: the StatePool; window: W, the verify window (1 without speculation).
      stats: a Counter of prefill_tokens, prefix_hits, cached_tokens,
        decode_steps (decode steps dispatched, or speculative rounds), and with
        speculation round_rows (requests stepped, summed over the rounds) and
        accepted_tokens (the tokens the rounds committed, before any cut at a
        stop token or max_new_tokens).

    Raises:
      EngineError: a `model` that is not a model of this package, or an abstract
        one (`StatePool`'s checks), an unknown state, route or prefix_store, prefix_store "host" without
        prefix_caching, a buffer_len with "standard", a
        non-positive int option, batch_size above capacity; a `speculative` that
        is not a SpeculativeConfig, of a method other than "ngram" and "oracle"
        (the drafters with a state of their own, "mtp" and "draft", are not run
        over a pool), with a tree or an oracle reference, or whose window
        num_draft + 1 exceeds buffer_len with the replay state; a state_dtype
        or rounding that `Generator` refuses (a state_dtype with "standard").
      ValueError: a buffer_len the backend's kernels cannot take.
      TypeError: a buffer_dtype that is not a floating dtype.
    """

    def __init__(self, model, capacity: int, *, state: str = "replay", buffer_len: int | None = None,
                 buffer_dtype=None, batch_size: int | None = None, prefill_chunk: int = 256,
                 max_len: int = 1024, prefix_caching: bool = False, prefix_cache_size: int = 64,
                 prefix_store: str = "device", prefill_batch: int = 1,
                 backend: str | None = None, route: str = "auto", seed: int = 0,
                 speculative: SpeculativeConfig | None = None, state_dtype=None, state_rounding: str = "nearest"):
        if state not in ("replay", "standard"):
            raise EngineError(f"`state` must be 'replay' or 'standard'; got {state!r}")
        if route not in ROUTES:
            raise EngineError(f"`route` must be one of {', '.join(map(repr, ROUTES))}; got {route!r}")
        if state == "standard" and buffer_len is not None:
            raise EngineError(f"`buffer_len` is for state 'replay'; got {buffer_len!r} with state 'standard'")
        capacity = _positive_int("capacity", capacity)
        self.batch_size = _positive_int("batch_size", capacity if batch_size is None else batch_size)
        if self.batch_size > capacity:
            raise EngineError(f"`batch_size` must be <= capacity = {capacity}; got {self.batch_size}")
        self.prefill_chunk = _positive_int("prefill_chunk", prefill_chunk)
        self.prefill_batch = _positive_int("prefill_batch", prefill_batch)
        self.prefix_cache_size = _positive_int("prefix_cache_size", prefix_cache_size)
        if prefix_store not in ("device", "host"):
            raise EngineError(f"`prefix_store` must be 'device' or 'host'; got {prefix_store!r}")
        self.prefix_store = prefix_store
        if not isinstance(prefix_caching, bool):
            raise EngineError(f"`prefix_caching` must be a bool; got {prefix_caching!r}")
        if prefix_store != "device" and not prefix_caching:
            raise EngineError(f"`prefix_store` says where kept prefixes live, which needs prefix_caching=True; got "
                              f"prefix_store={prefix_store!r} with prefix_caching=False")
        self.prefix_caching = prefix_caching
        self.state = state
        buffer_len = (16 if buffer_len is None else _positive_int("buffer_len", buffer_len)) \
            if state == "replay" else None
        self.speculative = _check_speculative(speculative, buffer_len)
        self.window = 1 if speculative is None else speculative.num_draft + 1
        try:
            state_dtype, state_rounding = _check_state_dtype(state, state_dtype, state_rounding)
        except GenerationError as e:
            raise EngineError(str(e)) from None
        try:
            self.pool = StatePool(model, capacity, max_len=_positive_int("max_len", max_len), buffer_len=buffer_len,
                                  buffer_dtype=buffer_dtype, backend=backend, max_window=self.window,
                                  state_dtype=state_dtype, state_rounding=state_rounding)
        except PoolError as e:
            raise EngineError(str(e)) from None
        # Each slot's token history (prompt, then generated ids), read by the drafter; the oracle's references.
        self._history = np.zeros((capacity, self.pool.max_len), np.int32)
        self._reference = np.zeros((capacity, self.pool.max_len), np.int32)
        self._reference_len = np.zeros((capacity,), np.int32)
        self.vocab_size = model.config.vocab_size
        self._graphdef, self._params = nnx.split(model)
        if not _is_int(seed) or not 0 <= seed < 2**32:
            raise EngineError(f"`seed` must be an int in [0, 2**32 - 1]; got {seed!r}")
        self._backend, self._route, self._key = backend, route, jax.random.key(int(seed))
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prefilling: list[_Request] = []
        self._running: list[_Request] = []
        self._decoding: _Dispatched | None = None  # the last decode step, its tokens not yet read
        self._no_tokens = jnp.zeros((self.batch_size,), jnp.int32)
        self._prefixes: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._template = None  # a zero batch-1 standard cache: the prefix cache's restore target
        self._next_id = 0
        self.stats = collections.Counter()
        # The compiled programs, looked up once (shared by the engines of one model): the lookup hashes the
        # model's graphdef, which takes milliseconds (a step that looked them up each time spent 6 ms per
        # call in it on the qwen3_5_tiny fixture, CPU, 2026-12-02).
        self._prefill = _compiled_prefill(self._graphdef, self.pool.max_len,
                                          tuple(sorted(self.pool.prefill_options.items())))  # `_compiled_prefill`
        self._decode = _compiled_decode(self._graphdef, self._route, self._backend)  # the pool donated
        self._round = None if speculative is None else _compiled_round(self._graphdef, self._backend)

    def _drafter(self, references):
        """The speculative round's drafter; "oracle": of the batch's references i32[batch, max_len]."""
        spec = self.speculative
        if spec.method == "ngram":
            return NgramDrafter(spec.num_draft, max_ngram=spec.max_ngram, min_ngram=spec.min_ngram)
        return OracleDrafter(jnp.asarray(references), spec.alpha, spec.num_draft, int(self.vocab_size))

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    stop_ids: Sequence[int] | int | None = (), draft_reference: Sequence[int] | None = None) -> int:
        """Queue a request; returns its id (0, 1, ... in order).

        Args:
          prompt_ids: the prompt's token ids (non-empty, each in [0, vocab_size)).
          max_new_tokens: tokens to generate at most, >= 1; prompt + max_new_tokens <= max_len.
          sampling: a SamplingParams, or None (greedy).
          stop_ids: ids that end the request (kept in its sequence), or one id; None or ()
            for none.
          draft_reference: with speculative method "oracle" (required there, refused
            otherwise): the request's full token sequence that the oracle drafts
            from, prompt included (`OracleDrafter.reference`; its first max_len ids
            are kept; no drafts past its end).

        Raises:
          EngineError: an empty prompt, a prompt or stop ids that are not a 1-D
            sequence of integers (stop_ids: or one integer), an id outside the
            vocabulary, max_new_tokens < 1,
            a request longer than max_len, a `sampling` that is not a SamplingParams;
            a draft_reference without the "oracle" method, or missing with it, or
            not a 1-D sequence of ids in the vocabulary.
        """
        oracle = self.speculative is not None and self.speculative.method == "oracle"
        if oracle and draft_reference is None:
            raise EngineError("`draft_reference` is required with speculative method 'oracle' (the request's token "
                              "sequence that the oracle drafts from)")
        if not oracle and draft_reference is not None:
            runs = "no speculation" if self.speculative is None else f"method {self.speculative.method!r}"
            raise EngineError(f"`draft_reference` applies to speculative method 'oracle' only; the engine runs "
                              f"{runs}")
        reference = None if draft_reference is None else \
            _token_ids("draft_reference", draft_reference, self.vocab_size)[: self.pool.max_len]
        prompt = _token_ids("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt:
            raise EngineError("`prompt_ids` must hold at least one token id; got an empty prompt")
        if _is_int(stop_ids) or (np.ndim(stop_ids) == 0 and np.issubdtype(np.asarray(stop_ids).dtype, np.integer)):
            stop_ids = (int(stop_ids),)  # one id (a 0-d integer array too), as Generator's stop_tokens takes it
        stop_ids = _token_ids("stop_ids", () if stop_ids is None else stop_ids, self.vocab_size)
        max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        if len(prompt) + max_new_tokens > self.pool.max_len:
            raise EngineError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) must fit in "
                              f"max_len = {self.pool.max_len} positions")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise EngineError(f"`sampling` must be a SamplingParams or None; got {type(sampling).__name__}")
        request = _Request(self._next_id, prompt, max_new_tokens, None if sampling is None or sampling.greedy
                           else sampling, frozenset(stop_ids), time.perf_counter(), reference)
        self._next_id += 1
        self._waiting.append(request)
        return request.request_id

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, prefilling or decoding."""
        return len(self._waiting) + len(self._prefilling) + len(self._running)

    def step(self) -> list[RequestOutput]:
        """One engine step: admit, one prefill chunk, one decode step (or speculative round) of the running
        requests (module docstring). Returns the requests that finished in it."""
        finished: list[RequestOutput] = []
        self._admit()
        chunk = self._dispatch_prefill() if self._prefilling else None
        if self.speculative is None:
            previous, self._decoding = self._decoding, self._dispatch_decode()
        else:
            previous = self._dispatch_round()  # read in this step: the round is synchronous
        if chunk is not None:
            self._finish_prefill(chunk, finished)
        if previous is not None:
            self._read(previous, finished)
        return finished

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request has finished; returns their outputs in request id order."""
        outputs = []
        while self.num_unfinished:
            outputs.extend(self.step())
        return sorted(outputs, key=lambda o: o.request_id)

    def abort(self, request_id: int) -> RequestOutput | None:
        """End a request before it finishes: waiting, prefilling or decoding (between steps).

        Its slot is freed at once; a decode step already dispatched with it computes its next token,
        which is dropped, as after a stop token the host has not read yet (module docstring), and a
        request admitted into the slot is written after that step. Prefixes it kept stay in the
        prefix cache.

        Args:
          request_id: an id that `add_request` returned.

        Returns:
          The request's RequestOutput (finish_reason "abort"; its sequence the prompt and the tokens
          generated so far), or None where it had finished already.

        Raises:
          EngineError: an id that `add_request` has not returned (checked before anything changes).
        """
        if not _is_int(request_id) or not 0 <= request_id < self._next_id:
            known = f"0 .. {self._next_id - 1}" if self._next_id else "none yet: no request has been added"
            raise EngineError(f"`request_id` must be an id that add_request returned ({known}); got {request_id!r}")
        for queue in (self._waiting, self._prefilling, self._running):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is not None:
                break
        else:
            return None
        queue.remove(request)
        request.done, request.cache = True, None
        if request.slot >= 0:
            self.pool.release(request.slot)
        return RequestOutput(request.request_id, request.prompt + request.generated, len(request.generated), "abort",
                             request.arrival_s, request.token_s, request.cached_tokens)

    # -- the step's parts -------------------------------------------------------------------------

    def _admit(self) -> None:
        """Move waiting requests into free slots (first come, first served)."""
        while self._waiting and self.pool.free_slots:
            request = self._waiting.popleft()
            request.slot = self.pool.allocate()
            self._history[request.slot, : len(request.prompt)] = request.prompt
            if request.reference is not None:
                self._reference[request.slot] = 0
                self._reference[request.slot, : len(request.reference)] = request.reference
                self._reference_len[request.slot] = len(request.reference)
            self._prefilling.append(request)

    def _restore_prefix(self, request: _Request) -> None:
        """Start `request` from the longest kept prefix of its prompt (whole blocks, short of the whole prompt)."""
        if not self.prefix_caching:
            return
        block = self.prefill_chunk
        for end in range((len(request.prompt) - 1) // block * block, 0, -block):
            key = _prefix_key(request.prompt[:end])
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                kept = self._prefixes[key]
                request.cache = kept if self.prefix_store == "device" else \
                    import_sequence(self._prefix_template(), 0, kept)
                request.prefilled = request.cached_tokens = end
                self.stats["prefix_hits"] += 1
                self.stats["cached_tokens"] += end
                return

    def _prefix_template(self):
        if self._template is None:
            greedy = BatchSampling.of([None])
            shapes = jax.eval_shape(lambda p: self._prefill(p, jnp.zeros((1, 1), jnp.int32), None, self._key,
                                                            jnp.zeros((1,), jnp.int32), greedy, False)[1][0],
                                    self._params)
            self._template = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return self._template

    def _dispatch_prefill(self) -> _Chunk:
        """Dispatch the next chunk of the oldest prefilling request, and of up to prefill_batch - 1 more whose
        chunk has its length, is as much their prompt's last and starts from a cache as much as its own (before
        a request's first chunk, restore its longest kept prefix: one that the requests prefilled before it may
        have kept); one call over a bucket of rows (`_prefill_rows`), not waiting for it."""
        def chunk_of(request):
            if request.prefilled == 0:
                self._restore_prefix(request)
            end = min(len(request.prompt), request.prefilled + self.prefill_chunk)
            return end - request.prefilled, end == len(request.prompt), request.cache is None

        first = chunk_of(self._prefilling[0])
        requests = [self._prefilling[0]]
        for request in self._prefilling[1:]:
            if len(requests) == self.prefill_batch:
                break
            if chunk_of(request) == first:
                requests.append(request)
        rows = requests + [requests[0]] * (_prefill_rows(len(requests), self.prefill_batch) - len(requests))
        length, final, fresh = first
        ids = np.asarray([r.prompt[r.prefilled:r.prefilled + length] for r in rows], np.int32)
        caches = None if fresh else tuple(r.cache for r in rows)
        tokens, out = self._prefill(self._params, ids, caches, self._key,
                                    np.asarray([r.request_id for r in rows], np.int32),
                                    BatchSampling.of([r.sampling for r in rows]), final)
        for request, cache in zip(requests, out):
            request.prefilled += length
            request.cache = None if final else cache
            self.stats["prefill_tokens"] += length
        return _Chunk(requests, tokens, out, final)

    def _finish_prefill(self, chunk: _Chunk, finished: list) -> None:
        """Keep a whole block's prefix of each request (prefix caching); after the last chunks, move the
        requests to their slots and emit their first tokens (waiting for the prefill)."""
        for request, cache in zip(chunk.requests, chunk.caches):
            if self.prefix_caching and not chunk.final:  # the chunk ends at a multiple of the block
                key = _prefix_key(request.prompt[:request.prefilled])
                if key not in self._prefixes:
                    self._prefixes[key] = cache if self.prefix_store == "device" else export_sequence(cache, 0)
                    while len(self._prefixes) > self.prefix_cache_size:
                        self._prefixes.popitem(last=False)
        if not chunk.final:
            return
        tokens = np.asarray(chunk.tokens)
        for request, cache, token in zip(chunk.requests, chunk.caches, tokens):
            self._prefilling.remove(request)
            self.pool.write(request.slot, cache)
            self._running.append(request)
            self._emit(request, int(token), finished)

    def _batch_rows(self):
        """(up to batch_size running requests that may take another token, the others waiting: round robin;
        their slots i32[batch_size] (NumPy; distinct, as the pool allocates them), padding rows -1; the number
        of padding rows), or None when no request may take another token (each has a dispatched step that
        gives its last one)."""
        ready = [r for r in self._running if len(r.generated) + r.pending < r.max_new_tokens]
        rows = ready[: self.batch_size]
        if not rows:
            return None
        chosen = set(rows)
        self._running = [r for r in self._running if r not in chosen] + rows
        pad = self.batch_size - len(rows)
        return rows, np.asarray([r.slot for r in rows] + [-1] * pad, np.int32), pad

    def _row_arrays(self, rows: list[_Request], pad: int):
        """(request ids i32[batch_size], the next token's index i32[batch_size], BatchSampling): padding rows 0
        and greedy."""
        ids = np.asarray([r.request_id for r in rows] + [0] * pad, np.int32)
        counts = np.asarray([len(r.generated) + r.pending for r in rows] + [0] * pad, np.int32)
        return ids, counts, BatchSampling.of([r.sampling for r in rows] + [None] * pad)

    def _dispatch_decode(self) -> _Dispatched | None:
        """Dispatch one compiled decode step of up to batch_size running requests, not waiting for it; a
        row that the previous, unread step served continues from that step's token on the device."""
        batch = self._batch_rows()
        if batch is None:
            return None
        rows, slots, pad = batch
        previous = self._decoding
        served = {} if previous is None else {r: i for i, r in enumerate(previous.rows)}
        source = np.asarray([served.get(r, -1) for r in rows] + [-1] * pad, np.int32)
        host = np.asarray([0 if r in served else r.generated[-1] for r in rows] + [0] * pad, np.int32)
        ids, counts, sampling = self._row_arrays(rows, pad)
        tokens, self.pool.cache = self._decode(
            self._params, self.pool.cache, self._no_tokens if previous is None else previous.tokens, source, host,
            slots, self._key, ids, counts, sampling)
        for request in rows:
            request.pending += 1
        self.stats["decode_steps"] += 1
        return _Dispatched(rows, tokens)

    def _dispatch_round(self) -> _Dispatched | None:
        """Dispatch one compiled speculative round of up to batch_size running requests (module docstring)."""
        batch = self._batch_rows()
        if batch is None:
            return None
        rows, slots, pad = batch
        index = np.asarray([r.slot for r in rows] + [0] * pad)
        lengths = np.asarray([len(r.prompt) + len(r.generated) for r in rows] + [1] * pad, np.int32)
        K = self.speculative.num_draft
        limit = np.full((self.batch_size,), K, np.int32)
        if self.speculative.method == "oracle":
            limit = np.clip(self._reference_len[index] - lengths, 0, K).astype(np.int32)
        limit[len(rows):] = 0
        ids, generated, sampling = self._row_arrays(rows, pad)
        draft_key = jax.random.fold_in(self._key, self.stats["decode_steps"])
        tokens, accepted, self.pool.cache = self._round(
            self._params, self.pool.cache, self._drafter(self._reference[index]), jnp.asarray(self._history[index]),
            jnp.asarray(lengths), jnp.asarray(limit), slots, ids, generated, sampling, self._key, draft_key)
        for request in rows:
            request.pending += 1
        self.stats["decode_steps"] += 1
        self.stats["round_rows"] += len(rows)
        return _Dispatched(rows, tokens, accepted)

    def _read(self, dispatched: _Dispatched, finished: list) -> None:
        """Read a dispatched step's tokens to the host (waiting for it) and emit them, a round's accepted
        tokens of each row up to a stop token or max_new_tokens; a request that finished after the step was
        dispatched (at a stop token the host had not read yet) gets nothing from it."""
        tokens = np.asarray(dispatched.tokens).reshape(self.batch_size, -1)
        accepted = np.ones(self.batch_size, np.int32) if dispatched.accepted is None else \
            np.asarray(dispatched.accepted)
        for row, request in enumerate(dispatched.rows):
            request.pending -= 1
            if request.done:
                continue
            if dispatched.accepted is not None:
                self.stats["accepted_tokens"] += int(accepted[row])
            for token in tokens[row, : accepted[row]]:
                if self._emit(request, int(token), finished):
                    break

    def _emit(self, request: _Request, token: int, finished: list) -> bool:
        """Append `token` to `request` (and its slot's history); finish it (its slot freed) on a stop token
        or max_new_tokens. Returns whether it finished."""
        self._history[request.slot, len(request.prompt) + len(request.generated)] = token
        request.generated.append(token)
        request.token_s.append(time.perf_counter())
        reason = "stop" if token in request.stop_ids else "length" if len(request.generated) >= \
            request.max_new_tokens else None
        if reason is None:
            return False
        request.done = True
        self._running.remove(request)
        self.pool.release(request.slot)
        finished.append(RequestOutput(request.request_id, request.prompt + request.generated, len(request.generated),
                                      reason, request.arrival_s, request.token_s, request.cached_tokens))
        return True


def _check_speculative(speculative, buffer_len: int | None) -> SpeculativeConfig | None:
    """`speculative` (None or a SpeculativeConfig the engine runs), checked; EngineError otherwise (the
    Engine's docstring)."""
    if speculative is None:
        return None
    if not isinstance(speculative, SpeculativeConfig):
        raise EngineError(f"`speculative` must be a SpeculativeConfig or None; got {type(speculative).__name__}")
    if speculative.method not in ENGINE_SPECULATIVE_METHODS:
        raise EngineError(f"`speculative.method` {speculative.method!r} is not supported by the Engine (its drafter "
                          f"keeps a state of its own, which the state pool does not hold); the Engine runs "
                          f"{', '.join(map(repr, ENGINE_SPECULATIVE_METHODS))}")
    if speculative.tree is not None:
        raise EngineError("`speculative.tree` is not supported by the Engine (a verify over the state pool takes "
                          "chain windows); give tree=None")
    if speculative.method == "oracle" and len(speculative.reference):
        raise EngineError("`speculative.reference` must be empty with the Engine (e.g. reference=()): each request's "
                          "reference is its `add_request(..., draft_reference=)`")
    window = speculative.num_draft + 1
    if buffer_len is not None and window > buffer_len:
        raise EngineError(f"`speculative.num_draft` + 1 = {window} verified positions must be <= `buffer_len` = "
                          f"{buffer_len} with the replay state (a verify window fits in the buffer)")
    return speculative
