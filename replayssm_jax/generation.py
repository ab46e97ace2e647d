"""Compiled generation: prefill, then decode steps under `jax.jit` + `lax.scan`.

The decode loop carries the whole model cache (per SSM layer the ReplaySSM
checkpoint, buffer and cursor, or the standard state; per attention layer
the KV cache) through `lax.scan`, in blocks of decode steps; each block is
one compiled call that donates its carry, so the states are updated in
place, and returns the tokens it chose. Between blocks the host updates the
progress bar, hands the new tokens to an `on_token` callback, and stops
early once every sequence has emitted a stop token.

Ragged prompts: the batch is prefilled over a prefix no longer than its
shortest prompt; the prompts' remaining tokens are then fed by the decode
steps, which force the prompt token instead of the sampled one until a row
reaches its own prompt end. Every row thus sees exactly the token stream it
would see alone (per-sequence cursors and KV lengths follow), at the cost
of decoding, not prefilling, the ragged part of the prompts.

Shape buckets: compiled code is specialised to its shapes, so every shape
that depends on the request is rounded to a bucket (`bucket`: exact below
8, then 4 sizes per power of two, at most 25% above the size asked for).
The batch is padded up (to a power of two up to 8) with rows that are
marked done from the start; the prefill length is rounded down (the rest
of each prompt is fed by decode steps, as above); the prompt array and the
KV cache length are rounded up; the decode runs whole blocks of
`block_size` steps, then the rest in a block of the next power of two
steps (the rest itself where that exceeds block_size), whose extra steps
are dropped. Requests that differ only within one bucket reuse the
compiled prefill and decode blocks. A row's tokens do not depend on the
padding: padded rows and unused KV slots never reach a real row's logits,
and a prompt token fed by a decode step goes through the same recurrence
as in the prefill (equal to rounding; tests/test_generation.py checks the
greedy tokens against transformers').

Memory: before compiling, the cache's shapes come from tracing the prefill
(`jax.jit(...).trace`: shapes and dtypes, nothing allocated); a cache that
does not fit the device's free memory raises `InsufficientMemoryError`
with the batch and length that would fit. The temporaries of each compiled
program (XLA's `memory_analysis`) are checked too, after it compiles and
before it runs: the prefill's and the decode blocks' beside the cache
before the prefill runs, a speculative run's drafter state and speculative
block after it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from replayssm_jax import ops
from replayssm_jax.compilation import jit
from replayssm_jax.layers.cache import KVCache, ReplayLayerState
from replayssm_jax.ops import check_route, validate
from replayssm_jax.pool import is_abstract
from replayssm_jax.sampling import SamplingParams, sample_tokens
from replayssm_jax.state import is_quantized

STATES = ("standard", "replay")

# Positions, lengths and cursors are int32.
_MAX_POSITIONS = 2**31 - 1
# Smallest KV cache length and prompt array width: tiny requests share one shape.
_MIN_POSITIONS = 32


class _FromConfig:
    """The default of `sampling` and `stop_tokens`: what the Generator's
    `generation_config` says (greedy and no stop token without one)."""

    def __repr__(self):
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()


class GenerationError(ValueError):
    """Bad generation input (prompt, lengths, options)."""


SPECULATIVE_METHODS = ("ngram", "oracle", "mtp", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for a Generator (replayssm_jax.speculative.loop).

    Attributes:
      method: "ngram" (prompt lookup, `NgramDrafter`), "oracle"
        (`OracleDrafter`: drafts of a known continuation, for tests and
        benchmarks), "mtp" (the target's multi-token prediction head,
        `models.mtp.MTPDrafter`: the model must be loaded with
        ``models.load_model(path, mtp=True)``) or "draft" (a separate draft
        model, `replayssm_jax.speculative.draft_model.DraftModelDrafter`).
        "mtp" and "draft" sample their drafts as the run samples (greedy: the
        argmax).
      num_draft: K >= 1 drafts per round; each round verifies W = K + 1
        positions (W <= buffer_len with the ReplaySSM state).
      max_ngram, min_ngram: the n-gram lengths matched by "ngram".
      alpha: "oracle": the probability in [0, 1] that a draft is right.
      reference: "oracle": per row the full token sequence it drafts from
        (prompt included), a list of id lists or an int array [batch, n].
      draft_model: "draft": a model of this package with the target's
        vocabulary (it may be the target itself), or a checkpoint folder
        (loaded with `models.load_model` in the checkpoint's dtype). It keeps
        the Generator's state mode and buffer length.
      tree: None (chain rounds), or tree speculation: a
        :class:`~replayssm_jax.speculative.tree.DraftTree` of the top-k shape
        or a (topk, depth) pair (`DraftTree.topk`) with depth = num_draft;
        each round verifies the tree's N = 1 + topk * depth nodes (N <=
        buffer_len with the ReplaySSM state) and keeps a path of up to
        depth + 1 tokens (`replayssm_jax.speculative.tree_drafters`; the
        "oracle" proposes topk - 1 more candidates per depth, each right
        with probability alpha where the draft is not).

    Raises:
      GenerationError: an unknown method, num_draft < 1, bad n-gram lengths,
        alpha outside [0, 1], an "oracle" without `reference`, a "draft"
        without `draft_model`, a `draft_model` with another method; a
        `tree` that is not a top-k DraftTree or pair, or of another depth
        than num_draft.
    """

    method: str
    num_draft: int
    max_ngram: int = 3
    min_ngram: int = 1
    alpha: float = 1.0
    reference: object = dataclasses.field(default=None, hash=False, compare=False)
    draft_model: object = dataclasses.field(default=None, hash=False, compare=False)
    tree: object = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise GenerationError(f"`speculative.method` must be one of {SPECULATIVE_METHODS}; got {self.method!r}")
        _check_int("num_draft", self.num_draft, 1)
        _check_int("min_ngram", self.min_ngram, 1)
        _check_int("max_ngram", self.max_ngram, 1)
        if self.max_ngram < self.min_ngram:
            raise GenerationError(f"`max_ngram` must be >= `min_ngram` = {self.min_ngram}; got {self.max_ngram}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha <= 1.0:
            raise GenerationError(f"`alpha` must be a float in [0, 1]; got {alpha!r}")
        if self.method == "oracle" and self.reference is None:
            raise GenerationError("`speculative.reference` is required with method 'oracle'")
        if self.method != "draft" and self.draft_model is not None:
            raise GenerationError(f"`speculative.draft_model` applies to method 'draft' only; got it with method "
                                  f"{self.method!r}")
        if self.method == "draft" and self.draft_model is None:
            raise GenerationError("`speculative.draft_model` (a model or a checkpoint folder) is required with "
                                  "method 'draft'")
        if self.method == "draft" and not isinstance(self.draft_model, (nnx.Module, str, os.PathLike)):
            raise GenerationError(f"`speculative.draft_model` must be a model of this package or a checkpoint folder; "
                                  f"got {type(self.draft_model).__name__}")
        if self.tree is not None:
            from replayssm_jax.speculative.tree import as_tree
            from replayssm_jax.speculative.tree_drafters import topk_of

            try:
                tree = as_tree(self.tree, "speculative.tree")
                topk_of(tree, self.num_draft)
            except (TypeError, ValueError) as e:
                raise GenerationError(f"`speculative.tree`: {e}") from None
            object.__setattr__(self, "tree", tree)

    @property
    def window(self) -> int:
        """The positions verified per round: W = K + 1, or the tree's N nodes."""
        return self.num_draft + 1 if self.tree is None else self.tree.size

    @property
    def program_key(self) -> tuple:
        """What the compiled round depends on: the fields but `alpha`, `reference` and `draft_model`
        (the oracle's alpha and reference are leaves of the drafter, an argument of the round)."""
        return self.method, self.num_draft, self.max_ngram, self.min_ngram, self.tree


class InsufficientMemoryError(GenerationError, MemoryError):
    """A generation whose decode cache (with the weights, where they are not yet
    loaded) does not fit the device's free memory; raised before allocating it."""


@struct.dataclass
class DecodeCarry:
    """What the decode loop carries from step to step.

    Attributes:
      cache: the model's decode cache (models.HybridCache).
      token: i32[rows], the token to feed at the next step.
      pos: i32[], its position (the same for all rows: rows advance together).
      done: bool[rows], rows that have emitted a stop token (and padding rows).
      key: PRNG key.
    """

    cache: object
    token: jax.Array
    pos: jax.Array
    done: jax.Array
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
      compile_s: seconds spent tracing and compiling prefill and decode
        blocks in this call (0 when every shape was compiled before; a hit of
        JAX's persistent compilation cache counts its loading time).
      decode_steps: decode steps run (one token for every row each; the
        steps of the last block past the longest row's end included);
        speculative decoding: the rounds run.
      cache_bytes: device bytes of the decode cache (SSM states or checkpoints
        and buffers, conv states, KV caches) at the padded batch; with a
        stateful drafter, its state (a draft model's cache) included.
      cache_rows: that padded batch (`cache_bytes_per_sequence` = cache_bytes
        / cache_rows, the bytes one sequence holds).
      prompt_lengths: per row, the prompt's length.
      accepted_per_round: speculative decoding: the mean new tokens per row
        and round (accepted drafts plus the target's own token, 1..K + 1,
        counted before any cut at a stop token or max_new_tokens: the
        drafts' acceptance length, as the Engine's `accepted_tokens`) over
        the rounds in which a row generated; None otherwise.
      decode_tokens: speculative decoding: the new tokens the rounds produced
        (every real row; the first new token, from the prefill, excluded);
        None otherwise (then `decode_steps` counts them for every row).
      row_accepted_per_round: speculative decoding: per row, the mean new
        tokens per round (as `accepted_per_round`) over the rounds in which
        it generated (None for a row without such a round); None otherwise.
      lockstep: whether the decode blocks flushed every row's buffer in one
        direct step a cycle (`Generator`'s `lockstep`, as resolved for this
        request's batch); False for the standard state and speculative
        decoding, and where nothing was decoded.
    """

    sequences: list[list[int]]
    num_generated: list[int]
    prefill_s: float
    decode_s: float
    compile_s: float
    decode_steps: int
    cache_bytes: int = 0
    prompt_lengths: list[int] = dataclasses.field(default_factory=list)
    accepted_per_round: float | None = None
    decode_tokens: int | None = None
    row_accepted_per_round: list[float | None] | None = None
    cache_rows: int = 0
    lockstep: bool = False

    @property
    def cache_bytes_per_sequence(self) -> int:
        """Device bytes of one row's decode cache (0 when nothing was decoded)."""
        return self.cache_bytes // self.cache_rows if self.cache_rows else 0

    @property
    def new_ids(self) -> list[list[int]]:
        """Per row, the generated ids alone (`sequences` without the prompt)."""
        return [s[n:] for s, n in zip(self.sequences, self.prompt_lengths)]

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: tokens the decode steps produced per second, every
        row every step (the steps that feed the rest of longer prompts in a
        ragged batch or of a prompt longer than its prefill bucket included);
        None when no decode step ran or no row got a second new token (the
        first new token follows the prompt: its step measures no decoding).
        Speculative decoding: `decode_tokens` per second of the rounds."""
        if self.decode_tokens is not None:
            return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 else None
        if self.decode_steps == 0 or self.decode_s <= 0 or max(self.num_generated, default=0) < 2:
            return None
        return len(self.sequences) * self.decode_steps / self.decode_s


# -- shape buckets --------------------------------------------------------------------------------


def bucket(n: int, *, up: bool = True) -> int:
    """`n` >= 1 rounded up (or down) to a shape bucket.

    Sizes below 8 are their own bucket; from 8 on there are four per power of
    two (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...), so rounding up adds at
    most 25% and rounding down removes at most 20%.
    """
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step if up else n // step * step


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The bucketed shapes of one request.

    batch: the rows given; rows: the padded batch; prefix_len: prefill length;
    width: prompt array width; max_len: KV cache positions; the decode runs
    `full_blocks` blocks of `block_size` steps, then one of `last_block`
    steps (0: none).
    """

    batch: int
    rows: int
    prefix_len: int
    width: int
    max_len: int
    block_size: int
    full_blocks: int
    last_block: int

    @property
    def steps(self) -> int:
        return self.full_blocks * self.block_size + self.last_block

    @property
    def block_sizes(self) -> list[int]:
        """The distinct block sizes (each one compiled program)."""
        return [n for n in {self.block_size if self.full_blocks else 0, self.last_block} if n]

    def blocks(self):
        """The block sizes in order."""
        yield from itertools.repeat(self.block_size, self.full_blocks)
        if self.last_block:
            yield self.last_block


def _plan(lengths: np.ndarray, max_new_tokens: int, block_size: int, row_multiple: int = 1) -> _Plan:
    """The bucketed shapes of a request (`_Plan`); the padded rows a multiple of `row_multiple` (dp)."""
    shortest, longest = int(lengths.min()), int(lengths.max())
    prefix_len = bucket(shortest, up=False)
    # The start chooses the token at position prefix_len; each decode step the next one.
    steps = longest + max_new_tokens - 1 - prefix_len
    full, rest = divmod(steps, block_size)
    last = _pow2_at_least(rest) if rest else 0
    if last > block_size or prefix_len + full * block_size + last > _MAX_POSITIONS:
        last = rest  # no rounding past block_size (or past the int32 positions)
    needed = prefix_len + full * block_size + last  # the KV cache holds every position fed
    max_len = bucket(max(needed, _MIN_POSITIONS))
    max_len = max_len if max_len <= _MAX_POSITIONS else needed
    width = bucket(max(longest, _MIN_POSITIONS))
    batch = len(lengths)
    rows = _pow2_at_least(batch) if batch <= 8 else bucket(batch)
    rows = -(-rows // row_multiple) * row_multiple
    return _Plan(batch, rows, prefix_len, width, max_len, block_size, full, last)


# -- memory ---------------------------------------------------------------------------------------


def _temp_bytes(executable) -> int:
    """The temporaries of a compiled program (XLA's buffer assignment); 0 where the backend does not say."""
    try:
        stats = executable.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return 0
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0)


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _estimate_key(plan, sampling) -> tuple:
    """The key of `Generator._estimates`: the plan's shapes and the sampling (a sampling drafter's state
    is larger)."""
    return plan.rows, plan.prefix_len, plan.width, plan.max_len, sampling


def _kv_bytes(tree) -> int:
    """Bytes of the attention KV caches (keys and values) in `tree` (a cache, a carry holding one, or None)."""
    caches = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache)) if isinstance(x, KVCache)]
    return _nbytes([(c.k, c.v) for c in caches])


def format_bytes(n: float) -> str:
    """`n` bytes as "12 B", "3.4 KiB", ..., "5.6 TiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_memory(device=None) -> tuple[int, str]:
    """(bytes, what): the memory a new allocation on `device` can take.

    A GPU: the JAX allocator's limit less its bytes in use
    (`Device.memory_stats()`). A CPU (no memory stats): the host's available
    memory (Linux: MemAvailable of /proc/meminfo; else free physical pages).
    """
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except (RuntimeError, NotImplementedError):
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind} memory free to JAX"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes a generation allocates beyond the weights (from shapes, before allocating).

    Attributes:
      rows: the batch, padded to its shape bucket.
      max_len: KV cache positions (the longest prompt plus the new tokens,
        rounded up to a bucket).
      kv_bytes: the attention layers' KV caches (grow with rows x max_len).
      state_bytes: everything else the decode loop carries: SSM states or
        ReplaySSM checkpoints and buffers, conv states, lengths, cursors.
      input_bytes: the prompt ids and the other inputs of the compiled calls.
      draft_bytes: of kv_bytes + state_bytes, the speculative drafter's own
        state (a draft model's KV caches and SSM states, an MTP head's
        cache); 0 without a stateful drafter.
    """

    rows: int
    max_len: int
    kv_bytes: int
    state_bytes: int
    input_bytes: int
    draft_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.input_bytes

    def describe(self) -> str:
        """One phrase: the total and its parts."""
        draft = f"; the draft's own {format_bytes(self.draft_bytes)} included" if self.draft_bytes else ""
        return (f"{format_bytes(self.total_bytes)} (KV caches {format_bytes(self.kv_bytes)}, SSM states, buffers and conv states "
                f"{format_bytes(self.state_bytes)}, prompt ids {format_bytes(self.input_bytes)}{draft})")

    def fits(self, free: int, *, longest_prompt: int, block_size: int) -> str:
        """What would fit in `free` bytes: the largest batch at this length and
        the largest max_new_tokens at this batch (about: the shapes are rounded
        to buckets)."""
        per_row = (self.kv_bytes + self.state_bytes + self.input_bytes) / self.rows
        kv_per_position = self.kv_bytes / (self.rows * self.max_len)
        rows = int(free // per_row) if per_row else 0
        batch_fits = (f"a batch of up to {bucket(rows, up=False)} fits at this length" if rows >= 1
                      else "no batch fits at this length")
        if kv_per_position == 0:
            return f"{batch_fits}; the cache does not grow with `max_new_tokens` (no attention layer)"
        fixed = (self.state_bytes + self.input_bytes) / self.rows
        positions = int((free / self.rows - fixed) / kv_per_position)
        new = (bucket(positions, up=False) if positions >= 1 else 0) - longest_prompt - block_size
        length_fits = (f"`max_new_tokens` up to about {new} fits at this batch" if new >= 1
                       else "not even one new token fits at this batch")
        return f"{length_fits}; {batch_fits}"


# -- progress and status lines --------------------------------------------------------------------


def _disabled(enabled: bool | None):
    """tqdm's `disable`: None shows only on a terminal (tqdm checks stderr)."""
    return None if enabled is None else not enabled


@contextlib.contextmanager
def status(text: str, enabled: bool | None = None):
    """A one-line status on stderr while a long step runs, cleared at its end.

    Args:
      text: what runs, e.g. "compiling prefill".
      enabled: True: always; False: never; None: only when stderr is a
        terminal (nothing on a pipe or a file).
    """
    from tqdm import tqdm

    line = tqdm(total=0, desc=text, bar_format="{desc} ...", disable=_disabled(enabled), leave=False,
                file=sys.stderr)
    line.refresh()
    try:
        yield
    finally:
        line.close()


@contextlib.contextmanager
def _progress(total: int, enabled: bool | None):
    """A tqdm bar of decode steps on stderr, or nothing."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="step", desc="decode", disable=_disabled(enabled), leave=False, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


# -- JAX's persistent compilation cache -----------------------------------------------------------


def default_compile_cache() -> str:
    """`$XDG_CACHE_HOME/replayssm-jax/jax`, by default `~/.cache/replayssm-jax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "replayssm-jax", "jax")


def set_compile_cache(directory: str | os.PathLike | None) -> str | None:
    """Keep compiled programs in `directory` (JAX's persistent compilation cache), or stop (None).

    Process-wide (it sets `jax_compilation_cache_dir`), for every compile
    that follows: a later process compiling the same program with the same
    JAX version and device loads it from the cache instead. Every program is
    kept, however short its compile (`jax_persistent_cache_min_compile_time_secs`
    0). The command line calls this with `default_compile_cache()` unless
    given --no-compile-cache; Python programs call it themselves.

    Returns:
      The absolute directory, or None.

    Raises:
      GenerationError: a directory that cannot be created.
    """
    from jax.experimental.compilation_cache import compilation_cache

    current = jax.config.jax_compilation_cache_dir
    if directory is None:
        if current is not None:
            compilation_cache.reset_cache()
            jax.config.update("jax_compilation_cache_dir", None)
        return None
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise GenerationError(f"compile cache directory {directory!r} cannot be created: {e}") from None
    if directory != current:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


# -- the compiled pieces --------------------------------------------------------------------------


def _choose(logits, carry_pos, prompts, lengths, key, done, stop_ids, pad_id, sampling):
    """The token at position `carry_pos`: the prompt's while inside it, else sampled."""
    sampled = sample_tokens(logits, jax.random.fold_in(key, carry_pos), sampling)
    forced = carry_pos < lengths
    prompt_token = jax.lax.dynamic_index_in_dim(prompts, jnp.minimum(carry_pos, prompts.shape[1] - 1), axis=1,
                                                keepdims=False)
    token = jnp.where(forced, prompt_token, sampled)
    token = jnp.where(done, pad_id, token)
    stopped = ~forced & jnp.isin(token, stop_ids)
    return token, done | stopped


def _check_state_dtype(state: str, state_dtype, rounding: str):
    """(state_dtype as a dtype or None, rounding) of a Generator; GenerationError for a dtype other than the
    replay checkpoints' four, an unknown rounding, or a state_dtype with the standard state."""
    try:
        rounding = validate.check_rounding("state_rounding", rounding)
        dtype = None if state_dtype is None else validate.check_checkpoint_dtype("state_dtype", state_dtype)
    except (TypeError, ValueError) as e:
        raise GenerationError(str(e)) from None
    if dtype is not None and state != "replay":
        raise GenerationError(f"`state_dtype` applies to state 'replay' (its checkpoints) only; got {dtype} with "
                              "state 'standard' (its SSM states keep the model's ssm_state_dtype)")
    if rounding != "nearest" and (dtype is None or dtype.itemsize != 1):
        validate.warn(f"`state_rounding` {rounding!r} applies to 8-bit checkpoints (state_dtype int8 or "
                      f"float8_e4m3fn) only; with state {state!r} and state_dtype {dtype} it is ignored")
    return dtype, rounding


class Generator:
    """Compiled prefill and decode loop for one model and one state mode.

    Args:
      model: a models.* causal LM (Flax NNX module with `prefill` and `decode`).
        An abstract one (`nnx.eval_shape`) serves `memory_estimate`.
      state: "standard" (full SSM state read and written every step) or
        "replay" (ReplaySSM with buffer length `buffer_len`).
      buffer_len: L >= 1 for state="replay", or None (16). The standard state
        has no buffer: a buffer_len other than None with it warns (UserWarning).
      buffer_dtype: dtype of the ReplaySSM records; None (default): each
        layer's narrowest exact one (`SSMMixer.exact_buffer_dtype`: Mamba-2's
        x and B in the activations' dtype, bfloat16 in a bfloat16 model, at
        half the bytes of float32; GDN's computed records in float32).
      state_dtype: dtype of the ReplaySSM checkpoints: None (the model's
        ssm_state_dtype), float32, bfloat16, int8 or float8_e4m3fn (8-bit:
        one f32 scale per state row, quantized at each flush; state
        "replay" only). state_rounding: an 8-bit checkpoint's rounding,
        "nearest" or "stochastic" (replayssm_jax.ops.*_replay_init); for
        other checkpoints "stochastic" is ignored (UserWarning).
      backend: SSM op backend (see replayssm_jax.ops); None picks by platform.
      route: the ReplaySSM step's route (replayssm_jax.ops): "output",
        "state" or "deferred" (the buffered step, same numbers; "deferred"
        flushes a full row in its next step), "direct" (the state
        written every step, the buffer kept for speculative decoding: for
        latency-bound batches of 1-4 rows), or "auto" (default: on the
        kernel backends each layer takes the direct route where its grid
        is latency-bound, else the deferred route from batch 64 with an
        f32 or bf16 checkpoint, else the output route; on "xla" the output
        route; replayssm_jax.ops.resolve_route). The standard state has
        no route: another value than "auto" with it warns (UserWarning).
      block_size: decode steps per compiled block (progress, `on_token` and
        early stop happen between blocks; the last block runs the rest
        rounded up to a power of two where that stays <= block_size).
      lockstep: with state "replay", flush every row's buffer in the same
        decode step. The rows of a Generator step together from the
        prefill (every cursor 0), so every L-th step all of them are full:
        lockstep decodes each cycle of L steps as L - 1 steps without a
        flush (the append route, `replayssm_jax.ops`: the output route's
        kernel alone; on `route` "state", that route, whose flush launch
        finds no row), then one step on the direct route (the standard
        step's kernel, folding the row's L - 1 buffered records into its
        checkpoint tile first: one read and one write of each checkpoint a
        cycle, as the flush, and that step's readout with it), where the
        replay step reads the checkpoint once more and writes it in a flush
        launch. The same math (the flush of the reference, ARCHITECTURE.md,
        "The math"), up to the rounding of that step's record to the buffer's
        dtype, which the direct step does not round. None (default): on
        where it applies and pays: a kernel backend, block_size a multiple
        of L, plain decoding (`speculative` None), a float32 or bfloat16
        checkpoint (the direct route warns on an 8-bit one, so lockstep
        stays off there), some SSM layer not on the direct route at the batch
        (`route` "direct", or "auto" on a latency-bound grid, decodes every
        step directly anyway). True: on wherever the state, block_size,
        `speculative`, `route` and checkpoint allow it, whatever the backend
        and the layers' routes (xla included); False: off (every replay
        step may flush). `GenerationOutput.lockstep` says whether a request
        ran in lockstep.
      prefill_rows: rows per prefill pass, or None for the whole batch at
        once. Prefill memory grows with batch x prompt length (attention
        scores, chunked-scan intermediates); passes of `prefill_rows` rows
        run one after another (`lax.map`) and build the same cache.
      generation_config: the checkpoint's generation defaults
        (`models.load_generation_config(path)`), or None (greedy, no stop
        token): `generate` stops at its `eos_token_id` and samples as it
        says unless given `stop_tokens` / `sampling`, as transformers does;
        its `pad_token_id` fills finished rows.
      speculative: a SpeculativeConfig: `generate` runs speculative rounds
        (draft K tokens, verify K + 1 positions in one call, accept, commit;
        replayssm_jax.speculative.loop) of up to `block_size` rounds per
        compiled block; None: one token per decode step. The drafters with a
        state ("mtp", "draft") compile one more program, their state's start
        from the prefill (the MTP head over the prefill's hidden states, the
        draft model's prefill).
      mesh: None, or a ("dp", "tp") ``jax.sharding.Mesh`` (`models.sharding.make_mesh`):
        the model runs sharded over it (`models.sharding.ShardedLM`: heads, intermediate
        sizes and vocabulary over tp, batch rows over dp; a model on one device is
        sharded with `models.sharding.shard_model`, a ShardedLM must be on this mesh).
        The padded batch is rounded up to a multiple of dp. A ShardedLM given without
        a mesh runs on its own.

    Raises:
      GenerationError: `model` not a model of this package, an unknown
        state, L < 1 (or above the kernels' limit with a kernel backend),
        block_size < 1, prefill_rows < 1, a `generation_config` without the
        fields of `models.GenerationConfig`, a `speculative` that is not a
        SpeculativeConfig or whose window K + 1 exceeds buffer_len, method
        "mtp" on a model without an MTP head, a "draft" model that cannot be
        loaded or whose vocab_size differs from the model's; with a mesh,
        a config that tp does not divide (naming the config key), a
        prefill_rows that dp does not divide, a ShardedLM on another mesh,
        or speculative method "mtp" or "draft"; `lockstep` not True, False
        or None, or True with the standard state, a block_size that
        buffer_len does not divide, `speculative`, route "direct" or an
        8-bit state_dtype.
      ValueError, RuntimeError: an unknown or unavailable backend.
    """

    def __init__(self, model, *, state="replay", buffer_len=None, buffer_dtype=None, backend=None,
                 route="auto", block_size=16, prefill_rows=None, generation_config=None, speculative=None,
                 state_dtype=None, state_rounding="nearest", mesh=None, lockstep=None):
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise GenerationError(f"`model` must be a model of this package (an nnx.Module with a `config`, e.g. "
                                  f"from models.load_model); got {type(model).__name__}")
        if state not in STATES:
            raise GenerationError(f"`state` must be one of {STATES}; got {state!r}")
        if state == "replay":
            buffer_len = _check_int("buffer_len", 16 if buffer_len is None else buffer_len, 1)
        elif buffer_len is not None:
            validate.warn(f"`buffer_len` {buffer_len!r} applies to state 'replay' only; the standard state ignores it")
        block_size = _check_int("block_size", block_size, 1)
        self.prefill_rows = None if prefill_rows is None else _check_int("prefill_rows", prefill_rows, 1)
        try:
            check_route(route)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        if state == "standard" and route != "auto":
            validate.warn(f"`route` {route!r} applies to state 'replay' only; the standard state ignores it")
        try:
            floating = buffer_dtype is None or jnp.issubdtype(jnp.dtype(buffer_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise GenerationError(f"`buffer_dtype` must be a floating dtype; got {buffer_dtype!r}")
        fields = ("eos_token_id", "pad_token_id", "temperature", "top_k", "top_p", "do_sample")
        if generation_config is not None and not all(hasattr(generation_config, f) for f in fields):
            raise GenerationError(f"`generation_config` must be a models.GenerationConfig or None; got "
                                  f"{type(generation_config).__name__}")
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise GenerationError(f"`speculative` must be a SpeculativeConfig or None; got {type(speculative).__name__}")
        sharded = mesh is not None or hasattr(model, "mesh")
        if sharded and speculative is not None and speculative.method in ("mtp", "draft"):
            raise GenerationError(f"`speculative.method` {speculative.method!r} is not supported with a `mesh` (its "
                                  f"drafter's model is not sharded); use 'ngram' or 'oracle'")
        if speculative is not None and state == "replay" and speculative.window > buffer_len:
            what = "`speculative.num_draft` + 1" if speculative.tree is None else "`speculative.tree`'s nodes"
            raise GenerationError(f"{what} = {speculative.window} verified positions must be <= "
                                  f"`buffer_len` = {buffer_len} with the replay state (a window fits in the buffer)")
        self.state_dtype, self.state_rounding = _check_state_dtype(state, state_dtype, state_rounding)
        self.speculative = speculative
        self.backend = ops.resolve_backend(backend)
        self._stateful_drafter = self._stateful_drafter_for(model, speculative, state, buffer_len, buffer_dtype,
                                                           self.backend)
        if state == "replay":
            try:
                ops.check_buffer_len(buffer_len, self.backend)
            except ValueError as e:
                raise GenerationError(str(e)) from None
        self.state = state
        self.buffer_len = buffer_len if state == "replay" else None
        self.lockstep = self._check_lockstep(lockstep, route, block_size)
        self.buffer_dtype = buffer_dtype
        self.route = route
        self.block_size = block_size
        self.config = model.config
        self.generation_config = generation_config
        model = _on_mesh(model, mesh)
        self.mesh = getattr(model, "mesh", None)
        self.dp = 1 if self.mesh is None else self.mesh.shape["dp"]
        if self.prefill_rows is not None and self.prefill_rows % self.dp:
            raise GenerationError(f"`prefill_rows` must be a multiple of the mesh's dp = {self.dp}; got "
                                  f"{self.prefill_rows}")
        self.graphdef, self.params = nnx.split(model)
        self._compiled = {}
        self._estimates = {}

    def _check_lockstep(self, lockstep, route: str, block_size: int) -> bool | None:
        """`lockstep` (see the class docstring) once checked against the rest of the configuration: False
        where it cannot apply (None asked), a GenerationError where True was asked."""
        if lockstep is not None and not isinstance(lockstep, (bool, np.bool_)):
            raise GenerationError(f"`lockstep` must be True, False or None; got {lockstep!r}")
        if lockstep is False:
            return False
        blockers = []
        if self.state != "replay":
            blockers.append(f"state {self.state!r} (no buffer)")
        elif block_size % self.buffer_len:
            blockers.append(f"block_size = {block_size} not a multiple of buffer_len = {self.buffer_len}")
        if self.speculative is not None:
            blockers.append("speculative decoding (its rounds commit windows of varying length)")
        if route == "direct":
            blockers.append("route 'direct' (every step already writes the state)")
        if self.state_dtype is not None and is_quantized(self.state_dtype):
            blockers.append(f"an 8-bit checkpoint ({self.state_dtype})")
        if blockers and lockstep:
            raise GenerationError(f"`lockstep=True` needs a replay state whose buffer_len divides block_size, plain "
                                  f"decoding, a route other than 'direct' and a float32 or bfloat16 checkpoint; got "
                                  f"{'; '.join(blockers)}")
        if blockers:
            return False
        return bool(lockstep) if lockstep is not None else None

    def lockstep_cycle(self, cache) -> int | None:
        """The cycle L (the buffer length) where this Generator's decode blocks run in lockstep (see
        `lockstep`) on a cache like `cache` (only its shapes and dtypes are read: the layers' routes at its
        batch), else None."""
        if self.lockstep is False:
            return None
        if self.lockstep is None:
            if self.backend == "xla":
                return None
            routes = {ops.resolve_route(self.route, self.backend, s.replay) for s in cache.layers
                      if isinstance(s, ReplayLayerState)}
            if routes <= {"direct"}:
                return None
        return self.buffer_len

    def _start_fn(self, prefix_len, max_len, sampling):
        """prefill(prompts[:, :prefix_len]) and the choice of the token at position prefix_len."""

        def start(params, prompts, lengths, active, stop_ids, key):
            model = nnx.merge(self.graphdef, params)

            def prefill(ids):
                return model.prefill(ids, max_len, replay_buffer_len=self.buffer_len, buffer_dtype=self.buffer_dtype,
                                     backend=self.backend, last_logits_only=True, max_window=self._window,
                                     return_hidden=self._needs_hidden, checkpoint_dtype=self.state_dtype,
                                     checkpoint_rounding=self.state_rounding)

            out = _by_rows(prefill, prompts[:, :prefix_len], self.prefill_rows)
            logits, cache = out[0], out[-1]
            pos = jnp.asarray(prefix_len, jnp.int32)
            token, done = _choose(logits, pos, prompts, lengths, key, ~active, stop_ids, self._pad_id, sampling)
            carry = DecodeCarry(cache=cache, token=token, pos=pos, done=done, key=key)
            # A speculative drafter that reads hidden states gets the prefill's (every position).
            return (carry, out[1]) if self._needs_hidden else carry

        return jit(start)

    def _block_fn(self, steps, sampling):
        """`steps` decode steps under lax.scan, donating the carry; returns it and the tokens i32[steps, rows]."""

        def block(params, carry, prompts, lengths, stop_ids):
            model = nnx.merge(self.graphdef, params)

            def step(carry, route):
                logits, cache = model.decode(carry.token, carry.cache, route=route, backend=self.backend)
                pos = carry.pos + 1
                token, done = _choose(logits, pos, prompts, lengths, carry.key, carry.done, stop_ids,
                                      self._pad_id, sampling)
                return carry.replace(cache=cache, token=token, pos=pos, done=done), token

            def run(carry, n: int, route: str):  # n steps on `route`; tokens i32[n, rows]
                return jax.lax.scan(lambda c, _: step(c, route), carry, None, length=n)

            L = self.lockstep_cycle(carry.cache)
            if L is None:
                return run(carry, steps, self.route)
            # No row fills its buffer before the cycle's last step: the output route needs no flush there.
            buffered = "state" if self.route == "state" else "append"

            def cycle(carry, _):  # from cursors 0: L - 1 steps without a flush, then every row's flush
                carry, tokens = run(carry, L - 1, buffered)
                carry, last = step(carry, "direct")
                return carry, jnp.concatenate([tokens, last[None]])

            # A block starts at cursors 0 (block_size is a multiple of L); the last block's tail of
            # steps % L steps flushes no row.
            carry, tokens = jax.lax.scan(cycle, carry, None, length=steps // L)
            tokens = tokens.reshape(-1, tokens.shape[-1])
            if steps % L:
                carry, tail = run(carry, steps % L, buffered)
                tokens = jnp.concatenate([tokens, tail])
            return carry, tokens

        return jit(block, donate_argnums=(1,))

    @property
    def compilations(self) -> int:
        """Programs (prefills and decode blocks) this Generator has compiled so far."""
        return len(self._compiled)

    def decode_hlo(self) -> list[str]:
        """Optimized HLO text of the decode blocks compiled so far, the speculative
        blocks of rounds included (for inspecting that the loop updates its states
        in place)."""
        return [exe.as_text() for key, exe in self._compiled.items() if key[0] in ("block", "spec")]

    @property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters, and of the draft model's with speculative method "draft"
        (also of abstract models')."""
        return _nbytes(self.params) + getattr(self._stateful_drafter, "weights_bytes", 0)

    @property
    def _window(self) -> int:
        """The verify window the cache is prefilled for (1: plain decoding)."""
        return 1 if self.speculative is None else self.speculative.window

    @property
    def _needs_hidden(self) -> bool:
        """Whether the speculative drafter reads the target's hidden states (the prefill returns them)."""
        return self._stateful_drafter is not None and self._stateful_drafter.needs_hidden

    @property
    def _pad_id(self) -> int:
        pad = getattr(self.generation_config, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.config, "pad_token_id", None)
        return 0 if pad is None or not 0 <= pad < self.config.vocab_size else int(pad)

    # -- argument checks --------------------------------------------------------------------------

    def _check_ids(self, ids: np.ndarray, row: str) -> np.ndarray:
        vocab = int(self.config.vocab_size)
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise GenerationError(f"{row} has token id {int(bad[0])} outside the vocabulary [0, {vocab})")
        return ids

    def _check_prompts(self, prompts, name: str = "prompts", row: str = "prompt"):
        """Token-id rows (`name`: the argument; `row`: what a row of it is called in errors) as i32 arrays
        and their lengths; GenerationError for anything else."""
        if isinstance(prompts, (np.ndarray, jax.Array)):
            prompts = np.asarray(prompts)
            if prompts.ndim != 2:
                raise GenerationError(f"`{name}` must have shape [batch, seqlen]; got {prompts.shape}")
            prompts = list(prompts)
        if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
            raise GenerationError(f"`{name}` must be a list of token-id sequences; got {type(prompts).__name__}")
        rows = []
        for i, p in enumerate(prompts):
            try:
                rows.append(np.asarray(p))
            except ValueError as e:  # a ragged nesting
                raise GenerationError(f"{row} {i} is not a flat list of token ids: {e}") from None
        if not rows:
            raise GenerationError(f"`{name}` is empty: give at least one sequence")
        vocab = int(self.config.vocab_size)
        for i, p in enumerate(rows):
            if p.dtype.kind in "US":  # a string, not token ids
                raise GenerationError(f"{row} {i} must be a sequence of integer token ids; got a string "
                                      f"{prompts[i]!r:.40} (tokenize text first: `replayssm_jax.text.Tokenizer`)")
            if p.ndim != 1 or p.size == 0:
                hint = f" (`{name}` is a list of sequences: [[ids...], ...])" if p.ndim == 0 else ""
                raise GenerationError(f"{row} {i} is empty or not a flat list of ids (shape {p.shape}){hint}")
            if p.dtype == object and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in p):
                # Python ints beyond int64: outside any vocabulary
                bad = next(int(t) for t in p if not 0 <= t < vocab)
                raise GenerationError(f"{row} {i} has token id {bad} outside the vocabulary [0, {vocab})")
            if not np.issubdtype(p.dtype, np.integer):
                raise GenerationError(f"{row} {i} must hold integer token ids; got dtype {p.dtype}")
            self._check_ids(p, f"{row} {i}")
        return [p.astype(np.int32) for p in rows], np.array([p.size for p in rows], np.int32)

    def _stop_ids(self, stop_tokens) -> np.ndarray:
        if stop_tokens is FROM_CONFIG:
            stop_tokens = getattr(self.generation_config, "eos_token_id", None)
        if stop_tokens is None:
            stop_tokens = ()
        if isinstance(stop_tokens, numbers.Integral):
            stop_tokens = [stop_tokens]
        if isinstance(stop_tokens, (str, bytes)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stop_tokens):
            raise GenerationError(f"`stop_tokens` must be token ids (ints); got {stop_tokens!r}")
        if any(not 0 <= t < self.config.vocab_size for t in stop_tokens):
            bad = next(int(t) for t in stop_tokens if not 0 <= t < self.config.vocab_size)
            raise GenerationError(f"`stop_tokens` has token id {bad} outside the vocabulary "
                                  f"[0, {int(self.config.vocab_size)})")
        return np.asarray(sorted(set(int(t) for t in stop_tokens)), np.int32)

    def _sampling(self, sampling) -> SamplingParams:
        if sampling is FROM_CONFIG:
            try:
                return SamplingParams.from_generation_config(self.generation_config)
            except ValueError as e:
                raise GenerationError(f"`generation_config` gives bad sampling defaults: {e}") from None
        if not isinstance(sampling, SamplingParams):
            raise GenerationError(f"`sampling` must be a SamplingParams; got {type(sampling).__name__}")
        return sampling

    def _check_concrete(self):
        """GenerationError where the model's or the draft model's parameters are shapes only (an
        abstract model, from nnx.eval_shape, which serves `memory_estimate` alone)."""
        draft = None
        if self.speculative is not None and self.speculative.method == "draft":
            draft = self._stateful_drafter.params
        for what, params in (("model", self.params), ("speculative.draft_model", draft)):
            if is_abstract(params):
                raise GenerationError(f"`{what}` is abstract (its parameters are shapes only, as nnx.eval_shape "
                                      f"gives them): it serves `memory_estimate`; load its weights to generate")

    def _check_request(self, prompts, max_new_tokens):
        prompts, lengths = self._check_prompts(prompts)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
        longest = int(lengths.max())
        if longest + max_new_tokens > _MAX_POSITIONS:
            raise GenerationError(f"`max_new_tokens` plus the longest prompt must be <= {_MAX_POSITIONS} positions "
                                  f"(int32 positions and cursors); got {max_new_tokens} + {longest} = "
                                  f"{max_new_tokens + longest}")
        return prompts, lengths, max_new_tokens

    # -- memory -----------------------------------------------------------------------------------

    def _inputs(self, plan: _Plan, prompts, lengths, stop_ids):
        """The compiled calls' inputs: prompts i32[rows, width] (padding rows copy row 0),
        lengths i32[rows], active bool[rows], stop ids i32[n] (padded with -1 to a multiple of 4)."""
        padded = np.full((plan.rows, plan.width), self._pad_id, np.int32)
        for row in range(plan.rows):
            p = prompts[row] if row < plan.batch else prompts[0]
            padded[row, : len(p)] = p
        rows_lengths = np.concatenate([lengths, np.full(plan.rows - plan.batch, lengths[0], np.int32)])
        active = np.arange(plan.rows) < plan.batch
        stops = np.full(4 * (len(stop_ids) // 4 + 1), -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        return tuple(jnp.asarray(a) for a in (padded, rows_lengths, active, stops))

    def _trace_start(self, plan, sampling, inputs, key):
        """The start function traced for `plan` (shapes only); records its MemoryEstimate."""
        traced = self._start_fn(plan.prefix_len, plan.max_len, sampling).trace(self.params, *inputs, key)
        carry, hidden = traced.out_info if self._needs_hidden else (traced.out_info, None)
        draft = self._drafter_state_shapes(plan, sampling, hidden)
        kv_bytes = _kv_bytes(carry) + _kv_bytes(draft)
        self._estimates[_estimate_key(plan, sampling)] = MemoryEstimate(
            rows=plan.rows, max_len=plan.max_len, kv_bytes=kv_bytes,
            state_bytes=_nbytes(carry) + _nbytes(draft) - kv_bytes, input_bytes=_nbytes(inputs),
            draft_bytes=_nbytes(draft))
        return traced

    def _drafter_state_shapes(self, plan, sampling, hidden):
        """The shapes of the stateful drafter's state before the first round (a draft model's cache, an
        MTP head's, with what a tree or `sampling` adds to it), traced for `plan` with the drafter the
        run builds (nothing allocated); None without a stateful drafter."""
        from replayssm_jax.speculative.drafters import DraftStart

        if self._stateful_drafter is None:
            return None
        history_len = plan.max_len + self._window
        start = DraftStart(history=jax.ShapeDtypeStruct((plan.rows, history_len), jnp.int32),
                           hidden=hidden, key=jax.eval_shape(jax.random.key, 0), prefix_len=plan.prefix_len)
        return jax.eval_shape(lambda params, drafter, start: drafter.init_state(nnx.merge(self.graphdef, params),
                                                                                start),
                              self.params, self._drafter(plan, history_len, sampling), start)

    def memory_estimate(self, prompts, max_new_tokens: int, *, sampling: SamplingParams = FROM_CONFIG
                        ) -> MemoryEstimate:
        """The device bytes `generate(prompts, max_new_tokens, sampling=sampling)` would allocate
        beyond the weights, from shapes alone (nothing is allocated or compiled; an abstract
        model serves, e.g. `nnx.eval_shape(lambda: models.random_init.init_model(path, dtype))`).
        `sampling` as `generate`'s (a sampling speculative drafter keeps its draft distributions).

        Raises:
          GenerationError: as `generate`.
        """
        prompts, lengths, max_new_tokens = self._check_request(prompts, max_new_tokens)
        sampling = self._sampling(sampling)
        plan = _plan(lengths, max(max_new_tokens, 1), self.block_size, self.dp)
        if _estimate_key(plan, sampling) not in self._estimates:
            inputs = self._inputs(plan, prompts, lengths, np.zeros(0, np.int32))
            self._trace_start(plan, sampling, inputs, jax.random.key(0))
        return self._estimates[_estimate_key(plan, sampling)]

    def _check_fits(self, estimate: MemoryEstimate, plan: _Plan, lengths, temp_bytes: int = 0,
                    program: str = "the prefill"):
        """Raise InsufficientMemoryError unless the cache (and `program`'s `temp_bytes` of
        temporaries, from the compiled program) fit the free memory. On a mesh the
        cache is split over its devices (heads over tp, rows over dp): each device's
        share, 1 / devices of it, and the temporaries (per device) must fit one device."""
        free, where = free_memory()
        devices = 1 if self.mesh is None else self.mesh.size
        if estimate.total_bytes // devices + temp_bytes <= free:
            return
        hint = " (`prefill_rows` lowers them)" if program == "the prefill" else ""
        if temp_bytes >= free:  # no cache fits beside them: the advice is about the program, not the batch
            self._refuse_temporaries(temp_bytes, program, free, where, hint)
        temporaries = f" and {program} {format_bytes(temp_bytes)} of temporaries{hint}" if temp_bytes else ""
        over = "" if devices == 1 else f" over {devices} devices"
        raise InsufficientMemoryError(
            f"`prompts` ({plan.batch} rows, padded to {plan.rows}) with `max_new_tokens` do not fit: the decode cache "
            f"of {plan.max_len} positions needs {estimate.describe()}{over}{temporaries}, and the {where} is "
            f"{format_bytes(free)}; " + estimate.fits((free - temp_bytes) * devices, longest_prompt=int(lengths.max()),
                                                      block_size=self.block_size))

    def _check_temporaries(self, executable, program: str):
        """Raise InsufficientMemoryError unless `program`'s temporaries (XLA's buffer assignment of the
        compiled `executable`, per device) fit the memory free now, its inputs already allocated."""
        temp_bytes = _temp_bytes(executable)
        free, where = free_memory()
        if temp_bytes > free:
            self._refuse_temporaries(temp_bytes, program, free, where)

    def _refuse_temporaries(self, temp_bytes: int, program: str, free: int, where: str, hint: str = ""):
        """Raise InsufficientMemoryError: `program`'s temporaries alone exceed the `free` memory (`hint`:
        what lowers them, if anything but the batch does)."""
        cpu = jax.devices()[0].platform == "cpu"
        bf16 = any(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(self.params))
        # Measured (2026-12-03, bench/configs/qwen3_5_4b_like, bfloat16): 15.8 GiB of decode-block
        # temporaries for 7.8 GiB of weights.
        why = (" (on a CPU, XLA computes a bfloat16 model's matrix products on float32 copies of its weights, "
               f"twice the weights' {format_bytes(self.weights_bytes)})") if cpu and bf16 else ""
        raise InsufficientMemoryError(
            f"{program} needs {format_bytes(temp_bytes)} of temporaries beside the weights and the decode cache"
            f"{why}{hint}, and the {where} is {format_bytes(free)}: no batch or length fits")

    def _compile(self, key, traced, what, progress):
        """The executable for `key`, compiled from `traced` (a `jax.jit(...).trace`) on first use;
        returns (executable, seconds spent now)."""
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        with status(f"compiling {what}", progress):
            self._compiled[key] = traced().lower().compile()
        return self._compiled[key], time.perf_counter() - t0

    def _compiled_start(self, plan, sampling, inputs, key, lengths, progress):
        """The compiled prefill for `plan` after the memory checks; returns (executable, compile seconds)."""
        start_key = ("start", plan.rows, plan.prefix_len, plan.width, plan.max_len, sampling)
        traced, trace_s = None, 0.0
        if start_key not in self._compiled:
            t0 = time.perf_counter()
            traced = self._trace_start(plan, sampling, inputs, key)
            trace_s = time.perf_counter() - t0
        estimate = self._estimates[_estimate_key(plan, sampling)]
        self._check_fits(estimate, plan, lengths)
        what = f"prefill ({plan.rows} rows x {plan.prefix_len} tokens, cache of {plan.max_len} positions)"
        start, compile_s = self._compile(start_key, lambda: traced, what, progress)
        self._check_fits(estimate, plan, lengths, _temp_bytes(start))
        return start, compile_s + trace_s

    @staticmethod
    def _stateful_drafter_for(model, spec, state, buffer_len, buffer_dtype, backend):
        """The drafter of methods "mtp" and "draft" (greedy; `_drafter` sets the run's sampling),
        built and checked once; None for the other methods.

        Raises:
          GenerationError: "mtp" on a model without an MTP head; a "draft" model that cannot
            be loaded or whose vocabulary differs from the target's.
        """
        if spec is None or spec.method not in ("mtp", "draft"):
            return None
        if spec.method == "mtp":
            from models.mtp import MTPDrafter, has_mtp_head

            if not has_mtp_head(model):
                raise GenerationError(f"`speculative.method` 'mtp' needs a model with a multi-token prediction head; "
                                      f"`model` ({type(model).__name__}) has none: load it with "
                                      f"models.load_model(path, mtp=True)")
            return MTPDrafter.for_model(model, spec.num_draft)
        from replayssm_jax.speculative.draft_model import DraftModelDrafter, check_draft_model

        draft, folder = spec.draft_model, None
        if not isinstance(draft, nnx.Module):
            from models import CheckpointError, CheckpointNotFoundError, ConfigError, load_model

            folder = os.fspath(draft)
            try:
                draft = load_model(folder)
            except (CheckpointNotFoundError, ConfigError, CheckpointError, OSError) as e:
                raise GenerationError(f"`speculative.draft_model`: cannot load checkpoint {folder!r}: {e}") from None
        if not hasattr(draft, "config") or not hasattr(draft, "verify"):
            raise GenerationError(f"`speculative.draft_model` must be a model of this package (with `verify`); got "
                                  f"{type(draft).__name__}")
        try:
            check_draft_model(model.config, draft.config, draft_checkpoint=folder)
        except ValueError as e:
            raise GenerationError(f"`speculative.draft_model`: {e}") from None
        return DraftModelDrafter.for_model(draft, spec.num_draft, replay_buffer_len=buffer_len if state == "replay"
                                           else None, buffer_dtype=buffer_dtype, backend=backend)

    def _drafter(self, plan: _Plan, history_len: int, sampling: SamplingParams):
        """The configured Drafter for `plan`'s rows (the oracle's reference padded to [rows, history_len];
        the drafts of "mtp" and "draft" sampled as `sampling` says; a TreeDrafter with `speculative.tree`)."""
        spec = self.speculative
        if spec.tree is not None:
            from replayssm_jax.speculative.tree_drafters import TreeDrafter

            topk = (spec.tree.size - 1) // spec.tree.max_depth
            return TreeDrafter(self._chain_drafter(plan, history_len, sampling, branches=topk - 1), spec.tree)
        return self._chain_drafter(plan, history_len, sampling)

    def _chain_drafter(self, plan: _Plan, history_len: int, sampling: SamplingParams, branches: int = 0):
        """`_drafter`'s chain drafter; with `branches` > 0, one whose Drafts carry per-position scores or
        `branches` ranked candidates (a tree's other candidates)."""
        from replayssm_jax.speculative import NgramDrafter, OracleDrafter

        spec = self.speculative
        if self._stateful_drafter is not None:
            return dataclasses.replace(self._stateful_drafter, sampling=sampling, **({"scores": True} if branches
                                                                                     else {}))
        if spec.method == "ngram":
            return NgramDrafter(spec.num_draft, max_ngram=spec.max_ngram, min_ngram=spec.min_ngram,
                                vocab_size=int(self.config.vocab_size) if branches else None)
        reference = self._oracle_reference(plan.batch)
        padded = np.full((plan.rows, history_len), self._pad_id, np.int32)
        for row, ref in enumerate(reference):
            padded[row, : min(len(ref), history_len)] = ref[:history_len]
        return OracleDrafter(jnp.asarray(padded), spec.alpha, spec.num_draft, int(self.config.vocab_size),
                             branches=branches)

    def _oracle_reference(self, batch: int) -> list[np.ndarray]:
        """The oracle's reference rows, checked against the vocabulary and one per prompt of `batch`
        (GenerationError otherwise)."""
        reference, _ = self._check_prompts(self.speculative.reference, "speculative.reference",
                                           "`speculative.reference` row")
        if len(reference) != batch:
            raise GenerationError(f"`speculative.reference` must have one row per prompt ({batch}); got "
                                  f"{len(reference)}")
        return reference

    def _spec_begin_fn(self, plan: _Plan):
        """The function (for `jit`) from the prefill's outputs to the first round's carry fields:
        (padded i32[rows, width], row_lengths i32[rows], token i32[rows], done bool[rows],
        max_new_tokens i32[], key) -> (history i32[rows, max_len + W], known i32[rows], done
        bool[rows], the drafter state's key)."""
        history_len, pad_id, width, prefix_len = plan.max_len + self._window, self._pad_id, plan.width, plan.prefix_len

        def begin(padded, row_lengths, token, done, max_new_tokens, key):
            history = jnp.full((padded.shape[0], history_len), pad_id, jnp.int32).at[:, :width].set(padded)
            known = jnp.maximum(row_lengths, prefix_len + 1)
            return (history.at[:, prefix_len].set(token), known, done | (known - row_lengths >= max_new_tokens),
                    jax.random.split(key)[1])

        return begin

    def _drafter_state(self, drafter, plan: _Plan, sampling, history, hidden, key, progress):
        """The drafter's state before the first round (`Drafter.init_state`, compiled for stateful
        drafters); returns (state, compile seconds)."""
        from replayssm_jax.speculative.drafters import DraftStart

        if self._stateful_drafter is None:
            return None, 0.0
        start = DraftStart(history=history, hidden=hidden, key=key, prefix_len=plan.prefix_len)

        def init(params, drafter, start):
            return drafter.init_state(nnx.merge(self.graphdef, params), start)

        init_key = ("spec-init", sampling, plan.rows, plan.prefix_len, plan.width, plan.max_len)
        make = lambda: jit(init).trace(self.params, drafter, start)  # noqa: E731
        what = f"{self.speculative.method} drafter state"
        compiled, seconds = self._compile(init_key, make, what, progress)
        self._check_temporaries(compiled, f"the {what}'s program")
        return compiled(self.params, drafter, start), seconds

    def _generate_speculative(self, plan, prompts, lengths, max_new_tokens, sampling, inputs, key, start,
                              compile_s, progress, on_token):
        """`generate` by speculative rounds (replayssm_jax.speculative.loop), after the compiled prefill."""
        from replayssm_jax.speculative.loop import SpeculativeCarry, make_block

        window = self._window
        history_len = plan.max_len + window
        drafter = self._drafter(plan, history_len, sampling)
        padded, row_lengths, _, stops = inputs

        # prefill_s: the target's prefill, then the rounds' start and the drafter's state, each timed
        # after its program compiled (a compile overlapping a running program would hide its time)
        t0 = time.perf_counter()
        out = jax.block_until_ready(start(self.params, *inputs, key))
        prefill_s = time.perf_counter() - t0
        first, hidden = out if self._needs_hidden else (out, None)
        begin_args = (padded, row_lengths, first.token, first.done, np.int32(max_new_tokens), key)
        begin, seconds = self._compile(("spec-begin", plan.rows, plan.width, plan.prefix_len, plan.max_len),
                                       lambda: jit(self._spec_begin_fn(plan)).trace(*begin_args),
                                       "speculative start", progress)
        compile_s += seconds
        t0 = time.perf_counter()
        history, known, done, draft_key = jax.block_until_ready(begin(*begin_args))
        drafter_state, seconds = self._drafter_state(drafter, plan, sampling, history, hidden, draft_key, progress)
        compile_s += seconds
        zeros = np.zeros(plan.rows, np.int32)
        carry = SpeculativeCarry(cache=first.cache, history=history, known=known, done=done,
                                 rounds=np.int32(0), accepted=zeros, row_rounds=zeros, key=key,
                                 drafter_state=drafter_state)
        carry = jax.block_until_ready(jax.tree.map(jnp.asarray, carry))
        prefill_s += time.perf_counter() - t0 - seconds  # the drafter's prefill included, its compilation not

        block_key = ("spec", self.speculative.program_key, sampling, max_new_tokens, plan.rows, plan.width, plan.max_len)
        make = lambda: make_block(  # noqa: E731
            self.graphdef, rounds=self.block_size, max_new_tokens=max_new_tokens, sampling=sampling,
            pad_id=self._pad_id, backend=self.backend).trace(self.params, drafter, carry, row_lengths, stops)
        block, seconds = self._compile(block_key, make, f"speculative block ({self.block_size} rounds)", progress)
        compile_s += seconds
        self._check_temporaries(block, f"the speculative block of {self.block_size} rounds")

        stream = _RowStream(lengths, max_new_tokens, set(np.asarray(stops).tolist()) - {-1}, self._pad_id, on_token)
        stream.update(np.asarray(carry.history), np.asarray(carry.known), np.asarray(carry.done))
        t0 = time.perf_counter()
        while not bool(np.all(np.asarray(carry.done)[: plan.batch])):
            carry = block(self.params, drafter, carry, row_lengths, stops)
            if on_token is not None:
                stream.update(np.asarray(carry.history), np.asarray(carry.known), np.asarray(carry.done))
        jax.block_until_ready(carry)
        decode_s = time.perf_counter() - t0
        stream.update(np.asarray(carry.history), np.asarray(carry.known), np.asarray(carry.done))
        sequences, counts = stream.finish(prompts)
        accepted = np.asarray(carry.accepted)[: plan.batch]
        row_rounds = np.asarray(carry.row_rounds)[: plan.batch]
        from_prefill = sum(1 for n, c in zip(lengths, counts) if n <= plan.prefix_len and c)
        return GenerationOutput(sequences, counts, prefill_s, decode_s, compile_s, int(carry.rounds),
                                _nbytes((carry.cache, carry.drafter_state)), prompt_lengths=lengths.tolist(),
                                accepted_per_round=float(accepted.sum() / row_rounds.sum()) if row_rounds.sum() else None,
                                decode_tokens=sum(counts) - from_prefill, cache_rows=plan.rows,
                                row_accepted_per_round=[float(a / r) if r else None
                                                        for a, r in zip(accepted, row_rounds)])

    # -- public -----------------------------------------------------------------------------------

    def with_speculative(self, speculative: SpeculativeConfig) -> "Generator":
        """This Generator with another `speculative` config of the same compiled round: the same
        method, num_draft, n-gram lengths and tree (`SpeculativeConfig.program_key`), another oracle
        `alpha` or `reference`. The two share their compiled programs, so a run of the new one
        compiles nothing that this one has compiled (e.g. a benchmark's runs over alphas).

        Raises:
          GenerationError: `speculative` not a SpeculativeConfig, this Generator not speculative,
            a config of another compiled round, or another `draft_model`.
        """
        if not isinstance(speculative, SpeculativeConfig):
            raise GenerationError(f"`speculative` must be a SpeculativeConfig; got {type(speculative).__name__}")
        if self.speculative is None:
            raise GenerationError("with_speculative: this Generator is not speculative (`speculative` None); "
                                  "construct one with `speculative=`")
        if speculative.program_key != self.speculative.program_key:
            raise GenerationError(f"`speculative` must keep this Generator's (method, num_draft, max_ngram, "
                                  f"min_ngram, tree) = {self.speculative.program_key}; got "
                                  f"{speculative.program_key}")
        if speculative.draft_model is not self.speculative.draft_model:  # its drafter is built at construction
            raise GenerationError("`speculative.draft_model` must be this Generator's draft model (the same "
                                  "object); construct a new Generator for another draft model")
        other = copy.copy(self)  # the dicts of compiled programs and estimates shared, not copied
        other.speculative = speculative
        return other

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: SamplingParams = FROM_CONFIG, seed: int = 0,
                 stop_tokens: Sequence[int] | None = FROM_CONFIG,
                 progress: bool | None = None,
                 on_token: Callable[[int, np.ndarray], None] | None = None) -> GenerationOutput:
        """Generate `max_new_tokens` tokens after each prompt.

        Args:
          prompts: one non-empty list of token ids per sequence (lengths may differ).
          max_new_tokens: >= 0 tokens to generate per sequence.
          sampling: SamplingParams; by default (FROM_CONFIG) the
            `generation_config`'s (`SamplingParams.from_generation_config`;
            greedy without one).
          seed: PRNG seed for sampling.
          stop_tokens: ids that end a sequence (kept in its output); by default
            (FROM_CONFIG) the `generation_config`'s eos_token_id (none without
            one); None or (): none.
          progress: show the compile status and, without `on_token` (whose
            caller shows its own progress), a decode progress bar on stderr
            (None: only on a terminal).
          on_token: called as ``on_token(step, tokens)`` after the prefill and
            after each decode block that completes new tokens of every row:
            `tokens` is a NumPy int32[n, batch] array whose row i holds new
            token number ``step + i`` of each sequence (0: the first
            generated token); after a sequence's stop token its entries are
            the pad token. Consecutive calls continue where the previous one
            ended; together they cover the longest output. It runs on the
            host between blocks, so every block waits for it.

        Returns:
          GenerationOutput.

        The attention layers' KV caches hold about len(longest prompt) +
        max_new_tokens positions for every sequence (rounded up to a shape
        bucket): their memory grows with both. The cache's size is computed
        from shapes before anything is allocated.

        Raises:
          GenerationError: prompts that are not a list of non-empty id
            sequences, an id outside the vocabulary, max_new_tokens < 0 or
            more positions than int32 holds, a `sampling` that is not a
            SamplingParams, an `on_token` that is not callable, with the
            "oracle" method a reference row outside the vocabulary or not
            one per prompt, an abstract model or draft model (each before
            anything compiles).
          InsufficientMemoryError (a GenerationError and a MemoryError): a
            decode cache that does not fit the free memory (`free_memory`);
            the message gives the batch and max_new_tokens that would fit.
            Also, after compiling and before running, a prefill or decode
            block whose temporaries do not fit beside the cache.
        """
        prompts, lengths, max_new_tokens = self._check_request(prompts, max_new_tokens)
        sampling = self._sampling(sampling)
        seed = _check_int("seed", seed, 0, 2**32 - 1)
        stop_ids = self._stop_ids(stop_tokens)
        if on_token is not None and not callable(on_token):
            raise GenerationError(f"`on_token` must be callable or None; got {type(on_token).__name__}")
        if self.speculative is not None and self.speculative.method == "oracle":
            self._oracle_reference(len(prompts))  # before anything compiles
        if max_new_tokens == 0:
            return GenerationOutput([p.tolist() for p in prompts], [0] * len(prompts), 0.0, 0.0, 0.0, 0,
                                    prompt_lengths=lengths.tolist(),
                                    decode_tokens=None if self.speculative is None else 0)
        self._check_concrete()
        plan = _plan(lengths, max_new_tokens, self.block_size, self.dp)
        inputs = self._inputs(plan, prompts, lengths, stop_ids)
        key = jax.random.key(seed)
        start, compile_s = self._compiled_start(plan, sampling, inputs, key, lengths, progress)
        if self.speculative is not None:
            return self._generate_speculative(plan, prompts, lengths, max_new_tokens, sampling, inputs, key, start,
                                              compile_s, progress, on_token)
        carry_info = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), start.out_info)
        blocks = {}
        for n in plan.block_sizes:
            block_key = ("block", n, sampling, plan.rows, plan.width, plan.max_len)
            make = lambda n=n: self._block_fn(n, sampling).trace(  # noqa: E731
                self.params, carry_info, inputs[0], inputs[1], inputs[3])
            blocks[n], seconds = self._compile(block_key, make, f"decode block ({n} steps)", progress)
            compile_s += seconds
        estimate = self._estimates[_estimate_key(plan, sampling)]
        temps = {n: _temp_bytes(block) for n, block in blocks.items()}  # none: one new token, the prefill's
        if temps:
            n = max(temps, key=temps.get)
            self._check_fits(estimate, plan, lengths, temps[n], f"the decode block of {n} steps")

        t0 = time.perf_counter()
        carry = start(self.params, *inputs, key)
        first = np.asarray(carry.token)
        prefill_s = time.perf_counter() - t0

        stream = _Stream(lengths, plan.prefix_len, max_new_tokens, stop_ids, self._pad_id, on_token)
        stream.add(first[None])
        sync = on_token is not None or stop_ids.size > 0
        pending, steps, t0 = [], 0, time.perf_counter()
        with _progress(plan.steps, False if on_token is not None else progress) as bar:
            for n in plan.blocks():
                carry, tokens = blocks[n](self.params, carry, inputs[0], inputs[1], inputs[3])
                steps += n
                bar.update(n)
                if not sync:
                    pending.append(tokens)
                    continue
                stream.add(np.asarray(tokens))
                if stream.complete or bool(np.all(np.asarray(carry.done)[: plan.batch])):
                    break
            for tokens in pending:
                stream.add(np.asarray(tokens))
        decode_s = time.perf_counter() - t0
        sequences, counts = stream.finish(prompts)
        return GenerationOutput(sequences, counts, prefill_s, decode_s, compile_s, steps, _nbytes(carry.cache),
                                prompt_lengths=lengths.tolist(), cache_rows=plan.rows,
                                lockstep=self.lockstep_cycle(carry_info.cache) is not None)


class _Stream:
    """The host's record of the chosen tokens: by position from `prefix_len` on, per row.

    Hands aligned new tokens to `on_token` and builds the sequences at the end.
    """

    def __init__(self, lengths, prefix_len, max_new_tokens, stop_ids, pad_id, on_token):
        self.offsets = lengths - prefix_len  # row r's new token j is at stream position offsets[r] + j
        self.max_new, self.stops, self.pad, self.on_token = max_new_tokens, set(stop_ids.tolist()), pad_id, on_token
        self.chunks, self.known, self.emitted = [], 0, 0

    def add(self, tokens: np.ndarray):
        """tokens i32[n, rows]: the next n positions."""
        self.chunks.append(tokens[:, : len(self.offsets)])
        self.known += tokens.shape[0]
        ready = min(self.max_new, self.known - int(self.offsets.max()))
        self._emit(ready)

    @property
    def complete(self) -> bool:
        return self.known - int(self.offsets.max()) >= self.max_new

    def _new_tokens(self):
        """Per row, its new tokens known so far (at most max_new), cut after a stop token."""
        tokens = np.concatenate(self.chunks)
        rows = []
        for r, offset in enumerate(self.offsets):
            new = tokens[offset : offset + self.max_new, r].tolist()
            end = next((i + 1 for i, t in enumerate(new) if t in self.stops), len(new))
            rows.append(new[:end])
        return rows

    def _emit(self, upto: int):
        """Hand positions emitted..upto-1 to on_token, none past the longest row once every row has stopped
        (as `_RowStream`: the calls together cover the longest output)."""
        if self.on_token is None or upto <= self.emitted:
            return
        rows = self._new_tokens()
        upto = min(upto, max(len(new) if new and new[-1] in self.stops else upto for new in rows))
        if upto > self.emitted:
            self.emitted = _emit_rows(self.on_token, rows, self.emitted, upto, self.pad)

    def finish(self, prompts):
        rows = self._new_tokens()
        self._emit(max(len(new) for new in rows))
        return [p.tolist() + new for p, new in zip(prompts, rows)], [len(new) for new in rows]


def _emit_rows(on_token, rows: list[list[int]], emitted: int, upto: int, pad: int) -> int:
    """on_token(emitted, tokens i32[upto - emitted, batch]): new tokens emitted..upto-1 of every row
    (`pad` past a row's end); returns upto."""
    block = np.full((upto - emitted, len(rows)), pad, np.int32)
    for r, new in enumerate(rows):
        part = new[emitted:upto]
        block[: len(part), r] = part
    on_token(emitted, block)
    return upto


class _RowStream:
    """The host's record of a speculative run's tokens, read from the loop's history per row.

    Rows advance by different amounts per round; new tokens are handed to
    `on_token` up to the shortest unfinished row's count.
    """

    def __init__(self, lengths, max_new_tokens, stop_ids, pad_id, on_token):
        self.lengths, self.max_new, self.stops, self.pad, self.on_token = lengths, max_new_tokens, stop_ids, pad_id, on_token
        self.rows, self.emitted = [[] for _ in lengths], 0

    def update(self, history: np.ndarray, known: np.ndarray, done: np.ndarray):
        """history i32[rows, max_len], known i32[rows], done bool[rows]: the loop's carry."""
        for r, n in enumerate(self.lengths):
            new = history[r, n : known[r]][: self.max_new].tolist()
            end = next((i + 1 for i, t in enumerate(new) if t in self.stops), len(new))
            self.rows[r] = new[:end]
        open_rows = [len(new) for r, new in enumerate(self.rows) if not done[r]]
        self._emit(min(open_rows) if open_rows else max(len(new) for new in self.rows))

    def _emit(self, upto: int):
        if self.on_token is not None and upto > self.emitted:
            self.emitted = _emit_rows(self.on_token, self.rows, self.emitted, upto, self.pad)

    def finish(self, prompts):
        self._emit(max(len(new) for new in self.rows))
        return [p.tolist() + new for p, new in zip(prompts, self.rows)], [len(new) for new in self.rows]


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


def _on_mesh(model, mesh):
    """`model` as it runs on `mesh` (a `models.sharding.ShardedLM`; `model` itself without a mesh).

    Raises:
      GenerationError: as `Generator` (a mesh without the ("dp", "tp") axes, a config that
        tp does not divide, a ShardedLM on another mesh).
    """
    if mesh is None:
        return model
    from models import sharding

    try:
        sharding.check_mesh(mesh)
        if isinstance(model, sharding.ShardedLM):
            if model.mesh != mesh:
                raise ValueError(f"`model` is sharded over another mesh ({dict(model.mesh.shape)} on "
                                 f"{model.mesh.devices.ravel().tolist()}) than `mesh` ({dict(mesh.shape)} on "
                                 f"{mesh.devices.ravel().tolist()})")
            return model
        return sharding.shard_model(model, mesh)
    except (TypeError, ValueError) as e:
        raise GenerationError(str(e)) from None


def _check_int(name, value, low, high=None) -> int:
    """`value` as a Python int in [low, high]; NumPy integers are accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GenerationError(f"`{name}` must be an int; got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise GenerationError(f"`{name}` must be {bound}; got {value}")
    return int(value)


def generate(model, prompts, max_new_tokens: int, *, state="replay", buffer_len=None, buffer_dtype=None,
             backend=None, route="auto", generation_config=None, sampling=FROM_CONFIG, seed=0, stop_tokens=FROM_CONFIG,
             progress=None, on_token=None, speculative=None, block_size=16, lockstep=None) -> GenerationOutput:
    """One-call generation: `Generator(model, ...).generate(prompts, ...)`; see both."""
    generator = Generator(model, state=state, buffer_len=buffer_len, buffer_dtype=buffer_dtype, backend=backend,
                          route=route, generation_config=generation_config, speculative=speculative,
                          block_size=block_size, lockstep=lockstep)
    return generator.generate(prompts, max_new_tokens, sampling=sampling, seed=seed, stop_tokens=stop_tokens,
                              progress=progress, on_token=on_token)
