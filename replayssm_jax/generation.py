"""Compiled generation: prefill, then decode steps under `jax.jit` + `lax.scan`.

The decode loop carries the whole model cache (per SSM layer the ReplaySSM
checkpoint, buffer and cursor, or the standard state; per attention layer
the KV cache) through `lax.scan`, in blocks of `block_size` steps; each
block is one compiled call that donates its carry, so the states are
updated in place. Between blocks the host updates the progress bar and
stops early once every sequence has emitted a stop token.

Ragged prompts: the batch is prefilled over the length of its shortest
prompt; the longer prompts' remaining tokens are then fed by the decode
steps, which force the prompt token instead of the sampled one until a row
reaches its own prompt end. Every row thus sees exactly the token stream it
would see alone (per-sequence cursors and KV lengths follow), at the cost
of decoding, not prefilling, the ragged part of the prompts.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from replayssm_jax import ops
from replayssm_jax.ops import check_route
from replayssm_jax.sampling import SamplingParams, sample_tokens

STATES = ("standard", "replay")


class GenerationError(ValueError):
    """Bad generation input (prompt, lengths, options)."""


@struct.dataclass
class DecodeCarry:
    """What the decode loop carries from step to step.

    Attributes:
      cache: the model's decode cache (models.HybridCache).
      token: i32[batch], the token to feed at the next step.
      pos: i32[], its position (the same for all rows: rows advance together).
      done: bool[batch], rows that have emitted a stop token.
      tokens: i32[batch, total], prompts and chosen tokens so far.
      key: PRNG key.
    """

    cache: object
    token: jax.Array
    pos: jax.Array
    done: jax.Array
    tokens: jax.Array
    key: jax.Array


@dataclasses.dataclass
class GenerationOutput:
    """Result of :meth:`Generator.generate`.

    Attributes:
      sequences: per row, the prompt followed by the generated ids (up to and
        including a stop token, if one was emitted).
      num_generated: per row, generated tokens in `sequences`.
      prefill_s, decode_s: wall-clock seconds of the compiled prefill and of
        the decode loop (compilation excluded).
      compile_s: seconds spent compiling prefill and decode blocks.
      decode_steps: decode steps run (one token for every row each).
      cache_bytes: device bytes of the decode cache (SSM states or checkpoints
        and buffers, conv states, KV caches).
    """

    sequences: list[list[int]]
    num_generated: list[int]
    prefill_s: float
    decode_s: float
    compile_s: float
    decode_steps: int
    cache_bytes: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: tokens the decode steps produced per second, every
        row every step (the steps that feed the rest of longer prompts in a
        ragged batch included); None when no decode step ran."""
        if self.decode_steps == 0 or self.decode_s <= 0:
            return None
        return len(self.sequences) * self.decode_steps / self.decode_s


def _choose(logits, carry_pos, prompts, lengths, key, done, stop_ids, pad_id, sampling):
    """The token at position `carry_pos`: the prompt's while inside it, else sampled."""
    sampled = sample_tokens(logits, jax.random.fold_in(key, carry_pos), sampling)
    forced = carry_pos < lengths
    prompt_token = jax.lax.dynamic_index_in_dim(prompts, carry_pos, axis=1, keepdims=False)
    token = jnp.where(forced, prompt_token, sampled)
    token = jnp.where(done, pad_id, token)
    stopped = ~forced & jnp.isin(token, stop_ids) if stop_ids.size else jnp.zeros_like(done)
    return token, done | stopped


class Generator:
    """Compiled prefill and decode loop for one model and one state mode.

    Args:
      model: a models.* causal LM (Flax NNX module with `prefill` and `decode`).
      state: "standard" (full SSM state read and written every step) or
        "replay" (ReplaySSM with buffer length `buffer_len`).
      buffer_len: L >= 1, for state="replay".
      buffer_dtype: dtype of the ReplaySSM records (default float32).
      backend: SSM op backend (see replayssm_jax.ops); None picks by platform.
      route: the ReplaySSM step's route (replayssm_jax.ops): "output" or
        "state" (the buffered step, same numbers), "direct" (the state
        written every step, the buffer kept for speculative decoding: for
        latency-bound batches of 1-4 rows), or "auto" (default: on the
        kernel backends each layer takes the direct route where its grid
        is latency-bound, else the output route; on "xla" the output
        route; replayssm_jax.ops.resolve_route).
      block_size: decode steps per compiled block (progress and early stop
        happen between blocks).
      prefill_rows: rows per prefill pass, or None for the whole batch at
        once. Prefill memory grows with batch x prompt length (attention
        scores, chunked-scan intermediates); passes of `prefill_rows` rows
        run one after another (`lax.map`) and build the same cache.

    Raises:
      GenerationError: `model` not a model of this package, an unknown
        state, L < 1 (or above the kernels' limit with a kernel backend),
        block_size < 1, prefill_rows < 1.
      ValueError, RuntimeError: an unknown or unavailable backend.
    """

    def __init__(self, model, *, state="replay", buffer_len=16, buffer_dtype=jnp.float32, backend=None,
                 route="auto", block_size=64, prefill_rows=None):
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise GenerationError(f"`model` must be a model of this package (an nnx.Module with a `config`, e.g. "
                                  f"from models.load_model); got {type(model).__name__}")
        if state not in STATES:
            raise GenerationError(f"`state` must be one of {STATES}; got {state!r}")
        if state == "replay":
            buffer_len = _check_int("buffer_len", buffer_len, 1)
        block_size = _check_int("block_size", block_size, 1)
        self.prefill_rows = None if prefill_rows is None else _check_int("prefill_rows", prefill_rows, 1)
        try:
            check_route(route)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        try:
            floating = jnp.issubdtype(jnp.dtype(buffer_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise GenerationError(f"`buffer_dtype` must be a floating dtype; got {buffer_dtype!r}")
        self.backend = ops.resolve_backend(backend)
        if state == "replay":
            try:
                ops.check_buffer_len(buffer_len, self.backend)
            except ValueError as e:
                raise GenerationError(str(e)) from None
        self.state = state
        self.buffer_len = buffer_len if state == "replay" else None
        self.buffer_dtype = buffer_dtype
        self.route = route
        self.block_size = block_size
        self.config = model.config
        self.graphdef, self.params = nnx.split(model)
        self._compiled = {}

    # -- compiled pieces -------------------------------------------------

    def _start_fn(self, prefix_len, total, sampling):
        """prefill(prompts[:, :prefix_len]) and the choice of the token at position prefix_len."""

        def start(params, prompts, lengths, stop_ids, key):
            model = nnx.merge(self.graphdef, params)

            def prefill(ids):
                return model.prefill(ids, total, replay_buffer_len=self.buffer_len, buffer_dtype=self.buffer_dtype,
                                     backend=self.backend, last_logits_only=True)

            logits, cache = _by_rows(prefill, prompts[:, :prefix_len], self.prefill_rows)
            done = jnp.zeros(prompts.shape[0], bool)
            pos = jnp.asarray(prefix_len, jnp.int32)
            token, done = _choose(logits, pos, prompts, lengths, key, done, stop_ids, self._pad_id, sampling)
            tokens = prompts.at[:, prefix_len].set(token)
            return DecodeCarry(cache=cache, token=token, pos=pos, done=done, tokens=tokens, key=key)

        return jax.jit(start)

    def _block_fn(self, steps, sampling):
        """`steps` decode steps under lax.scan, donating the carry."""

        def block(params, carry, prompts, lengths, stop_ids):
            model = nnx.merge(self.graphdef, params)

            def step(carry, _):
                logits, cache = model.decode(carry.token, carry.cache, route=self.route, backend=self.backend)
                pos = carry.pos + 1
                token, done = _choose(logits, pos, prompts, lengths, carry.key, carry.done, stop_ids,
                                      self._pad_id, sampling)
                tokens = jax.lax.dynamic_update_index_in_dim(carry.tokens, token, pos, axis=1)
                return carry.replace(cache=cache, token=token, pos=pos, done=done, tokens=tokens), None

            carry, _ = jax.lax.scan(step, carry, None, length=steps)
            return carry

        return jax.jit(block, donate_argnums=(1,))

    def _compile(self, key, make, *args):
        """AOT-compile `make()` for `args` once per (key, argument shapes); returns
        (executable, seconds spent compiling now)."""
        key = (key, tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        self._compiled[key] = make().lower(*args).compile()
        return self._compiled[key], time.perf_counter() - t0

    def decode_hlo(self) -> list[str]:
        """Optimized HLO text of the decode blocks compiled so far (for inspecting
        that the loop updates its states in place)."""
        return [exe.as_text() for key, exe in self._compiled.items() if key[0][0] == "block"]

    @property
    def _pad_id(self):
        pad = getattr(self.config, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    # -- public ------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, sampling=SamplingParams(),
                 seed: int = 0, stop_tokens: Sequence[int] = (), progress: bool | None = None) -> GenerationOutput:
        """Generate `max_new_tokens` tokens after each prompt.

        Args:
          prompts: one non-empty list of token ids per sequence (lengths may differ).
          max_new_tokens: >= 0 tokens to generate per sequence.
          sampling: SamplingParams (greedy by default).
          seed: PRNG seed for sampling.
          stop_tokens: ids that end a sequence (kept in its output); None or (): none.
          progress: show a progress bar on stderr (None: only on a terminal).

        Returns:
          GenerationOutput.

        The attention layers' KV caches hold len(longest prompt) +
        max_new_tokens positions for every sequence: their memory grows with
        both (a cache that does not fit fails in JAX's allocator).

        Raises:
          GenerationError: prompts that are not a list of non-empty id
            sequences, an id outside the vocabulary, max_new_tokens < 0 or
            more positions than int32 holds, a `sampling` that is not a
            SamplingParams.
        """
        prompts, lengths = self._check_prompts(prompts)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
        if not isinstance(sampling, SamplingParams):
            raise GenerationError(f"`sampling` must be a SamplingParams; got {type(sampling).__name__}")
        stop_tokens = () if stop_tokens is None else stop_tokens
        seed = _check_int("seed", seed, 0, 2**32 - 1)
        if isinstance(stop_tokens, numbers.Integral):
            stop_tokens = [stop_tokens]
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stop_tokens):
            raise GenerationError(f"`stop_tokens` must be token ids (ints); got {list(stop_tokens)!r}")
        stop_ids = self._check_ids(np.asarray(list(stop_tokens), np.int64).reshape(-1), "stop_tokens")
        if max_new_tokens == 0:
            return GenerationOutput([p.tolist() for p in prompts], [0] * len(prompts), 0.0, 0.0, 0.0, 0)
        prefix_len, longest = int(lengths.min()), int(lengths.max())
        total = longest + max_new_tokens
        if total > _MAX_POSITIONS:
            raise GenerationError(f"`max_new_tokens` plus the longest prompt must be <= {_MAX_POSITIONS} positions "
                                  f"(int32 positions and cursors); got {max_new_tokens} + {longest} = {total}")
        padded = np.full((len(prompts), total), self._pad_id, np.int32)
        for row, p in enumerate(prompts):
            padded[row, : len(p)] = p
        args = (jnp.asarray(padded), jnp.asarray(lengths, jnp.int32), jnp.asarray(stop_ids, jnp.int32))
        key = jax.random.key(seed)

        start, compile_s = self._compile(("start", prefix_len, total, sampling),
                                         lambda: self._start_fn(prefix_len, total, sampling), self.params, *args, key)
        t0 = time.perf_counter()
        carry = start(self.params, *args, key)
        jax.block_until_ready(carry)
        prefill_s = time.perf_counter() - t0

        steps = total - prefix_len - 1
        plan = [self.block_size] * (steps // self.block_size) + ([steps % self.block_size] if steps % self.block_size else [])
        blocks = {}
        for n in sorted(set(plan)):
            blocks[n], seconds = self._compile(("block", n, sampling), lambda n=n: self._block_fn(n, sampling),
                                               self.params, carry, *args)
            compile_s += seconds

        done_steps, t0 = 0, time.perf_counter()
        with _progress(steps, progress) as bar:
            for n in plan:
                carry = blocks[n](self.params, carry, *args)
                done_steps += n
                if stop_ids.size and bool(jnp.all(carry.done)):
                    break
                bar.update(n)
        tokens = np.asarray(carry.tokens)
        decode_s = time.perf_counter() - t0
        cache_bytes = sum(a.nbytes for a in jax.tree.leaves(carry.cache))
        return self._collect(tokens, lengths, max_new_tokens, stop_ids, prefill_s, decode_s, compile_s, done_steps,
                             cache_bytes)

    def _collect(self, tokens, lengths, max_new_tokens, stop_ids, prefill_s, decode_s, compile_s, steps, cache_bytes):
        stops = set(stop_ids.tolist())
        sequences, counts = [], []
        for row, length in enumerate(lengths):
            new = tokens[row, length : length + max_new_tokens].tolist()
            ends = [i for i, t in enumerate(new) if t in stops]
            new = new[: ends[0] + 1] if ends else new
            sequences.append(tokens[row, :length].tolist() + new)
            counts.append(len(new))
        return GenerationOutput(sequences, counts, prefill_s, decode_s, compile_s, steps, cache_bytes)

    def _check_ids(self, ids: np.ndarray, name: str) -> np.ndarray:
        vocab = int(self.config.vocab_size)
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise GenerationError(f"`{name}` has token id {int(bad[0])} outside the vocabulary [0, {vocab})")
        return ids

    def _check_prompts(self, prompts):
        if isinstance(prompts, (np.ndarray, jax.Array)):
            prompts = np.asarray(prompts)
            if prompts.ndim != 2:
                raise GenerationError(f"`prompts` must have shape [batch, seqlen]; got {prompts.shape}")
            prompts = list(prompts)
        if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
            raise GenerationError(f"`prompts` must be a list of token-id sequences; got {type(prompts).__name__}")
        rows = []
        for i, p in enumerate(prompts):
            try:
                rows.append(np.asarray(p))
            except ValueError as e:  # a ragged nesting
                raise GenerationError(f"prompt {i} is not a flat list of token ids: {e}") from None
        if not rows:
            raise GenerationError("`prompts` is empty: give at least one sequence")
        for i, p in enumerate(rows):
            if p.ndim != 1 or p.size == 0:
                hint = " (`prompts` is a list of sequences: [[ids...], ...])" if p.ndim == 0 else ""
                raise GenerationError(f"prompt {i} is empty or not a flat list of ids (shape {p.shape}){hint}")
            if not np.issubdtype(p.dtype, np.integer):
                raise GenerationError(f"prompt {i} must hold integer token ids; got dtype {p.dtype}")
            self._check_ids(p, f"prompt {i}")
        return [p.astype(np.int32) for p in rows], np.array([p.size for p in rows], np.int32)


# Positions, lengths and cursors are int32.
_MAX_POSITIONS = 2**31 - 1


def _by_rows(fn, ids, rows):
    """fn(ids) for ids [batch, T], in passes of `rows` rows (None: one pass).

    Every leaf of fn's output has batch as its leading axis. The last pass is
    filled up with copies of row 0, whose results are dropped.
    """
    batch = ids.shape[0]
    if rows is None or rows >= batch:
        return fn(ids)
    passes = -(-batch // rows)
    fill = jnp.broadcast_to(ids[:1], (passes * rows - batch, ids.shape[1]))
    out = jax.lax.map(fn, jnp.concatenate([ids, fill]).reshape(passes, rows, ids.shape[1]))
    return jax.tree.map(lambda a: a.reshape(passes * rows, *a.shape[2:])[:batch], out)


def _check_int(name, value, low, high=None) -> int:
    """`value` as a Python int in [low, high]; NumPy integers are accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GenerationError(f"`{name}` must be an int; got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise GenerationError(f"`{name}` must be {bound}; got {value}")
    return int(value)


class _progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, total, enabled):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self):
        from tqdm import tqdm

        disable = None if self.enabled is None else not self.enabled
        self.bar = tqdm(total=self.total, unit="step", desc="decode", disable=disable, leave=False)
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()


def generate(model, prompts, max_new_tokens: int, *, state="replay", buffer_len=16, buffer_dtype=jnp.float32,
             backend=None, route="auto", sampling=SamplingParams(), seed=0, stop_tokens=(),
             progress=None) -> GenerationOutput:
    """One-call generation: `Generator(model, ...).generate(prompts, ...)`; see both."""
    generator = Generator(model, state=state, buffer_len=buffer_len, buffer_dtype=buffer_dtype, backend=backend,
                          route=route)
    return generator.generate(prompts, max_new_tokens, sampling=sampling, seed=seed, stop_tokens=stop_tokens,
                              progress=progress)
