"""Drafters for speculative decoding: what proposes the K tokens of a round.

A round (ARCHITECTURE.md, "Speculative decoding"): the drafter proposes up to K tokens per row;
the target verifies W = K + 1 positions in one call; the acceptance rules of
:mod:`replayssm_jax.speculative.acceptance` keep a prefix of the drafts plus
one token from the target. Shapes are fixed every round: a row with fewer
than K drafts pads its tokens (with 0) and says how many are real in
`num_drafts`; a padded position is always rejected.

**The loop's interface** (:class:`Drafter`): a drafter may carry a state
through the rounds (a draft head's or a draft model's cache), kept in the
loop's carry and updated in place. `init_state` builds it from the prefill
(:class:`DraftStart`), `draft` proposes at the start of a round, `update`
sees what the round kept (:class:`Kept`: the accepted tokens, the per-row
count, the target's verified hidden states, the history). A drafter that
reads only the token history is stateless: it defines `propose(history,
lengths, key) -> Drafts` and takes the rest from :class:`StatelessDrafter`
(its state is None).

The stateless drafters here have no weights; they read the token history
that the generation loop keeps, `history` i32[batch, max_len] with `lengths`
i32[batch]: row b's tokens so far (prompt and generated) are
history[b, :lengths[b]]; the entries at and after lengths[b] are ignored.

- :class:`NgramDrafter`: prompt-lookup decoding (transformers'
  `prompt_lookup_num_tokens`, vLLM's n-gram proposer): continue the row as it
  continued after the latest earlier occurrence of its last n tokens.
- :class:`OracleDrafter`: for benchmarks and tests, proposes a known
  reference continuation, each token right with probability `alpha`.

Drafters with weights: `models.mtp.MTPDrafter` (the checkpoint's
multi-token prediction head) and
:class:`replayssm_jax.speculative.draft_model.DraftModelDrafter` (a separate
small model of the same vocabulary).

All are pytrees (they can be arguments of a jitted function) whose
configuration is static, and their methods run under `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from replayssm_jax.ops import validate as v
from replayssm_jax.sampling import SamplingParams, token_log_probs
from replayssm_jax.speculative import _checks


@struct.dataclass
class Drafts:
    """The tokens a drafter proposes for one round.

    Attributes:
      tokens: i32[batch, K], the drafts; positions >= num_drafts are padding
        (any id; the acceptance rules reject them).
      num_drafts: i32[batch], 0..K, how many drafts of each row are real.
      q_probs: f32[batch, K, vocab] or None. The drafter's distribution at
        each position, from which tokens[:, j] was drawn (Leviathan et al.,
        2023, "q"); None for a deterministic drafter (q is then the point mass
        at the draft).
      scores: f32[batch, K, vocab] or None: the drafter's ranking of the
        tokens at each draft position (higher is better; -inf: not a
        candidate), from which a draft tree takes its other candidates
        (`replayssm_jax.speculative.tree_drafters`); None where the drafter
        gives none.
      candidates: i32[batch, K, C] or None: other candidates per draft
        position, best first (-1: none), for a draft tree in place of
        `scores` (the oracle drafter's, without a [batch, K, vocab] array).
    """

    tokens: jax.Array
    num_drafts: jax.Array
    q_probs: jax.Array | None = None
    scores: jax.Array | None = None
    candidates: jax.Array | None = None

    @property
    def num_speculative_tokens(self) -> int:
        """K, the number of draft positions (static)."""
        return self.tokens.shape[-1]


@struct.dataclass
class DraftStart:
    """What a drafter's state is built from: the prefill before the first round.

    Attributes:
      history: i32[rows, max_len], per row the prompt, with history[:, P] the
        first token after the prefill (the target's choice, or the prompt's
        own token where the prompt goes on); the target's cache has consumed
        history[:, :P].
      prefix_len: P >= 1 (static), the prefill length.
      hidden: [rows, P, hidden]: the target's hidden states after its final
        norm at positions 0..P-1 (`HybridCausalLM.prefill(return_hidden=True)`);
        None unless the drafter's `needs_hidden`.
      key: the PRNG key of the drafts the state starts with.
    """

    history: jax.Array
    hidden: jax.Array | None
    key: jax.Array
    prefix_len: int = struct.field(pytree_node=False)


@struct.dataclass
class Kept:
    """What a speculative round kept, for `Drafter.update` (after the target's commit).

    With pos the target's position before the round:

    Attributes:
      tokens: i32[rows, W], the tokens at positions pos + 1 .. pos + W; the
        first `num_kept` of each row are kept (the accepted drafts, then the
        target's own token), the rest are padding.
      num_kept: i32[rows], m in 0..W, the positions the target committed
        (its tokens at pos .. pos + m - 1); 0 for a done row.
      hidden: [rows, W, hidden]: the target's hidden states after its final
        norm at positions pos .. pos + W - 1 (`HybridCausalLM.verify(...,
        return_hidden=True)`); None unless the drafter's `needs_hidden`.
      history: i32[rows, max_len], the token history after the round.
      position: i32[rows], the target's position after the commit, pos + m.
      key: a PRNG key for the round's update.
    """

    tokens: jax.Array
    num_kept: jax.Array
    hidden: jax.Array | None
    history: jax.Array
    position: jax.Array
    key: jax.Array


class Drafter(Protocol):
    """What the speculative loop needs of a drafter.

    Attributes:
      num_speculative_tokens: K >= 1 (static), draft positions per round.
      needs_hidden: (static) whether `init_state` and `update` read the
        target's hidden states (the loop then asks the prefill and `verify`
        for them).

    Methods (each runs under `jax.jit` with fixed shapes; `target` is the
    target model, merged inside the trace):

    - ``init_state(target, start: DraftStart) -> state``: the state before
      the first round (a pytree of fixed shapes, or None).
    - ``draft(target, state, history, lengths, key) -> (Drafts, state)``:
      the K drafts of a round from the state and the history i32[rows,
      max_len] of which lengths i32[rows] tokens are known (the last one
      is the token the target verifies first).
    - ``update(target, state, kept: Kept) -> state``: the state after the
      round's commit.

    A stateless drafter defines ``propose(history, lengths, key) -> Drafts``
    and inherits the three from :class:`StatelessDrafter`.
    """

    num_speculative_tokens: int
    needs_hidden: bool

    def init_state(self, target, start: DraftStart) -> Any: ...

    def draft(self, target, state, history: jax.Array, lengths: jax.Array, key: jax.Array) -> tuple[Drafts, Any]: ...

    def update(self, target, state, kept: Kept) -> Any: ...


class StatelessDrafter:
    """The loop's interface (:class:`Drafter`) for a drafter that reads only the
    token history: its state is None, `draft` calls its
    ``propose(history, lengths, key)``, `update` does nothing."""

    needs_hidden = False

    def init_state(self, target, start: DraftStart) -> None:
        """No state (None)."""
        return None

    def draft(self, target, state, history, lengths, key) -> tuple[Drafts, None]:
        """(self.propose(history, lengths, key), None)."""
        return self.propose(history, lengths, key), state

    def update(self, target, state, kept: Kept) -> None:
        """No state (None)."""
        return state


def choose_drafts(logits: jax.Array, sampling: SamplingParams, keys: jax.Array | None):
    """A drafter's token per row from its logits: (draft i32[batch], q f32[batch, vocab] or None).

    Greedy `sampling` (temperature 0): the argmax, q None (a point mass).
    Else a draw from softmax(processed logits) (temperature, top-k, top-p as
    `replayssm_jax.sampling.token_log_probs`), and q that distribution
    (speculative sampling's q; Leviathan et al., 2023).

    Args:
      logits: f32[batch, vocab].
      sampling: SamplingParams.
      keys: one PRNG key per row [batch] (`_checks.row_keys`); None when greedy.
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    log_q = token_log_probs(logits, sampling)
    return jax.vmap(jax.random.categorical)(keys, log_q).astype(jnp.int32), jnp.exp(log_q)


def check_history(history, lengths) -> tuple[jax.Array, jax.Array]:
    """The token history of every row, checked.

    Args:
      history: integer[batch, max_len], row b's tokens in history[b, :lengths[b]].
      lengths: integer[batch], 0..max_len (values checked when concrete).

    Returns:
      (history i32[batch, max_len], lengths i32[batch]).

    Raises:
      TypeError: a non-integer dtype or a non-array.
      ValueError: history not of rank 2 (or with an empty axis), lengths not
        of shape [batch], or a concrete length outside [0, max_len].
    """
    history = _checks.int_array("history", history, "batch, max_len")
    batch, max_len = history.shape
    lengths = v.check_int_range("lengths", lengths, "batch", (batch,), 0, max_len)
    return history, lengths


@dataclasses.dataclass(frozen=True)
class NgramDrafter(StatelessDrafter):
    """Prompt-lookup (n-gram) drafter.

    For each row, with n = max_ngram down to min_ngram: find the most recent
    earlier occurrence of the row's last n tokens in its history and propose
    the up to K tokens that followed it (stopping at the end of the history:
    fewer than K when the occurrence is near the end). The first n that has
    an occurrence wins; a row with none (or with fewer than min_ngram tokens)
    proposes 0 drafts. This is prompt-lookup decoding (Saxena, 2023;
    transformers' `prompt_lookup_num_tokens`, vLLM's n-gram speculator),
    taking the latest occurrence.

    One vectorised compare of every position with the last max_ngram tokens,
    O(batch x max_len x max_ngram), no loop over positions.

    With `vocab_size` given, the Drafts also carry scores (a draft tree's
    other candidates, `replayssm_jax.speculative.tree_drafters`): at draft
    position d, the number of earlier occurrences of the matched n-gram
    (every one, not only the latest) that the token followed at offset d,
    -inf for a token that followed none: the several continuations of the
    history as branches.

    Attributes:
      num_speculative_tokens: K >= 1, drafts per round.
      max_ngram: the longest n-gram matched, >= min_ngram.
      min_ngram: the shortest n-gram matched, >= 1.
      vocab_size: None (no scores), or the vocabulary size of the scores.

    Raises:
      TypeError: a count that is not an int.
      ValueError: K < 1, min_ngram < 1 or max_ngram < min_ngram, vocab_size < 1.
    """

    num_speculative_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    vocab_size: int | None = None

    def __post_init__(self):
        v.check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        v.check_positive_int("min_ngram", self.min_ngram)
        v.check_positive_int("max_ngram", self.max_ngram)
        if self.vocab_size is not None:
            v.check_positive_int("vocab_size", self.vocab_size)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"`max_ngram` must be >= `min_ngram` = {self.min_ngram}; got {self.max_ngram}")

    def propose(self, history, lengths, key=None) -> Drafts:
        """Drafts from the rows' own histories.

        Args:
          history: integer[batch, max_len]; lengths: integer[batch] (see
            :func:`check_history`).
          key: unused (the drafter is deterministic); accepted so that all
            drafters share one call.

        Returns:
          Drafts with tokens i32[batch, K] (0 at padded positions),
          num_drafts i32[batch] and q_probs None.

        Raises:
          TypeError, ValueError: as :func:`check_history`.
        """
        history, lengths = check_history(history, lengths)
        return _ngram_propose(history, lengths, self.num_speculative_tokens, self.max_ngram, self.min_ngram,
                              self.vocab_size)


jax.tree_util.register_dataclass(
    NgramDrafter, data_fields=[], meta_fields=["num_speculative_tokens", "max_ngram", "min_ngram", "vocab_size"]
)


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, ...]] for x [batch, n] and index [batch, ...], index clipped to [0, n)."""
    flat = jnp.clip(index, 0, x.shape[1] - 1).reshape(index.shape[0], -1)
    return jnp.take_along_axis(x, flat, axis=1).reshape(index.shape)


def _ngram_propose(history, lengths, num_speculative_tokens, max_ngram, min_ngram, vocab_size=None) -> Drafts:
    max_len = history.shape[1]
    end = jnp.arange(max_len)  # the last position of a candidate earlier occurrence
    back = jnp.arange(max_ngram)  # offsets from the end of an n-gram
    # same[b, e, j]: history[b, e - j] == history[b, lengths[b] - 1 - j], both positions real.
    earlier = end[:, None] - back[None, :]  # [max_len, max_ngram]
    last = lengths[:, None] - 1 - back[None, :]  # [batch, max_ngram]
    same = jnp.take(history, jnp.clip(earlier, 0), axis=1) == gather_rows(history, last)[:, None, :]
    same &= (earlier >= 0)[None] & (last >= 0)[:, None, :]
    # The longest common suffix (capped at max_ngram) of history[:e + 1] and
    # of the row's history, for every e that leaves a next token to propose.
    matched = jnp.where(end[None, :] < lengths[:, None] - 1, _checks.prefix_length(same), 0)
    ngram = jnp.max(matched, axis=1)  # the longest n with an occurrence
    latest = jnp.max(jnp.where(matched >= ngram[:, None], end[None, :], -1), axis=1)
    start = latest + 1  # the first token that followed the occurrence
    found = ngram >= min_ngram
    num_drafts = jnp.where(found, jnp.minimum(num_speculative_tokens, lengths - start), 0).astype(jnp.int32)
    offsets = jnp.arange(num_speculative_tokens)
    tokens = gather_rows(history, start[:, None] + offsets[None, :])
    tokens = jnp.where(offsets[None, :] < num_drafts[:, None], tokens, 0)
    scores = None
    if vocab_size is not None:  # every occurrence's continuation, counted per offset
        follows = end[None, :, None] + 1 + offsets[None, None, :]  # [1, max_len, K]
        counted = found[:, None, None] & (matched >= ngram[:, None])[:, :, None] & (follows < lengths[:, None, None])
        token = gather_rows(history, jnp.broadcast_to(follows, counted.shape))
        rows = jnp.arange(history.shape[0])[:, None, None]
        counts = jnp.zeros((history.shape[0], num_speculative_tokens, vocab_size), jnp.float32)
        counts = counts.at[rows, jnp.broadcast_to(offsets, counted.shape), token].add(counted.astype(jnp.float32),
                                                                                     mode="drop")
        scores = jnp.where(counts > 0, counts, -jnp.inf)
    return Drafts(tokens=tokens, num_drafts=num_drafts, q_probs=None, scores=scores)


@struct.dataclass
class OracleDrafter(StatelessDrafter):
    """A drafter for benchmarks and tests that knows each row's continuation.

    At history length n, draft j (0 <= j < K) is reference[b, n + j] with
    probability alpha and otherwise a different token, uniform over the
    vocab_size - 1 others; the choices are independent per position and row
    (row b draws from fold_in(key, b)) and reproducible from the key. alpha
    = 1 proposes the reference exactly, alpha = 0 never. With a greedy
    target whose greedy output is `reference`, alpha is the per-position
    probability that a draft matches. Draft positions at or past the
    reference's end are padding (fewer than K drafts).

    With `branches` = C > 0 (a draft tree's other candidates,
    `Drafts.candidates`), each position also has C more candidates: where
    the draft is wrong, each of them is in turn the reference's token with
    probability alpha (the first such one is, the others stay wrong), so a
    position holds its reference token among its C + 1 candidates with
    probability 1 - (1 - alpha)^(C + 1). The wrong candidates are distinct.

    Attributes:
      reference: integer[batch, ref_len], row b's full token sequence
        (prompt included), aligned with the history: position t of the
        reference is position t of the history (e.g. the target's own greedy
        output from an earlier run). Checked in :meth:`propose`.
      alpha: float in [0, 1], the probability a draft is right; a pytree leaf
        (traced under jit: one compiled round serves every alpha).
      num_speculative_tokens: K >= 1 (static).
      vocab_size: the vocabulary size >= 2 (static), for the wrong drafts.
      branches: C >= 0 (static), the other candidates per position (0: none).

    Raises:
      TypeError, ValueError: alpha not a real number in [0, 1], K < 1,
        vocab_size < 2, branches < 0 or C + 1 >= vocab_size (at construction).
    """

    reference: jax.Array
    alpha: float
    num_speculative_tokens: int = struct.field(pytree_node=False)
    vocab_size: int = struct.field(pytree_node=False)
    branches: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self):
        alpha = self.alpha
        # A traced or abstract leaf (the pytree rebuilt under jit or eval_shape) was checked at construction.
        concrete = isinstance(alpha, (numbers.Number, str, bytes)) or alpha is None
        if concrete and not (isinstance(alpha, numbers.Real) and not isinstance(alpha, bool) and math.isfinite(alpha)
                             and 0.0 <= alpha <= 1.0):
            raise ValueError(f"`alpha` must be a float in [0, 1]; got {alpha!r}")
        v.check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        v.check_positive_int("vocab_size", self.vocab_size, minimum=2)
        v.check_positive_int("branches", self.branches, minimum=0)
        if self.branches + 1 >= self.vocab_size:
            raise ValueError(f"`branches` + 1 must be < vocab_size = {self.vocab_size}; got {self.branches}")
        if concrete:
            object.__setattr__(self, "alpha", float(alpha))

    def propose(self, history, lengths, key) -> Drafts:
        """Drafts of the reference continuation, each right with probability alpha.

        Args:
          history: integer[batch, max_len] (only its shape is used);
            lengths: integer[batch] (see :func:`check_history`).
          key: a PRNG key.

        Returns:
          Drafts with tokens i32[batch, K] (0 at padded positions), num_drafts
          = min(K, ref_len - lengths) (>= 0) and q_probs None.

        Raises:
          TypeError, ValueError: as :func:`check_history`; `reference` not an
            integer array of shape [batch, ref_len]; concrete reference ids
            outside [0, vocab_size); a bad key.
        """
        history, lengths = check_history(history, lengths)
        batch = history.shape[0]
        ref_len = _checks.int_array("reference", self.reference, "batch, ref_len").shape[1]
        reference = v.check_int_range("reference", self.reference, "batch, ref_len", (batch, ref_len),
                                      0, self.vocab_size - 1)
        key = _checks.check_key(key)
        k = self.num_speculative_tokens
        position = lengths[:, None] + jnp.arange(k)[None, :]
        truth = gather_rows(reference, position)
        choose_key, wrong_key, branch_key = _checks.row_keys(key, batch, 3)
        right = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(choose_key) < self.alpha
        shift = jax.vmap(lambda kk: jax.random.randint(kk, (k,), 1, self.vocab_size - self.branches))(wrong_key)
        tokens = jnp.where(right, truth, (truth + shift) % self.vocab_size)
        num_drafts = jnp.clip(ref_len - lengths, 0, k).astype(jnp.int32)
        tokens = jnp.where(jnp.arange(k)[None, :] < num_drafts[:, None], tokens, 0).astype(jnp.int32)
        candidates = None
        if self.branches:
            c = self.branches
            tries = jax.vmap(lambda kk: jax.random.uniform(kk, (k, c)))(branch_key) < self.alpha
            first = tries & (jnp.cumsum(tries, axis=-1) == 1) & ~right[..., None]  # the first right candidate
            wrong = (truth + shift)[..., None] + 1 + jnp.arange(c)  # distinct, none the truth or the draft
            candidates = jnp.where(first, truth[..., None], wrong % self.vocab_size).astype(jnp.int32)
        return Drafts(tokens=tokens, num_drafts=num_drafts, q_probs=None, candidates=candidates)
