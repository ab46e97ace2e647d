"""The acceptance rules: greedy on hand-made logits and against plain greedy
decoding of a toy bigram model; speculative sampling keeps the target's
distribution (chi-square on a 5-token vocabulary, and a wrong residual fails
the same check); the edge cases and bad input; the per-row forms (params as
arrays) give each row its own params' result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.sampling import (
    BatchSampling,
    SamplingParams,
    processed_logits,
    processed_logits_batch,
    sample_tokens,
    sample_tokens_batch,
    token_log_probs,
)
from replayssm_jax.speculative import (
    Drafts,
    NgramDrafter,
    OracleDrafter,
    accept_drafts,
    accept_drafts_batch,
    acceptance,
    greedy_acceptance,
    sampling_acceptance,
)

VOCAB = 5


def logits_with_argmax(argmax, vocab=8, seed=0):
    """f32[batch, W, vocab] logits whose argmax is `argmax` [batch, W]."""
    argmax = np.asarray(argmax)
    noise = np.random.default_rng(seed).uniform(-1, 1, size=argmax.shape + (vocab,))
    return jnp.asarray(noise + 3.0 * np.eye(vocab)[argmax], jnp.float32)


# (drafts, num_drafts, tokens, num_accepted) for target argmaxes [4, 5, 6, 1] (K = 3), fill -1.
GREEDY_CASES = {
    "all_accepted": ([4, 5, 6], 3, [4, 5, 6, 1], 4),
    "none_accepted": ([2, 5, 6], 3, [4, -1, -1, -1], 1),
    "middle": ([4, 5, 0], 3, [4, 5, 6, -1], 3),
    "padded_drafts": ([4, 5, 6], 2, [4, 5, 6, -1], 3),  # the right third draft is padding: rejected
    "padded_after_mismatch": ([4, 0, 6], 1, [4, 5, -1, -1], 2),
    "no_drafts": ([4, 5, 6], 0, [4, -1, -1, -1], 1),  # plain decoding
    "out_of_vocab": ([4, 99, 6], 3, [4, 5, -1, -1], 2),
}


def test_greedy_hand_made_in_one_jitted_call():
    cases = list(GREEDY_CASES.values())
    logits = logits_with_argmax([[4, 5, 6, 1]] * len(cases))
    drafts = jnp.asarray([c[0] for c in cases], jnp.int32)
    num_drafts = jnp.asarray([c[1] for c in cases], jnp.int32)
    accept = jax.jit(functools.partial(greedy_acceptance, fill_id=-1))
    for result in (accept(logits, drafts, num_drafts), greedy_acceptance(logits, drafts, num_drafts, fill_id=-1)):
        assert result.tokens.dtype == jnp.int32 and result.num_accepted.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(result.tokens), [c[2] for c in cases])
        np.testing.assert_array_equal(np.asarray(result.num_accepted), [c[3] for c in cases])


def test_greedy_without_drafts_is_plain_greedy(rng):
    logits = jnp.asarray(rng.normal(size=(16, 3, 40)), jnp.float32)
    result = greedy_acceptance(logits, jnp.zeros((16, 2), jnp.int32), jnp.zeros((16,), jnp.int32))
    plain = sample_tokens(logits[:, 0], jax.random.key(0), SamplingParams())
    np.testing.assert_array_equal(np.asarray(result.tokens[:, 0]), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(result.num_accepted), 1)


def bigram_decode(table, prompts, max_len, drafter=None, key=None):
    """Greedy decoding of the model `logits(next | last) = table[last]`, one
    token a step (no drafter) or by speculative rounds. Returns the
    histories i32[batch, max_len] and the number of target calls."""
    history = np.zeros((len(prompts), max_len), np.int32)
    for b, p in enumerate(prompts):
        history[b, : len(p)] = p
    history, lengths = jnp.asarray(history), jnp.asarray([len(p) for p in prompts], jnp.int32)

    @jax.jit
    def round_(history, lengths, key):
        last = jnp.take_along_axis(history, lengths[:, None] - 1, axis=1)
        if drafter is None:
            drafts = Drafts(jnp.zeros((len(prompts), 1), jnp.int32), jnp.zeros((len(prompts),), jnp.int32))
        else:
            drafts = drafter.propose(history, lengths, key)
        window = jnp.concatenate([last, drafts.tokens], axis=1)
        result = accept_drafts(table[window], drafts, key, SamplingParams())
        position = lengths[:, None] + jnp.arange(window.shape[1])[None, :]
        write = (jnp.arange(window.shape[1])[None, :] < result.num_accepted[:, None]) & (position < max_len)
        rows = jnp.broadcast_to(jnp.arange(len(prompts))[:, None], position.shape)
        history = history.at[rows, jnp.where(write, position, max_len)].set(result.tokens, mode="drop")
        return history, jnp.minimum(lengths + result.num_accepted, max_len)

    calls = 0
    while int(lengths.min()) < max_len:
        key, step_key = jax.random.split(key)
        history, lengths = round_(history, lengths, step_key)
        calls += 1
    return np.asarray(history), calls


def test_greedy_speculative_output_equals_plain_greedy_output():
    vocab, max_len = 12, 40
    table = jax.random.normal(jax.random.key(0), (vocab, vocab)) * 3.0
    prompts = [[1], [2, 3, 4], [5, 6, 5, 6, 5], [7, 8]]
    plain, plain_calls = bigram_decode(table, prompts, max_len, key=jax.random.key(1))
    assert plain_calls == max_len - 1
    for drafter in (NgramDrafter(4, max_ngram=2), OracleDrafter(jnp.asarray(plain), 0.6, 3, vocab)):
        spec, calls = bigram_decode(table, prompts, max_len, drafter, key=jax.random.key(2))
        np.testing.assert_array_equal(spec, plain)
        assert calls <= 0.6 * plain_calls  # drafts were accepted (21 and 20 rounds for 39 tokens)


def target_probs(logits, temperature, top_k=0, top_p=1.0):
    """numpy: softmax(logits / temperature) restricted to the top_k most likely
    tokens, then to the top_p nucleus of that, renormalised."""
    probs = np.exp((logits - logits.max()) / temperature)
    order = np.argsort(-probs, kind="stable")
    if top_k:
        probs[order[top_k:]] = 0.0
    probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]
    probs[order[before >= top_p]] = 0.0
    return probs / probs.sum()


# Chi-square upper 0.1% points by degrees of freedom (tables, e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.4): a correct sampler exceeds them with probability 0.001.
CHI_SQUARE_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


def chi_square(samples, probs):
    """(statistic, critical value at p = 0.001) of the counts of `samples`
    against `probs`; inf if a zero-probability token occurs."""
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    if counts[~support].any():
        return np.inf, 0.0
    expected = len(samples) * probs[support]
    return float(np.sum((counts[support] - expected) ** 2 / expected)), CHI_SQUARE_0001[int(support.sum()) - 1]


# Target logits at the W = 3 positions and the drafter's q at the K = 2 draft positions.
TARGET_LOGITS = np.array([[2.0, 1.0, 0.5, -0.5, 0.0], [0.0, 1.5, -1.0, 0.8, 0.3], [-0.5, 0.2, 1.2, 0.0, 0.9]])
DRAFT_Q = np.array([[0.1, 0.3, 0.3, 0.2, 0.1], [0.15, 0.35, 0.1, 0.1, 0.3]])
POINT_DRAFTS = [1, 1]  # the deterministic drafter's proposals
PARAMS = {
    "t1": SamplingParams(1.0),
    "t0.6_topk3": SamplingParams(0.6, top_k=3),
    "t1.5_topp0.7": SamplingParams(1.5, top_p=0.7),
    "t1_topk4_topp0.8": SamplingParams(1.0, top_k=4, top_p=0.8),
}
ROWS = 20000


def speculative_round(params, drafter, key=0):
    """One jitted round over ROWS rows with num_drafts cycling 2, 2, 2, 1, 0.
    Returns (tokens, num_accepted, num_drafts) as numpy."""
    np_rng = np.random.default_rng(1234)
    num_drafts = np.resize([2, 2, 2, 1, 0], ROWS).astype(np.int32)
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS, jnp.float32), (ROWS, 3, VOCAB))
    if drafter == "q":
        drafts = np.stack([np_rng.choice(VOCAB, size=ROWS, p=q) for q in DRAFT_Q], axis=1)
        q_probs = jnp.broadcast_to(jnp.asarray(DRAFT_Q, jnp.float32), (ROWS, 2, VOCAB))
    else:
        drafts, q_probs = np.tile(POINT_DRAFTS, (ROWS, 1)), None
    accept = jax.jit(functools.partial(sampling_acceptance, params=params))
    result = accept(logits, jnp.asarray(drafts, jnp.int32), jnp.asarray(num_drafts), jax.random.key(key),
                    q_probs=q_probs)
    return np.asarray(result.tokens), np.asarray(result.num_accepted), num_drafts


def check_distribution(tokens, num_accepted, params):
    """Every emitted position against the target: the first token of every
    row, the second of the rows that accepted their first draft, the third of
    the rows that accepted both. Returns [(statistic, critical, rows)]."""
    t, k, p = params.temperature, params.top_k, params.top_p
    return [
        chi_square(tokens[num_accepted > i, i], target_probs(TARGET_LOGITS[i], t, k, p)) + (int((num_accepted > i).sum()),)
        for i in range(3)
    ]


# Top-k and top-p together `slow`: each filter runs alone by default, and
# test_the_processed_distribution_is_the_one_sample_tokens_draws_from checks the two together.
@pytest.mark.parametrize("drafter", ["q", "point"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "t1_topk4_topp0.8" else n
                                  for n in PARAMS])
def test_sampling_preserves_the_target_distribution(name, drafter):
    params = PARAMS[name]
    tokens, num_accepted, num_drafts = speculative_round(params, drafter)
    assert ((num_accepted >= 1) & (num_accepted <= num_drafts + 1)).all()
    for position, (statistic, critical, rows) in enumerate(check_distribution(tokens, num_accepted, params)):
        assert rows > 1000, (position, rows)
        assert statistic < critical, f"position {position}: chi-square {statistic:.2f} >= {critical} over {rows} rows"


@pytest.mark.parametrize("drafter", ["q", "point"])
def test_a_wrong_residual_fails_the_distribution_check(monkeypatch, drafter):
    """Sampling the residual from p instead of normalize(max(p - q, 0)) skews
    the first token towards the drafts; the same check catches it."""
    monkeypatch.setattr(acceptance, "_residual_probs", lambda p, q: p)
    tokens, num_accepted, _ = speculative_round(PARAMS["t1"], drafter)
    statistic, critical, _ = check_distribution(tokens, num_accepted, PARAMS["t1"])[0]
    assert statistic > critical


def test_the_processed_distribution_is_the_one_sample_tokens_draws_from():
    params = PARAMS["t1_topk4_topp0.8"]
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS[0], jnp.float32), (ROWS, VOCAB))
    probs = np.exp(np.asarray(token_log_probs(logits[:1], params))[0].astype(np.float64))
    np.testing.assert_allclose(probs, target_probs(TARGET_LOGITS[0], 1.0, 4, 0.8), rtol=1e-5, atol=1e-7)
    statistic, critical = chi_square(np.asarray(sample_tokens(logits, jax.random.key(3), params)), probs)
    assert statistic < critical
    greedy = np.exp(np.asarray(token_log_probs(jnp.asarray(TARGET_LOGITS, jnp.float32), SamplingParams())))
    np.testing.assert_array_equal(greedy, np.eye(VOCAB)[TARGET_LOGITS.argmax(-1)])  # a point mass at the argmax


def test_sampling_edge_cases():
    rows = 4000
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS, jnp.float32), (rows, 3, VOCAB))
    num_drafts = jnp.full((rows,), 2, jnp.int32)
    top2 = jax.jit(functools.partial(sampling_acceptance, params=SamplingParams(1.0, top_k=2)))
    # Top-2 supports: {0, 1} at position 0, {1, 3} at position 1.
    # q(x) = 0 < p(x): accepted (no division by q).
    q_zero = jnp.broadcast_to(jnp.asarray([[0.0, 0.0, 0.5, 0.5, 0.0]] * 2), (rows, 2, VOCAB))
    result = top2(logits, jnp.ones((rows, 2), jnp.int32), num_drafts, jax.random.key(0), q_probs=q_zero)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), 3)
    # A draft id outside the vocabulary is rejected; the token comes from p.
    result = top2(logits, jnp.full((rows, 2), VOCAB, jnp.int32), num_drafts, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(result.num_accepted), 1)
    statistic, critical = chi_square(np.asarray(result.tokens[:, 0]), target_probs(TARGET_LOGITS[0], 1.0, 2))
    assert statistic < critical
    # p = q (here one-hot, exactly) and a draft outside both: rejected, the
    # residual max(p - q, 0) has no mass, and the token comes from p.
    top1 = jax.jit(functools.partial(sampling_acceptance, params=SamplingParams(1.0, top_k=1)))
    q_same = jax.nn.one_hot(jnp.broadcast_to(jnp.asarray([0, 1]), (rows, 2)), VOCAB)
    result = top1(logits, jnp.full((rows, 2), 4, jnp.int32), num_drafts, jax.random.key(1), q_probs=q_same)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), 1)
    np.testing.assert_array_equal(np.asarray(result.tokens[:, 0]), 0)


def test_padding_and_other_rows_do_not_change_a_row(rng):
    batch = 6
    logits = jnp.asarray(rng.normal(size=(batch, 4, 30)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, 30, size=(batch, 3)), jnp.int32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, 3, 30)), jnp.float32), axis=-1)
    num_drafts = jnp.asarray([3, 2, 1, 0, 2, 3], jnp.int32)
    params, key = SamplingParams(0.9, top_p=0.95), jax.random.key(5)
    accept = jax.jit(functools.partial(sampling_acceptance, params=params))
    base = accept(logits, drafts, num_drafts, key, q_probs=q)
    # Other values at the padded positions (drafts and q, even NaN): the same tokens.
    padded = jnp.arange(3)[None, :] >= num_drafts[:, None]
    other = accept(logits, jnp.where(padded, 29 - drafts, drafts), num_drafts, key,
                   q_probs=jnp.where(padded[..., None], jnp.nan, q))
    np.testing.assert_array_equal(np.asarray(other.tokens), np.asarray(base.tokens))
    # Row 0 alone, or beside other rows: the same tokens.
    alone = accept(logits[:1], drafts[:1], num_drafts[:1], key, q_probs=q[:1])
    np.testing.assert_array_equal(np.asarray(alone.tokens), np.asarray(base.tokens[:1]))


def test_accept_drafts_picks_the_rule_by_params(rng):
    logits = jnp.asarray(rng.normal(size=(8, 3, 20)), jnp.float32)
    drafts = Drafts(jnp.asarray(rng.integers(0, 20, size=(8, 2)), jnp.int32), jnp.full((8,), 2, jnp.int32),
                    jax.nn.softmax(jnp.asarray(rng.normal(size=(8, 2, 20)), jnp.float32), axis=-1))
    key = jax.random.key(0)
    greedy = accept_drafts(logits, drafts, key, SamplingParams())
    expected = greedy_acceptance(logits, drafts.tokens, drafts.num_drafts)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), np.asarray(expected.tokens))
    sampled = accept_drafts(logits, drafts, key, SamplingParams(0.8), fill_id=3)
    expected = sampling_acceptance(logits, drafts.tokens, drafts.num_drafts, key, SamplingParams(0.8), drafts.q_probs,
                                   fill_id=3)
    np.testing.assert_array_equal(np.asarray(sampled.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(sampled.num_accepted), np.asarray(expected.num_accepted))


LOGITS = jnp.zeros((2, 4, 10), jnp.float32)
DRAFTS = jnp.zeros((2, 3), jnp.int32)
NUM = jnp.array([3, 1], jnp.int32)
KEY = jax.random.key(0)
BAD_ROUNDS = [
    ((LOGITS[:, :1], DRAFTS[:, :0], NUM), ValueError, r"`logits` must have W = K \+ 1 >= 2 positions"),
    ((LOGITS[0], DRAFTS, NUM), ValueError, r"`logits` must have rank 3 \[batch, W, vocab\]; got shape \(4, 10\)"),
    ((LOGITS.astype(jnp.int32), DRAFTS, NUM), TypeError, "`logits` must have a floating-point dtype; got int32"),
    ((LOGITS, DRAFTS[:, :2], NUM), ValueError,
     r"`drafts` must have shape \[batch, K\] = \(2, 3\) to match `logits` \[batch, W = K \+ 1, vocab\] = \(2, 4, 10\); "
     r"got \(2, 2\)"),
    ((LOGITS, DRAFTS[:1], NUM), ValueError, r"`drafts` must have shape \[batch, K\] = \(2, 3\)"),
    ((LOGITS, DRAFTS.astype(jnp.float32), NUM), TypeError, "`drafts` must have an integer dtype; got float32"),
    ((LOGITS, DRAFTS, jnp.array([4, 1])), ValueError, r"`num_drafts` must be in \[0, 3\] for every row; got \[4, 1\]"),
    ((LOGITS, DRAFTS, jnp.array([-1, 1])), ValueError, r"`num_drafts` must be in \[0, 3\]"),
    ((LOGITS, DRAFTS, NUM[:1]), ValueError, r"`num_drafts` must have shape \[batch\] = \(2,\); got \(1,\)"),
]


@pytest.mark.parametrize("rule", ["greedy", "sampling"])
@pytest.mark.parametrize("index", range(len(BAD_ROUNDS)))
def test_bad_round_arguments(rule, index):
    args, error, message = BAD_ROUNDS[index]
    with pytest.raises(error, match=message):
        if rule == "greedy":
            greedy_acceptance(*args)
        else:
            sampling_acceptance(*args, KEY, SamplingParams(1.0))


@pytest.mark.parametrize("kwargs,error,message", [
    ({"q_probs": jnp.zeros((2, 4, 10))}, ValueError, r"`q_probs` must have shape \[batch, K, vocab\] = \(2, 3, 10\); "
                                                      r"got \(2, 4, 10\)"),
    ({"q_probs": jnp.zeros((2, 3, 10), jnp.int32)}, TypeError, "`q_probs` must have a floating-point dtype"),
    ({"params": SamplingParams()}, ValueError, "`params` must have temperature > 0 for sampling_acceptance"),
    ({"params": {"temperature": 1.0}}, TypeError, "`params` must be a SamplingParams; got dict"),
    ({"key": 3}, TypeError, "`key` must be one PRNG key"),
    ({"fill_id": 0.5}, TypeError, "`fill_id` must be an int; got float 0.5"),
])
def test_bad_sampling_arguments(kwargs, error, message):
    arguments = {"key": KEY, "params": SamplingParams(1.0)} | kwargs
    with pytest.raises(error, match=message):
        sampling_acceptance(LOGITS, DRAFTS, NUM, **arguments)


def test_bad_accept_drafts_arguments():
    with pytest.raises(TypeError, match="`drafts` must be a Drafts; got tuple"):
        accept_drafts(LOGITS, (DRAFTS, NUM), KEY, SamplingParams())
    with pytest.raises(TypeError, match="`params` must be a SamplingParams; got float"):
        accept_drafts(LOGITS, Drafts(DRAFTS, NUM), KEY, 0.0)


# Per-row params of one batch: greedy, plain, top-k, top-p, both, a top-k of the whole vocabulary.
MIXED = [None, SamplingParams(0.7), SamplingParams(1.0, top_k=3), SamplingParams(1.3, top_p=0.6),
         SamplingParams(0.9, top_k=5, top_p=0.8), SamplingParams(1.0, top_k=20)]


def test_batch_sampling_gives_each_row_its_params_result(rng):
    """processed_logits_batch, sample_tokens_batch and accept_drafts_batch (one jitted program, params traced):
    row b equals the static form's result with row b's params alone (bit for bit, keys[b] = fold_in(k, 0));
    an all-greedy batch gives the argmax and greedy acceptance."""
    batch = len(MIXED)
    logits = jnp.asarray(rng.normal(size=(batch, 3, 20)) * 2, jnp.float32)
    drafts = Drafts(jnp.asarray(rng.integers(0, 20, size=(batch, 2)), jnp.int32),
                    jnp.asarray([2, 1, 2, 0, 2, 1], jnp.int32),
                    jax.nn.softmax(jnp.asarray(rng.normal(size=(batch, 2, 20)), jnp.float32), axis=-1))
    sampling = BatchSampling.of(MIXED)
    row_keys = [jax.random.key(b) for b in range(batch)]
    keys = jnp.stack([jax.random.fold_in(k, 0) for k in row_keys])
    processed = jax.jit(processed_logits_batch)(logits, sampling)
    tokens = jax.jit(sample_tokens_batch)(logits[:, 0], keys, sampling)
    accepted = jax.jit(accept_drafts_batch)(logits, drafts, keys, sampling)
    for b, params in enumerate(MIXED):
        params = params or SamplingParams()
        np.testing.assert_array_equal(np.asarray(processed[b]), np.asarray(processed_logits(logits[b], params)))
        alone = sample_tokens(logits[b:b + 1, 0], row_keys[b], params)
        assert int(tokens[b]) == int(alone[0]), b
        row = Drafts(drafts.tokens[b:b + 1], drafts.num_drafts[b:b + 1], drafts.q_probs[b:b + 1])
        alone = accept_drafts(logits[b:b + 1], row, row_keys[b], params)
        np.testing.assert_array_equal(np.asarray(accepted.tokens[b]), np.asarray(alone.tokens[0]), err_msg=str(b))
        assert int(accepted.num_accepted[b]) == int(alone.num_accepted[0]), b
    greedy = BatchSampling.of([None] * batch)
    np.testing.assert_array_equal(np.asarray(sample_tokens_batch(logits[:, 0], keys, greedy)),
                                  np.asarray(jnp.argmax(logits[:, 0], -1)))
    expected = greedy_acceptance(logits, drafts.tokens, drafts.num_drafts)
    np.testing.assert_array_equal(np.asarray(accept_drafts_batch(logits, drafts, keys, greedy).tokens),
                                  np.asarray(expected.tokens))


def test_bad_batch_sampling_arguments():
    sampling = BatchSampling.of([None, SamplingParams(1.0)])
    keys = jnp.stack([KEY, KEY])
    with pytest.raises(TypeError, match="`params` must hold SamplingParams or None; got float"):
        BatchSampling.of([None, 1.0])
    with pytest.raises(TypeError, match="`sampling` must be a BatchSampling; got SamplingParams"):
        sample_tokens_batch(LOGITS[:, 0], keys, SamplingParams())
    with pytest.raises(ValueError, match=r"`sampling.temperature` must have shape \[batch\] = \(2,\); got \(1,\)"):
        processed_logits_batch(LOGITS, BatchSampling.of([None]))
    with pytest.raises(TypeError, match=r"`keys` must be one PRNG key per row: typed keys of shape \(2,\)"):
        sample_tokens_batch(LOGITS[:, 0], KEY, sampling)
    with pytest.raises(TypeError, match="`drafts` must be a Drafts; got tuple"):
        accept_drafts_batch(LOGITS, (DRAFTS, NUM), keys, sampling)
    with pytest.raises(ValueError, match=r"`num_drafts` must have shape \[batch\]"):
        accept_drafts_batch(LOGITS, Drafts(DRAFTS, NUM[:1]), keys, sampling)
