"""The weight-free drafters: n-gram prompt lookup on hand-made and random
histories (against a loop over positions), the oracle drafter's rate, jit
with fixed shapes, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.speculative import Drafts, NgramDrafter, OracleDrafter, greedy_acceptance

GARBAGE = 7  # history entries past a row's length; the hand-made rows use it as a token too


def history_of(rows, max_len):
    """Rows of different lengths as (history [batch, max_len], lengths), padded with GARBAGE."""
    history = np.full((len(rows), max_len), GARBAGE, np.int32)
    for b, row in enumerate(rows):
        history[b, : len(row)] = row
    return jnp.asarray(history), jnp.asarray([len(r) for r in rows], jnp.int32)


def ngram_loop(row, k, max_ngram, min_ngram):
    """Prompt lookup with loops over n and positions: the drafts of one row."""
    n = len(row)
    for g in range(max_ngram, min_ngram - 1, -1):
        if g > n:
            continue
        for s in range(n - g - 1, -1, -1):  # latest first; the occurrence ends before the last token
            if list(row[s : s + g]) == list(row[n - g :]):
                return list(row[s + g : min(s + g + k, n)])
    return []


def drafted(drafts: Drafts):
    tokens, count = np.asarray(drafts.tokens), np.asarray(drafts.num_drafts)
    assert (tokens[np.arange(tokens.shape[1])[None, :] >= count[:, None]] == 0).all()  # padding is 0
    return [tokens[b, : count[b]].tolist() for b in range(len(count))]


# (row, K, max_ngram, min_ngram, drafts)
NGRAM_CASES = {
    "match": ([1, 2, 3, 9, 9, 1, 2], 3, 2, 1, [3, 9, 9]),
    "latest_wins": ([1, 2, 5, 1, 2, 6, 8, 1, 2], 3, 2, 1, [6, 8, 1]),
    "longer_n_preferred": ([3, 1, 2, 8, 4, 1, 2, 9, 3, 1, 2], 3, 3, 1, [8, 4, 1]),
    "near_the_end": ([1, 2, 3, 4, 1, 2, 3], 6, 3, 1, [4, 1, 2, 3]),
    "overlapping_repeat": ([5, 5, 5, 5], 4, 2, 1, [5]),
    "no_match": ([1, 2, 3, 4], 3, 3, 1, []),
    "only_shorter_than_min": ([4, 1, 5, 1], 3, 3, 2, []),
    "unigram_when_allowed": ([4, 1, 5, 1], 3, 3, 1, [5, 1]),
    "one_token": ([3], 2, 2, 1, []),
    "garbage_not_read": ([GARBAGE, 2, GARBAGE], 3, 1, 1, [2, GARBAGE]),
}


@pytest.mark.parametrize("case", NGRAM_CASES)
def test_ngram_hand_made(case):
    row, k, max_ngram, min_ngram, expected = NGRAM_CASES[case]
    assert ngram_loop(row, k, max_ngram, min_ngram) == expected  # the loop agrees with the hand-made answer
    history, lengths = history_of([row], 16)
    drafts = NgramDrafter(k, max_ngram=max_ngram, min_ngram=min_ngram).propose(history, lengths)
    assert drafted(drafts) == [expected]
    assert drafts.q_probs is None and drafts.tokens.dtype == jnp.int32 and drafts.tokens.shape == (1, k)


def test_ngram_rows_of_different_lengths_in_one_jitted_call():
    rows = [NGRAM_CASES[c][0] for c in ("match", "latest_wins", "near_the_end", "no_match", "one_token")]
    rows.append([])
    history, lengths = history_of(rows, 12)
    drafter = NgramDrafter(3, max_ngram=3)
    traces = []

    @jax.jit
    def propose(drafter, history, lengths):
        traces.append(None)
        return drafter.propose(history, lengths)

    expected = [ngram_loop(r, 3, 3, 1) for r in rows]
    assert drafted(propose(drafter, history, lengths)) == expected
    assert drafted(drafter.propose(history, lengths)) == expected
    # Same shapes, other contents: no new trace.
    shifted = jnp.where(jnp.arange(12)[None, :] < lengths[:, None], history + 1, GARBAGE)
    assert drafted(propose(drafter, shifted, lengths)) == [[t + 1 for t in e] for e in expected]
    assert len(traces) == 1


@pytest.mark.parametrize("max_ngram,min_ngram,k", [(1, 1, 1), (3, 1, 4), (4, 2, 5)])
def test_ngram_matches_the_loop_on_random_histories(rng, max_ngram, min_ngram, k):
    batch, max_len = 48, 30
    history = rng.integers(0, 3, size=(batch, max_len)).astype(np.int32)  # 3 ids: many matches
    lengths = rng.integers(0, max_len + 1, size=batch).astype(np.int32)
    drafts = NgramDrafter(k, max_ngram=max_ngram, min_ngram=min_ngram).propose(history, lengths)
    expected = [ngram_loop(history[b, : lengths[b]], k, max_ngram, min_ngram) for b in range(batch)]
    assert drafted(drafts) == expected
    assert any(len(e) == k for e in expected) and (k == 1 or any(0 < len(e) < k for e in expected))


def oracle_setup(batch=6, ref_len=20, vocab=11, seed=0):
    reference = np.random.default_rng(seed).integers(0, vocab, size=(batch, ref_len)).astype(np.int32)
    lengths = np.array([1, 5, 10, 17, 19, 20][:batch], np.int32)
    return jnp.asarray(reference), jnp.asarray(lengths), vocab


def test_oracle_alpha_one_proposes_the_reference():
    reference, lengths, vocab = oracle_setup()
    drafts = OracleDrafter(reference, alpha=1.0, num_speculative_tokens=4, vocab_size=vocab).propose(
        reference, lengths, jax.random.key(0))
    ref = np.asarray(reference)
    expected = [ref[b, n : n + 4].tolist() for b, n in enumerate(np.asarray(lengths))]
    assert drafted(drafts) == expected
    np.testing.assert_array_equal(np.asarray(drafts.num_drafts), [4, 4, 4, 3, 1, 0])  # fewer near the end


def test_oracle_alpha_zero_proposes_only_wrong_tokens():
    reference, lengths, vocab = oracle_setup()
    drafts = OracleDrafter(reference, alpha=0.0, num_speculative_tokens=4, vocab_size=vocab).propose(
        reference, lengths, jax.random.key(1))
    ref = np.asarray(reference)
    for b, (n, row) in enumerate(zip(np.asarray(lengths), drafted(drafts))):
        assert len(row) == min(4, 20 - n)
        assert all(0 <= t < vocab and t != ref[b, n + j] for j, t in enumerate(row))


def test_oracle_rate_is_alpha_and_reproducible():
    batch, ref_len, k, vocab = 256, 64, 8, 50
    reference = jax.random.randint(jax.random.key(3), (batch, ref_len), 0, vocab)
    lengths = jnp.full((batch,), 10, jnp.int32)
    drafter = OracleDrafter(reference, alpha=0.6, num_speculative_tokens=k, vocab_size=vocab)
    propose = jax.jit(lambda d, key: d.propose(reference, lengths, key))
    drafts = propose(drafter, jax.random.key(4))
    right = np.asarray(drafts.tokens) == np.asarray(reference)[:, 10 : 10 + k]
    assert abs(right.mean() - 0.6) < 0.03  # 2048 positions: the standard error is 0.011
    np.testing.assert_array_equal(np.asarray(propose(drafter, jax.random.key(4)).tokens), np.asarray(drafts.tokens))
    assert (np.asarray(propose(drafter, jax.random.key(5)).tokens) != np.asarray(drafts.tokens)).any()
    wrong = np.asarray(drafts.tokens)[~right]
    assert wrong.min() >= 0 and wrong.max() < vocab


@pytest.mark.parametrize("alpha,accepted", [(1.0, 4), (0.0, 0)])
def test_oracle_against_a_greedy_target_accepts_all_or_none(alpha, accepted):
    """A target whose greedy continuation is the reference: alpha 1 accepts
    every draft, alpha 0 none."""
    batch, ref_len, k, vocab = 8, 24, 4, 13
    reference = jax.random.randint(jax.random.key(6), (batch, ref_len), 0, vocab)
    lengths = jnp.arange(batch, dtype=jnp.int32) + 3
    drafts = OracleDrafter(reference, alpha, k, vocab).propose(reference, lengths, jax.random.key(7))
    # Position i of the window predicts the token at lengths + i.
    truth = jnp.take_along_axis(reference, lengths[:, None] + jnp.arange(k + 1)[None, :], axis=1)
    logits = 4.0 * jax.nn.one_hot(truth, vocab) + 0.1 * jax.random.normal(jax.random.key(8), (batch, k + 1, vocab))
    result = greedy_acceptance(logits, drafts.tokens, drafts.num_drafts)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), accepted + 1)
    np.testing.assert_array_equal(np.asarray(result.tokens)[:, : accepted + 1], np.asarray(truth)[:, : accepted + 1])


BAD_DRAFTERS = [
    (lambda: NgramDrafter(0), ValueError, "`num_speculative_tokens` must be >= 1; got 0"),
    (lambda: NgramDrafter(2.0), TypeError, "`num_speculative_tokens` must be an int; got float"),
    (lambda: NgramDrafter(3, max_ngram=1, min_ngram=2), ValueError, "`max_ngram` must be >= `min_ngram` = 2; got 1"),
    (lambda: NgramDrafter(3, max_ngram=2, min_ngram=0), ValueError, "`min_ngram` must be >= 1; got 0"),
    (lambda: OracleDrafter(jnp.zeros((2, 4), jnp.int32), 1.5, 2, 5), ValueError,
     r"`alpha` must be a float in \[0, 1\]; got 1.5"),
    (lambda: OracleDrafter(jnp.zeros((2, 4), jnp.int32), -0.1, 2, 5), ValueError, r"`alpha` .*got -0.1"),
    (lambda: OracleDrafter(jnp.zeros((2, 4), jnp.int32), float("nan"), 2, 5), ValueError, r"`alpha` .*got nan"),
    (lambda: OracleDrafter(jnp.zeros((2, 4), jnp.int32), 0.5, 0, 5), ValueError,
     "`num_speculative_tokens` must be >= 1; got 0"),
    (lambda: OracleDrafter(jnp.zeros((2, 4), jnp.int32), 0.5, 2, 1), ValueError, "`vocab_size` must be >= 2; got 1"),
]


@pytest.mark.parametrize("index", range(len(BAD_DRAFTERS)))
def test_bad_drafter_configuration(index):
    make, error, message = BAD_DRAFTERS[index]
    with pytest.raises(error, match=message):
        make()


HISTORY = jnp.zeros((2, 6), jnp.int32)
LENGTHS = jnp.array([3, 4], jnp.int32)
ORACLE = OracleDrafter(jnp.zeros((2, 8), jnp.int32), 0.5, 2, 5)
BAD_PROPOSALS = [
    (HISTORY[0], LENGTHS, ValueError, r"`history` must have rank 2 \[batch, max_len\]; got shape \(6,\)"),
    (HISTORY.astype(jnp.float32), LENGTHS, TypeError, "`history` must have an integer dtype; got float32"),
    (HISTORY, LENGTHS[:1], ValueError, r"`lengths` must have shape \[batch\] = \(2,\); got \(1,\)"),
    (HISTORY, jnp.array([3, 7]), ValueError, r"`lengths` must be in \[0, 6\] for every row; got \[3, 7\]"),
    (HISTORY, LENGTHS.astype(jnp.float32), TypeError, "`lengths` must have an integer dtype; got float32"),
    (HISTORY, "4", TypeError, "`lengths` must be an array; got str"),
]


@pytest.mark.parametrize("index", range(len(BAD_PROPOSALS)))
@pytest.mark.parametrize("drafter", [NgramDrafter(2), ORACLE], ids=["ngram", "oracle"])
def test_bad_history(drafter, index):
    history, lengths, error, message = BAD_PROPOSALS[index]
    with pytest.raises(error, match=message):
        drafter.propose(history, lengths, jax.random.key(0))


@pytest.mark.parametrize("reference,key,error,message", [
    (jnp.zeros((3, 8), jnp.int32), jax.random.key(0), ValueError,
     r"`reference` must have shape \[batch, ref_len\] = \(2, 8\); got \(3, 8\)"),
    (jnp.zeros((2, 8), jnp.float32), jax.random.key(0), TypeError, "`reference` must have an integer dtype; got float32"),
    (jnp.full((2, 8), 5, jnp.int32), jax.random.key(0), ValueError, r"`reference` must be in \[0, 4\] for every row"),
    (jnp.zeros((2, 8), jnp.int32), 0, TypeError, "`key` must be one PRNG key"),
    (jnp.zeros((2, 8), jnp.int32), jax.random.split(jax.random.key(0)), TypeError, "`key` must be one PRNG key"),
])
def test_bad_oracle_reference_or_key(reference, key, error, message):
    with pytest.raises(error, match=message):
        OracleDrafter(reference, 0.5, 2, 5).propose(HISTORY, LENGTHS, key)


def test_the_weight_free_drafters_have_no_state():
    """The loop's interface of a stateless drafter (`StatelessDrafter`): state None, `draft` = `propose`."""
    history, lengths = history_of([[1, 2, 3, 1, 2], [4, 5, 4]], 8)
    key = jax.random.key(0)
    for drafter in (NgramDrafter(2), OracleDrafter(history, 1.0, 2, 16)):
        assert not drafter.needs_hidden and drafter.init_state(None, None) is None
        drafts, state = drafter.draft(None, None, history, lengths, key)
        want = drafter.propose(history, lengths, key)
        assert state is None and drafter.update(None, None, None) is None
        np.testing.assert_array_equal(np.asarray(drafts.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(drafts.num_drafts), np.asarray(want.num_drafts))
