"""Next-token choice: greedy, temperature, top-k and top-p (nucleus) sampling.

Two forms: one `SamplingParams` for the whole batch, a static argument of compiled code
(:func:`processed_logits`, :func:`token_log_probs`, :func:`sample_tokens`), and per-row
parameters as arrays, `BatchSampling`, traced (:func:`processed_logits_batch`,
:func:`sample_tokens_batch`): one compiled program serves any mix of greedy and sampled rows, and
a row's result is the one the static form gives it with its own params.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    Attributes:
      temperature: 0 for greedy (argmax); > 0 divides the logits before sampling.
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens whose probability
        reaches top_p (1.0: all). Applied after top_k (Holtzman et al., 2020).

    Raises:
      ValueError: temperature < 0, top_k < 0, top_p outside (0, 1], or a
        top_k / top_p filter with greedy decoding (temperature 0), which
        would have no effect (the command line refuses the same).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731
        if not (real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"`temperature` must be a finite float >= 0; got {self.temperature!r}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"`top_k` must be an int >= 0; got {self.top_k!r}")
        if not (real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"`top_p` must be in (0, 1]; got {self.top_p!r}")
        if self.temperature == 0 and (self.top_k or self.top_p < 1.0):
            raise ValueError(f"`top_k` and `top_p` apply to sampling: give `temperature` > 0 with them; got "
                             f"temperature {self.temperature!r}, top_k {self.top_k!r}, top_p {self.top_p!r}")
        # Plain Python numbers: the params are a static (hashed) argument of compiled code.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, config, *, temperature: float | None = None, top_k: int | None = None,
                               top_p: float | None = None) -> "SamplingParams":
        """The sampling a checkpoint's generation defaults ask for, with explicit values winning.

        As transformers: the checkpoint samples only where ``do_sample`` is
        true, with its ``temperature``, ``top_k`` and ``top_p`` (absent ones:
        transformers' defaults 1.0, 50 and 1.0); otherwise it decodes greedily
        and its sampling values are dropped. An explicit argument replaces
        the checkpoint's value; an explicit temperature > 0 samples even
        where ``do_sample`` is not set (without the checkpoint's filters, which
        belong to its own sampling), and an explicit 0 decodes greedily (the
        checkpoint's top_k / top_p are then dropped; explicit ones raise).

        Args:
          config: a `models.GenerationConfig` (fields None where absent), or None.
          temperature, top_k, top_p: explicit values, or None for the checkpoint's.

        Raises:
          ValueError: as the constructor, for the merged values.
        """
        sample = bool(config is not None and config.do_sample)
        base = dict(temperature=1.0, top_k=50, top_p=1.0) if sample else dict(temperature=0.0, top_k=0, top_p=1.0)
        if sample:
            for name in base:
                if getattr(config, name) is not None:
                    base[name] = getattr(config, name)
        if temperature is not None:
            base["temperature"] = temperature
        if base["temperature"] == 0:
            base.update(top_k=0, top_p=1.0)
        explicit = {name: value for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None}
        return cls(**{**base, **explicit})


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The logits that :func:`sample_tokens` draws from, after temperature,
    top-k and top-p: log-probabilities up to a per-row constant.

    Softmax over the last axis gives the distribution p that plain sampling
    draws from; speculative sampling needs the same p (ARCHITECTURE.md, "Speculative decoding"),
    so both call this function.

    Args:
      logits: f32 | bf16[..., vocab], any leading axes (e.g. [batch, vocab]
        or [batch, W, vocab]).
      params: SamplingParams (static).

    Returns:
      f32[..., vocab]: for greedy params, 0 at the argmax and -inf elsewhere
      (a point mass); otherwise (logits - row max) / temperature with -inf
      at the tokens that top-k and top-p remove. Top-p (Holtzman et al.,
      2020) keeps the most likely tokens while the mass of the more likely
      ones is < top_p, after top-k.
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        best = jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(jnp.arange(logits.shape[-1]) == best, 0.0, -jnp.inf)
    # Shift by the row maximum before dividing, so that a tiny temperature
    # cannot overflow to inf (the largest logit maps to 0).
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        cutoff = _nucleus_cutoff(jnp.sort(logits, axis=-1)[..., ::-1], params.top_p)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def _nucleus_cutoff(ordered: jax.Array, top_p) -> jax.Array:
    """The smallest logit that top-p keeps, [..., 1], from the logits sorted in descending order: the most
    likely tokens are kept while the mass of the more likely ones is < top_p (a float, or f32[..., 1])."""
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    return jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)


def token_log_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """log p, the normalised log-probabilities that :func:`sample_tokens`
    samples from: log_softmax of :func:`processed_logits`.

    Args:
      logits: f32 | bf16[..., vocab].
      params: SamplingParams (static).

    Returns:
      f32[..., vocab]; -inf at the tokens that greedy, top-k or top-p remove.
    """
    return jax.nn.log_softmax(processed_logits(logits, params), axis=-1)


def sample_tokens(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """Choose one token per row.

    Args:
      logits: f32[batch, vocab].
      key: a PRNG key (unused when greedy). Row i samples with
        fold_in(key, i), so a row's draw does not depend on the other rows.
      params: SamplingParams (static).

    Returns:
      i32[batch] token ids: the argmax when greedy, else a draw from
      softmax(processed_logits(logits, params)).
    """
    if params.greedy:
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    logits = processed_logits(logits, params)
    keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@struct.dataclass
class BatchSampling:
    """Per-row SamplingParams of a batch, as arrays (traced under `jax.jit`).

    Attributes:
      temperature: f32[batch], >= 0; 0: the row decodes greedily.
      top_k: i32[batch], >= 0 (0: all tokens).
      top_p: f32[batch] in (0, 1] (1: all tokens).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @property
    def greedy(self) -> jax.Array:
        """bool[batch]: the rows that take the argmax (temperature 0)."""
        return self.temperature == 0

    @classmethod
    def of(cls, params: Sequence[SamplingParams | None]) -> "BatchSampling":
        """The rows' params (None: greedy, as SamplingParams())."""
        rows = [SamplingParams() if p is None else p for p in params]
        for p in rows:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"`params` must hold SamplingParams or None; got {type(p).__name__}")
        # NumPy arrays: a jitted call takes them with its other arguments, no separate transfer each.
        return cls(temperature=np.asarray([p.temperature for p in rows], np.float32),
                   top_k=np.asarray([p.top_k for p in rows], np.int32),
                   top_p=np.asarray([p.top_p for p in rows], np.float32))


def _check_batch_sampling(sampling, batch: int) -> BatchSampling:
    if not isinstance(sampling, BatchSampling):
        raise TypeError(f"`sampling` must be a BatchSampling; got {type(sampling).__name__}")
    for name in ("temperature", "top_k", "top_p"):
        shape = tuple(jnp.shape(getattr(sampling, name)))
        if shape != (batch,):
            raise ValueError(f"`sampling.{name}` must have shape [batch] = {(batch,)}; got {shape}")
    return sampling


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """x [batch] as [batch, 1, ..., 1] (`ndim` axes), to broadcast over a row's other axes."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`logits` f32[batch, ..., vocab] with -inf at the tokens that each row's top_k i32 and then top_p f32
    ([batch, 1, ..., 1]) remove; top_k 0 or >= vocab and top_p 1 remove none (as :func:`processed_logits`)."""
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    index = jnp.broadcast_to(jnp.clip(top_k - 1, 0, vocab - 1), ordered.shape[:-1] + (1,))
    kth = jnp.where((top_k > 0) & (top_k < vocab), jnp.take_along_axis(ordered, index, axis=-1), -jnp.inf)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    cutoff = jnp.where(top_p < 1.0, _nucleus_cutoff(ordered, top_p), -jnp.inf)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def processed_logits_batch(logits: jax.Array, sampling: BatchSampling) -> jax.Array:
    """:func:`processed_logits` with each row's own params.

    Args:
      logits: f32 | bf16[batch, ..., vocab] (e.g. [batch, vocab] or [batch, W, vocab]).
      sampling: BatchSampling of `batch` rows.

    Returns:
      f32[batch, ..., vocab]: row b is processed_logits(logits[b], params of row b). The
      top-k / top-p sort runs only when some row filters.

    Raises:
      TypeError: `sampling` not a BatchSampling. ValueError: its arrays not [batch].
    """
    logits = logits.astype(jnp.float32)
    sampling = _check_batch_sampling(sampling, logits.shape[0])
    greedy = _per_row(sampling.greedy, logits.ndim)
    temperature = jnp.where(greedy, 1.0, _per_row(sampling.temperature, logits.ndim))
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    top_k, top_p = _per_row(sampling.top_k, logits.ndim), _per_row(sampling.top_p, logits.ndim)
    filters = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0))
    scaled = jax.lax.cond(filters, _filter_top_k_top_p, lambda x, k, p: x, scaled, top_k, top_p)
    point = jnp.where(jnp.arange(logits.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None], 0.0, -jnp.inf)
    return jnp.where(greedy, point, scaled)


def _check_row_keys(keys, batch: int) -> jax.Array:
    """Per-row PRNG keys: typed keys [batch] or raw u32[batch, 2]; TypeError otherwise."""
    if isinstance(keys, jax.Array):
        if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) and keys.shape == (batch,):
            return keys
        if keys.dtype == jnp.uint32 and keys.shape == (batch, 2):
            return keys
    raise TypeError(f"`keys` must be one PRNG key per row: typed keys of shape {(batch,)} or u32 of shape "
                    f"{(batch, 2)}; got {getattr(keys, 'dtype', type(keys).__name__)} with shape "
                    f"{getattr(keys, 'shape', None)}")


def sample_tokens_batch(logits: jax.Array, keys: jax.Array, sampling: BatchSampling) -> jax.Array:
    """Choose one token per row with the row's own params and key.

    Args:
      logits: f32 | bf16[batch, vocab].
      keys: PRNG keys [batch] (typed) or u32[batch, 2]: row b draws with keys[b] only,
        so its token does not depend on the other rows (unused by greedy rows).
      sampling: BatchSampling of `batch` rows.

    Returns:
      i32[batch]: the argmax for a greedy row, else a draw from
      softmax(processed_logits_batch(logits, sampling)[b]) with keys[b] (the token
      `sample_tokens(logits[b:b + 1], k, params)` gives where fold_in(k, 0) = keys[b]).
      A batch without a sampled row computes the argmax only.

    Raises:
      TypeError: bad `keys` or `sampling`. ValueError: `sampling`'s arrays not [batch].
    """
    sampling = _check_batch_sampling(sampling, logits.shape[0])
    keys = _check_row_keys(keys, logits.shape[0])
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)

    def draw():
        drawn = jax.vmap(jax.random.categorical)(keys, processed_logits_batch(logits, sampling)).astype(jnp.int32)
        return jnp.where(sampling.greedy, greedy, drawn)

    return jax.lax.cond(jnp.all(sampling.greedy), lambda: greedy, draw)
