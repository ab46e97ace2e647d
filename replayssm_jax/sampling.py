"""Next-token choice: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


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
    draws from; speculative sampling needs the same p (DESIGN.md section 7),
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
        ordered = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        kept = jnp.where(before < params.top_p, ordered, jnp.inf)
        cutoff = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


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
