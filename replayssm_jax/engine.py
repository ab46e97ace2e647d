"""Continuous batching over a state pool: requests enter and leave a running batch.

:class:`Engine` holds a :class:`~replayssm_jax.pool.StatePool` of `capacity` slots and a queue
of requests. Each :meth:`Engine.step`

1. admits waiting requests into free slots (first come, first served);
2. prefills one chunk of at most `prefill_chunk` prompt tokens of the oldest admitted request
   (a chunked prefill, `HybridCausalLM.prefill(..., cache=)`: a long prompt takes several steps
   and does not stall the decoding rows); after its last chunk the request's state (converted
   to ReplaySSM where the engine runs it) enters its slot (`StatePool.write`) and its first
   token is chosen from the prefill's logits;
3. decodes every running request in one compiled step of `batch_size` rows
   (``model.decode(tokens, pool, slots=)``; the rows past the running requests are padding
   rows, slot -1), chooses each row's next token (greedy or the request's sampling), and
   finishes the requests that emitted a stop token or reached `max_new_tokens`, freeing their
   slots.

Prefix caching (``prefix_caching=True``): the chunks of every prompt end at multiples of
`prefill_chunk` tokens (the block), and the state after each whole block of a prompt is kept
(on the host, as `sequence_state.export_sequence` of the chunked prefill's cache, which holds
standard SSM states: nothing is pending), keyed by a hash of the prompt's ids up to there. A
later request whose prompt starts with a kept prefix restores the longest one and prefills
only the rest; the chunks after the restored prefix are those of a prefill without the cache,
so the outputs are the same bit for bit.

Greedy decoding gives each request the tokens it gets alone (`Generator`, batch 1), whatever
the other requests and their arrival times.
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

from replayssm_jax.ops.dispatch import ROUTES
from replayssm_jax.ops.validate import check_slots
from replayssm_jax.pool import StatePool
from replayssm_jax.sampling import SamplingParams, sample_tokens
from replayssm_jax.sequence_state import export_sequence, import_sequence

__all__ = ["Engine", "EngineError", "RequestOutput"]


class EngineError(ValueError):
    """A bad engine option or request (named, with the expected and the given value)."""


@dataclasses.dataclass
class RequestOutput:
    """A finished request.

    Attributes:
      request_id: the id `Engine.add_request` returned.
      sequence: the prompt followed by the generated ids (a stop token included).
      num_generated: generated tokens in `sequence`.
      finish_reason: "stop" (a stop token) or "length" (max_new_tokens).
      arrival_s, token_s: `time.perf_counter()` seconds at `add_request` and
        when each generated token was chosen (token_s[0]: the first token,
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


@dataclasses.dataclass
class _Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams | None
    stop_ids: frozenset
    arrival_s: float
    slot: int = -1
    prefilled: int = 0  # prompt tokens whose state the request holds
    cached_tokens: int = 0
    cache: object = None  # the chunked prefill's cache between chunks (batch 1, standard states)
    generated: list = dataclasses.field(default_factory=list)
    token_s: list = dataclasses.field(default_factory=list)


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """`ids` (a 1-D sequence of integer token ids, each in [0, vocab_size)) as a list of ints."""
    if isinstance(ids, (str, bytes)):
        raise EngineError(f"`{name}` must be a sequence of integer token ids; got a {type(ids).__name__}")
    try:
        array = np.asarray(ids)
    except ValueError as e:  # ragged nesting
        raise EngineError(f"`{name}` must be a 1-D sequence of integer token ids; got {ids!r:.80}") from e
    if array.ndim != 1:
        raise EngineError(f"`{name}` must be a 1-D sequence of integer token ids; got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise EngineError(f"`{name}` must hold integer token ids; got dtype {array.dtype}")
    bad = array[(array < 0) | (array >= vocab_size)]
    if bad.size:
        raise EngineError(f"`{name}` has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in array]


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise EngineError(f"`{name}` must be an int >= {minimum}; got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=32)
def _compiled_prefill(graphdef, max_len: int, options: tuple):
    """The jitted chunk prefill of a model structure and pool layout (shared by the engines of one model)."""

    def prefill(params, ids, cache, final):
        model = nnx.merge(graphdef, params)
        chunk_options = dict(options)
        if not final:  # the earlier chunks keep standard states (continued by the next chunk)
            chunk_options["replay_buffer_len"] = None
        return model.prefill(ids, max_len, last_logits_only=True, cache=cache, **chunk_options)

    return jax.jit(prefill, static_argnames=("final",))


@functools.lru_cache(maxsize=32)
def _compiled_decode(graphdef, route: str, backend: str | None):
    """The jitted decode step over a pool (greedy tokens on the device), the pool donated."""

    def decode(params, cache, tokens, slots):
        model = nnx.merge(graphdef, params)
        logits, cache = model.decode(tokens, cache, route=route, backend=backend, slots=slots)
        return logits, jnp.argmax(logits, -1).astype(jnp.int32), cache

    return jax.jit(decode, donate_argnums=(1,))


# One row's draw (a compiled program per SamplingParams).
_sample = jax.jit(sample_tokens, static_argnums=(2,))


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
      buffer_dtype: ReplaySSM record dtype.
      batch_size: rows of the compiled decode step (>= 1; default: capacity); at most
        that many running requests decode per step (in arrival order, round robin
        when more are running).
      prefill_chunk: prompt tokens prefilled per step (>= 1); with prefix caching
        also the block whose boundaries the cache keeps. Each distinct chunk length
        compiles one prefill (at most two per prompt length: whole chunks and the rest).
      max_len: positions per slot (prompt + max_new_tokens of any request).
      prefix_caching: keep and reuse prompt prefixes' states (module docstring).
      prefix_cache_size: prefixes kept (least recently used dropped first), >= 1.
      backend: SSM op backend (replayssm_jax.ops); route: the ReplaySSM step's route.
      seed: PRNG seed of the sampled requests (a request's draws depend only on it,
        its id and the token's index).

    Raises:
      EngineError: an unknown state or route, a buffer_len with "standard", a
        non-positive int option, batch_size above capacity.
      ValueError: a buffer_len the backend's kernels cannot take.
    """

    def __init__(self, model, capacity: int, *, state: str = "replay", buffer_len: int | None = None,
                 buffer_dtype=jnp.float32, batch_size: int | None = None, prefill_chunk: int = 256,
                 max_len: int = 1024, prefix_caching: bool = False, prefix_cache_size: int = 64,
                 backend: str | None = None, route: str = "auto", seed: int = 0):
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
        self.prefix_cache_size = _positive_int("prefix_cache_size", prefix_cache_size)
        self.prefix_caching = bool(prefix_caching)
        self.state = state
        buffer_len = (16 if buffer_len is None else _positive_int("buffer_len", buffer_len)) \
            if state == "replay" else None
        self.pool = StatePool(model, capacity, max_len=_positive_int("max_len", max_len), buffer_len=buffer_len,
                              buffer_dtype=buffer_dtype, backend=backend)
        self.vocab_size = model.config.vocab_size
        self._graphdef, self._params = nnx.split(model)
        self._backend, self._route, self._key = backend, route, jax.random.key(seed)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prefilling: list[_Request] = []
        self._running: list[_Request] = []
        self._prefixes: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._template = None  # a zero batch-1 standard cache: the prefix cache's restore target
        self._next_id = 0
        self.stats = collections.Counter()

    @property
    def _prefill(self):
        """prefill(params, ids [1, T], cache | None, final) -> (logits [1, vocab], batch-1 cache)."""
        return _compiled_prefill(self._graphdef, self.pool.max_len, tuple(sorted(self.pool.prefill_options.items())))

    @property
    def _decode(self):
        """decode(params, pool cache, tokens, slots) -> (logits, greedy tokens, pool cache), the pool donated."""
        return _compiled_decode(self._graphdef, self._route, self._backend)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    stop_ids: Sequence[int] = ()) -> int:
        """Queue a request; returns its id (0, 1, ... in order).

        Args:
          prompt_ids: the prompt's token ids (non-empty, each in [0, vocab_size)).
          max_new_tokens: tokens to generate at most, >= 1; prompt + max_new_tokens <= max_len.
          sampling: a SamplingParams, or None (greedy).
          stop_ids: ids that end the request (kept in its sequence).

        Raises:
          EngineError: an empty prompt, a prompt or stop ids that are not a 1-D
            sequence of integers, an id outside the vocabulary, max_new_tokens < 1,
            a request longer than max_len, a `sampling` that is not a SamplingParams.
        """
        prompt = _token_ids("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt:
            raise EngineError("`prompt_ids` must hold at least one token id; got an empty prompt")
        stop_ids = _token_ids("stop_ids", stop_ids, self.vocab_size)
        max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        if len(prompt) + max_new_tokens > self.pool.max_len:
            raise EngineError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) must fit in "
                              f"max_len = {self.pool.max_len} positions")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise EngineError(f"`sampling` must be a SamplingParams or None; got {type(sampling).__name__}")
        request = _Request(self._next_id, prompt, max_new_tokens, None if sampling is None or sampling.greedy
                           else sampling, frozenset(stop_ids), time.perf_counter())
        self._next_id += 1
        self._waiting.append(request)
        return request.request_id

    @property
    def num_unfinished(self) -> int:
        """Requests waiting, prefilling or decoding."""
        return len(self._waiting) + len(self._prefilling) + len(self._running)

    def step(self) -> list[RequestOutput]:
        """One engine step: admit, one prefill chunk, one decode step of the running requests.
        Returns the requests that finished in it."""
        finished: list[RequestOutput] = []
        while self._waiting and self.pool.free_slots:
            request = self._waiting.popleft()
            request.slot = self.pool.allocate()
            self._prefilling.append(request)
        if self._prefilling:
            self._prefill_chunk(self._prefilling[0], finished)
        if self._running:
            self._decode_step(finished)
        return finished

    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request has finished; returns their outputs in request id order."""
        outputs = []
        while self.num_unfinished:
            outputs.extend(self.step())
        return sorted(outputs, key=lambda o: o.request_id)

    # -- the step's parts -------------------------------------------------------------------------

    def _restore_prefix(self, request: _Request) -> None:
        """Start `request` from the longest kept prefix of its prompt (whole blocks, short of the whole prompt)."""
        if not self.prefix_caching:
            return
        block = self.prefill_chunk
        for end in range((len(request.prompt) - 1) // block * block, 0, -block):
            key = _prefix_key(request.prompt[:end])
            if key in self._prefixes:
                self._prefixes.move_to_end(key)
                request.cache = import_sequence(self._prefix_template(), 0, self._prefixes[key])
                request.prefilled = request.cached_tokens = end
                self.stats["prefix_hits"] += 1
                self.stats["cached_tokens"] += end
                return

    def _prefix_template(self):
        if self._template is None:
            shapes = jax.eval_shape(lambda p: self._prefill(p, jnp.zeros((1, 1), jnp.int32), None, False)[1],
                                    self._params)
            self._template = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return self._template

    def _prefill_chunk(self, request: _Request, finished: list) -> None:
        """Prefill the next chunk of `request`'s prompt (before the first one, restore its longest kept
        prefix: one that the requests prefilled before it may have kept); after the last one, move it to
        its slot."""
        if request.prefilled == 0:
            self._restore_prefix(request)
        start = request.prefilled
        end = min(len(request.prompt), start + self.prefill_chunk)
        final = end == len(request.prompt)
        ids = jnp.asarray([request.prompt[start:end]], jnp.int32)
        logits, cache = self._prefill(self._params, ids, request.cache, final)
        request.prefilled, request.cache = end, None if final else cache
        self.stats["prefill_tokens"] += end - start
        if self.prefix_caching and not final:  # end is a multiple of the block
            key = _prefix_key(request.prompt[:end])
            if key not in self._prefixes:
                self._prefixes[key] = export_sequence(cache, 0)
                while len(self._prefixes) > self.prefix_cache_size:
                    self._prefixes.popitem(last=False)
        if not final:
            return
        self._prefilling.remove(request)
        self.pool.write(request.slot, cache)
        token = self._choose(logits, np.asarray(jnp.argmax(logits, -1)), [request])[0]
        self._running.append(request)
        self._emit(request, token, finished)

    def _decode_step(self, finished: list) -> None:
        """One compiled decode step of up to batch_size running requests (the others wait: round robin)."""
        rows = self._running[: self.batch_size]
        self._running = self._running[self.batch_size:] + rows
        pad = self.batch_size - len(rows)
        tokens = np.asarray([r.generated[-1] for r in rows] + [0] * pad, np.int32)
        slots = check_slots(np.asarray([r.slot for r in rows] + [-1] * pad, np.int32), self.pool.capacity, None)
        logits, greedy, self.pool.cache = self._decode(self._params, self.pool.cache, jnp.asarray(tokens), slots)
        self.stats["decode_steps"] += 1
        for request, token in zip(rows, self._choose(logits, np.asarray(greedy), rows)):
            self._emit(request, token, finished)

    def _choose(self, logits, greedy: np.ndarray, rows: list[_Request]) -> list[int]:
        """Each row's next token: the greedy one, or a draw with the request's sampling."""
        tokens = [int(t) for t in greedy[: len(rows)]]
        for i, request in enumerate(rows):
            if request.sampling is not None:
                key = jax.random.fold_in(jax.random.fold_in(self._key, request.request_id), len(request.generated))
                tokens[i] = int(_sample(logits[i:i + 1], key, request.sampling)[0])
        return tokens

    def _emit(self, request: _Request, token: int, finished: list) -> None:
        """Append `token` to `request`; finish it (its slot freed) on a stop token or max_new_tokens."""
        request.generated.append(token)
        request.token_s.append(time.perf_counter())
        reason = "stop" if token in request.stop_ids else "length" if len(request.generated) >= \
            request.max_new_tokens else None
        if reason is None:
            return
        self._running.remove(request)
        self.pool.release(request.slot)
        finished.append(RequestOutput(request.request_id, request.prompt + request.generated, len(request.generated),
                                      reason, request.arrival_s, request.token_s, request.cached_tokens))
