"""Acceptance rules of speculative decoding: which drafts a round keeps.

A round (ARCHITECTURE.md, "The verify window" and "Speculative decoding"): the drafter proposes K tokens per row;
the target verifies W = K + 1 positions in one call, the last accepted token
followed by the K drafts, and returns logits [batch, W, vocab]. Position i
holds the target's next-token logits after draft i - 1 (position 0: after
the last accepted token), so draft i is judged by position i and position K
gives the bonus token after all drafts. A rule keeps the first a drafts (the
longest prefix it accepts) and one more token from the target: m = a + 1 in
1..W new tokens per row; every layer then commits m.

- :func:`greedy_acceptance`: a draft is acceptable if it is the target's
  argmax; the extra token is the argmax at the first mismatch. The output is
  plain greedy decoding's, token for token.
- :func:`sampling_acceptance`: speculative sampling (Leviathan et al., 2023,
  "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
  Chen et al., 2023, "Accelerating Large Language Model Decoding with
  Speculative Sampling"): each emitted token has exactly the target's
  distribution p (after temperature, top-k and top-p, as plain sampling).
- :func:`accept_drafts`: the rule that `SamplingParams` calls for.
- :func:`accept_drafts_batch`: each row's rule from its own params
  (`BatchSampling`, traced) and its own key: one compiled program for any mix
  of greedy and sampled rows.

Rows with fewer drafts are padded: drafts[b, j] for j >= num_drafts[b] are
always rejected and do not change the distribution of what is emitted, so a
row with num_drafts = 0 decodes one token exactly as plain decoding does
(in distribution; greedy: the same token). Everything runs under `jax.jit`
with fixed shapes and no host round trip. Arguments are checked before any
computation, shapes and dtypes always, num_drafts' values when concrete.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import struct

from replayssm_jax.ops import validate as v
from replayssm_jax.sampling import (BatchSampling, SamplingParams, _check_batch_sampling, _check_row_keys,
                                    processed_logits_batch, token_log_probs)
from replayssm_jax.speculative import _checks
from replayssm_jax.speculative.drafters import Drafts


@struct.dataclass
class Accepted:
    """The outcome of one round of acceptance.

    Attributes:
      tokens: i32[batch, W], the new tokens of each row: its accepted drafts,
        then the token from the target, then `fill_id` up to W.
      num_accepted: i32[batch] in 1..W, m = accepted drafts + 1, the number of
        valid entries of `tokens` and how far every layer commits.
    """

    tokens: jax.Array
    num_accepted: jax.Array


def _check_round(logits, drafts, num_drafts, q_probs=None):
    """(logits f32[batch, W, vocab], drafts i32[batch, K], num_drafts i32[batch],
    q_probs f32[batch, K, vocab] | None), checked against each other."""
    logits = v.check_float("logits", logits)
    v.check_rank("logits", logits, "batch, W, vocab")
    batch, window, vocab = logits.shape
    if window < 2:
        raise ValueError(
            f"`logits` must have W = K + 1 >= 2 positions (K >= 1 drafts) [batch, W, vocab]; "
            f"got shape {tuple(logits.shape)}"
        )
    k = window - 1
    drafts = _checks.int_array("drafts", drafts, "batch, K")
    if tuple(drafts.shape) != (batch, k):
        raise ValueError(
            f"`drafts` must have shape [batch, K] = {(batch, k)} to match `logits` [batch, W = K + 1, vocab] = "
            f"{tuple(logits.shape)}; got {tuple(drafts.shape)}"
        )
    num_drafts = v.check_int_range("num_drafts", num_drafts, "batch", (batch,), 0, k)
    q_probs = v.optional_float_arg("q_probs", q_probs, "batch, K, vocab", (batch, k, vocab))
    return logits.astype(jnp.float32), drafts, num_drafts, q_probs


def _check_fill_id(fill_id) -> int:
    if isinstance(fill_id, bool) or not isinstance(fill_id, numbers.Integral):
        raise TypeError(f"`fill_id` must be an int; got {type(fill_id).__name__} {fill_id!r}")
    return int(fill_id)


def _emit(drafts: jax.Array, accepted: jax.Array, token: jax.Array, fill_id: int) -> Accepted:
    """The new tokens [batch, W]: drafts[:, :accepted], then `token`, then fill_id."""
    position = jnp.arange(drafts.shape[1] + 1)[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=fill_id)
    tokens = jnp.where(position < accepted[:, None], padded,
                       jnp.where(position == accepted[:, None], token[:, None], fill_id))
    return Accepted(tokens=tokens.astype(jnp.int32), num_accepted=(accepted + 1).astype(jnp.int32))


def _at(x: jax.Array, position: jax.Array) -> jax.Array:
    """x[b, position[b]] for x [batch, n, ...] and position i32[batch]."""
    index = position.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


def greedy_acceptance(logits, drafts, num_drafts, *, fill_id: int = 0) -> Accepted:
    """Greedy acceptance: keep the drafts that equal the target's argmax.

    The accepted count a is the length of the longest prefix of the real
    drafts with drafts[b, i] == argmax(logits[b, i]); the extra token is
    argmax(logits[b, a]) (the correction at the first mismatch, or the bonus
    after the last real draft). Speculative greedy decoding therefore emits
    plain greedy decoding's tokens (argmax as in
    :func:`replayssm_jax.sampling.sample_tokens`, ties to the lowest id).

    Args:
      logits: f32 | bf16[batch, W, vocab], the target's logits at the W = K + 1
        verified positions.
      drafts: integer[batch, K], the drafted token ids.
      num_drafts: integer[batch], 0..K, the real drafts per row; later
        positions are padding and never accepted.
      fill_id: the id written after the new tokens (static).

    Returns:
      Accepted(tokens i32[batch, W], num_accepted i32[batch] in 1..W).

    Raises:
      TypeError: a non-float `logits`, non-integer `drafts` or `num_drafts`,
        a non-int `fill_id`.
      ValueError: `logits` not [batch, W, vocab] with W >= 2, `drafts` not
        [batch, W - 1], `num_drafts` not [batch] or (concrete) outside [0, K].
    """
    logits, drafts, num_drafts, _ = _check_round(logits, drafts, num_drafts)
    fill_id = _check_fill_id(fill_id)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch, W]
    real = jnp.arange(drafts.shape[1])[None, :] < num_drafts[:, None]
    accepted = _checks.prefix_length(real & (drafts == target[:, :-1]))
    return _emit(drafts, accepted, _at(target, accepted), fill_id)


def _residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
    """max(p - q, 0), the unnormalised distribution to sample after a rejection
    (Leviathan et al., 2023, Algorithm 1)."""
    return jnp.maximum(p - q, 0.0)


def sampling_acceptance(logits, drafts, num_drafts, key, params: SamplingParams, q_probs=None, *,
                        fill_id: int = 0) -> Accepted:
    """Speculative sampling: emits tokens with exactly the target's distribution.

    With p_i the target's distribution at position i (softmax of
    :func:`replayssm_jax.sampling.processed_logits`: the same temperature,
    top-k and top-p as plain sampling) and q_i the drafter's, draft x_i is
    accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
    first rejection at position a; the extra token is then drawn from
    normalize(max(p_a - q_a, 0)). If every real draft is accepted (a =
    num_drafts), the bonus token is drawn from p_a. Each emitted token then
    has the target's distribution given the tokens before it (Leviathan et
    al., 2023, Theorem 3.5; Chen et al., 2023, Theorem 1).

    A deterministic drafter (n-gram, greedy draft model) has q_i = the point
    mass at x_i: accept with probability p_i(x_i), else draw from p_i with
    x_i removed. Edge cases: q_i(x_i) = 0 < p_i(x_i) accepts (the test is
    u * q < p, no division, no NaN); a draft id outside [0, vocab) is
    rejected; a residual with no mass (p = q) falls back to p_a; padded
    positions are never accepted and their q is never read.

    Randomness: row b uses only fold_in(key, b), so rows are independent and
    a row's tokens do not depend on the batch.

    Args:
      logits: f32 | bf16[batch, W, vocab], the target's logits at W = K + 1
        positions.
      drafts: integer[batch, K], drafted ids; drafts[b, i] was drawn from
        q_probs[b, i].
      num_drafts: integer[batch], 0..K real drafts per row.
      key: a PRNG key.
      params: SamplingParams (static) with temperature > 0; greedy params
        take :func:`greedy_acceptance` (see :func:`accept_drafts`).
      q_probs: f32[batch, K, vocab], the drafter's probabilities (rows sum to
        1), or None for a deterministic drafter.
      fill_id: the id written after the new tokens (static).

    Returns:
      Accepted(tokens i32[batch, W], num_accepted i32[batch] in 1..W).

    Raises:
      TypeError: `params` not a SamplingParams, bad dtypes, a bad key.
      ValueError: greedy `params`; shapes as in :func:`greedy_acceptance`;
        `q_probs` not [batch, K, vocab].
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"`params` must be a SamplingParams; got {type(params).__name__}")
    if params.greedy:
        raise ValueError("`params` must have temperature > 0 for sampling_acceptance; "
                         "greedy params (temperature 0) take greedy_acceptance")
    logits, drafts, num_drafts, q_probs = _check_round(logits, drafts, num_drafts, q_probs)
    key = _checks.check_key(key)
    fill_id = _check_fill_id(fill_id)
    accept_key, token_key = _checks.row_keys(key, logits.shape[0], 2)
    return _sampling_rule(token_log_probs(logits, params), drafts, num_drafts, accept_key, token_key, q_probs,
                          fill_id)


def _sampling_rule(log_p, drafts, num_drafts, accept_key, token_key, q_probs, fill_id: int) -> Accepted:
    """Speculative sampling's rule (:func:`sampling_acceptance`) from the target's log p f32[batch, W, vocab]
    (-inf where removed), drafts i32[batch, K], num_drafts i32[batch], row b drawing with accept_key[b] and
    token_key[b] only; q_probs f32[batch, K, vocab] or None (a deterministic drafter)."""
    batch, window, vocab = log_p.shape
    k = window - 1
    p = jnp.exp(log_p)
    in_vocab = (drafts >= 0) & (drafts < vocab)
    index = jnp.clip(drafts, 0, vocab - 1)[..., None]
    p_draft = jnp.take_along_axis(p[:, :k], index, axis=-1)[..., 0]  # [batch, K]
    q_draft = 1.0 if q_probs is None else jnp.take_along_axis(q_probs.astype(jnp.float32), index, axis=-1)[..., 0]

    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(accept_key)  # in [0, 1)
    real = jnp.arange(k)[None, :] < num_drafts[:, None]
    accepted = _checks.prefix_length(real & in_vocab & (u * q_draft < p_draft))

    # Position `accepted` draws the extra token: from the residual after a
    # rejected real draft, from p after the last real draft.
    p_at = _at(p, accepted)
    rejected_at = jnp.minimum(accepted, k - 1)
    if q_probs is None:
        q_at = jax.nn.one_hot(_at(drafts, rejected_at), vocab, dtype=jnp.float32)  # 0 for an id outside the vocab
    else:
        q_at = _at(q_probs.astype(jnp.float32), rejected_at)
    residual = _residual_probs(p_at, q_at)
    use_residual = (accepted < num_drafts) & (jnp.sum(residual, axis=-1) > 0)
    token_logits = jnp.where(use_residual[:, None], jnp.log(residual), _at(log_p, accepted))
    token = jax.vmap(jax.random.categorical)(token_key, token_logits).astype(jnp.int32)
    return _emit(drafts, accepted, token, fill_id)


def accept_drafts(logits, drafts: Drafts, key, params: SamplingParams, *, fill_id: int = 0) -> Accepted:
    """Accept a drafter's proposals by the rule `params` calls for.

    Greedy params (temperature 0): :func:`greedy_acceptance` (q is not
    used). Otherwise :func:`sampling_acceptance` with q = drafts.q_probs
    (None: a deterministic drafter).

    Args:
      logits: f32 | bf16[batch, W, vocab], the target's logits at W = K + 1
        positions.
      drafts: Drafts(tokens [batch, K], num_drafts [batch], q_probs).
      key: a PRNG key (unused when greedy).
      params: SamplingParams (static).
      fill_id: the id written after the new tokens (static).

    Returns:
      Accepted(tokens i32[batch, W], num_accepted i32[batch] in 1..W).

    Raises:
      TypeError: `drafts` not a Drafts or `params` not a SamplingParams;
        otherwise as the rule called.
      ValueError: as the rule called.
    """
    if not isinstance(drafts, Drafts):
        raise TypeError(f"`drafts` must be a Drafts; got {type(drafts).__name__}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"`params` must be a SamplingParams; got {type(params).__name__}")
    if params.greedy:
        return greedy_acceptance(logits, drafts.tokens, drafts.num_drafts, fill_id=fill_id)
    return sampling_acceptance(logits, drafts.tokens, drafts.num_drafts, key, params, drafts.q_probs,
                               fill_id=fill_id)


def accept_drafts_batch(logits, drafts: Drafts, keys, sampling: BatchSampling, *, fill_id: int = 0) -> Accepted:
    """Accept a drafter's proposals, each row by the rule its own params call for.

    Row b: :func:`greedy_acceptance` where sampling.greedy[b], else
    speculative sampling (:func:`sampling_acceptance`'s rule) from
    softmax(processed_logits_batch(logits, sampling)[b]), drawing with keys[b]
    only (split in two: the acceptance tests, the extra token), so a row's
    tokens depend only on its logits, drafts, params and key. A batch without
    a sampled row runs the greedy rule only.

    Args:
      logits: f32 | bf16[batch, W, vocab], the target's logits at W = K + 1
        positions.
      drafts: Drafts(tokens [batch, K], num_drafts [batch], q_probs).
      keys: PRNG keys [batch] (typed) or u32[batch, 2], one per row.
      sampling: BatchSampling of `batch` rows (traced).
      fill_id: the id written after the new tokens (static).

    Returns:
      Accepted(tokens i32[batch, W], num_accepted i32[batch] in 1..W).

    Raises:
      TypeError: `drafts` not a Drafts, `sampling` not a BatchSampling, bad
        `keys`; dtypes as in :func:`sampling_acceptance`.
      ValueError: shapes as in :func:`sampling_acceptance`; `sampling`'s
        arrays not [batch].
    """
    if not isinstance(drafts, Drafts):
        raise TypeError(f"`drafts` must be a Drafts; got {type(drafts).__name__}")
    logits, tokens, num_drafts, q_probs = _check_round(logits, drafts.tokens, drafts.num_drafts, drafts.q_probs)
    sampling = _check_batch_sampling(sampling, logits.shape[0])
    keys = _check_row_keys(keys, logits.shape[0])
    fill_id = _check_fill_id(fill_id)
    greedy = greedy_acceptance(logits, tokens, num_drafts, fill_id=fill_id)

    def sample():
        accept_key, token_key = jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, 2))(keys), 0, 1)
        log_p = jax.nn.log_softmax(processed_logits_batch(logits, sampling), axis=-1)
        drawn = _sampling_rule(log_p, tokens, num_drafts, accept_key, token_key, q_probs, fill_id)
        rows = sampling.greedy
        return Accepted(tokens=jnp.where(rows[:, None], greedy.tokens, drawn.tokens),
                        num_accepted=jnp.where(rows, greedy.num_accepted, drawn.num_accepted))

    return jax.lax.cond(jnp.all(sampling.greedy), lambda: greedy, sample)
