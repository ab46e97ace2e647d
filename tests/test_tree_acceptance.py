"""Tree acceptance (`tree_greedy_acceptance`, `tree_sampling_acceptance`).

Greedy: the accepted path is a first child's, a last child's, the root
alone, the full depth, and rows of one batch take different branches;
padding is never accepted. Sampling: over two rounds of a Markov-chain
target on a 3-token vocabulary, with drafts from another chain's top-2 per
depth, the first two emitted tokens have the target's joint distribution
(chi-square), and a wrong residual fails the same check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.sampling import SamplingParams
from replayssm_jax.speculative import tree_acceptance
from replayssm_jax.speculative.tree import DraftTree
from replayssm_jax.speculative.tree_acceptance import tree_greedy_acceptance, tree_sampling_acceptance

TREE = DraftTree.topk(2, 2)  # (-1, 0, 0, 1, 1): nodes 1, 2 at depth 1; 3, 4 (children of 1) at depth 2
VOCAB = 6


def one_hot_logits(argmax_per_node):
    """logits [batch, N, VOCAB] with the given argmax per row and node."""
    return jax.nn.one_hot(jnp.asarray(argmax_per_node), VOCAB) * 5.0


def test_greedy_paths():
    # Row 0: node 1 then its first child 3 match (full depth); row 1: node 2 (the last child at depth 1);
    # row 2: nothing (root only); row 3: node 1 and its last child 4.
    target = [[1, 2, 0, 0, 0], [5, 0, 4, 0, 0], [3, 0, 0, 0, 0], [1, 4, 0, 0, 0]]
    drafts = [[1, 5, 2, 0], [1, 5, 0, 0], [1, 2, 0, 0], [1, 0, 3, 4]]
    real = np.ones((4, 4), bool)
    result = tree_greedy_acceptance(one_hot_logits(target), jnp.asarray(drafts), jnp.asarray(real), TREE, fill_id=-1)
    np.testing.assert_array_equal(result.num_accepted, [3, 2, 1, 3])
    np.testing.assert_array_equal(result.path, [[0, 1, 3], [0, 2, 2], [0, 0, 0], [0, 1, 4]])
    # The tokens: the accepted drafts, then the target's argmax at the path's end.
    np.testing.assert_array_equal(result.tokens, [[1, 2, 0], [5, 4, -1], [3, -1, -1], [1, 4, 0]])


def test_greedy_padding_is_never_accepted():
    target = [[1, 2, 0, 0, 0]]
    result = tree_greedy_acceptance(one_hot_logits(target), jnp.asarray([[1, 1, 2, 2]]),
                                    jnp.asarray([[True, True, False, True]]), TREE)
    np.testing.assert_array_equal(result.path, [[0, 1, 4]])  # node 3 is padding: node 4 carries the match
    result = tree_greedy_acceptance(one_hot_logits(target), jnp.asarray([[1, 3, 2, 2]]),
                                    jnp.asarray([[False, True, True, True]]), TREE)
    np.testing.assert_array_equal(result.num_accepted, [1])  # node 1 padding: its subtree is out too


@pytest.mark.slow
def test_greedy_chain_equals_the_chain_rule():
    from replayssm_jax.speculative import greedy_acceptance

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(8, 4, VOCAB)), jnp.float32)
    target = np.argmax(np.asarray(logits), -1)
    drafts = np.where(rng.random((8, 3)) < 0.7, target[:, :3], (target[:, :3] + 1) % VOCAB)
    num = np.array([3, 3, 2, 1, 0, 3, 3, 2], np.int32)
    real = np.arange(3)[None, :] < num[:, None]
    chain = greedy_acceptance(logits, jnp.asarray(drafts), jnp.asarray(num))
    tree = tree_greedy_acceptance(logits, jnp.asarray(drafts), jnp.asarray(real), DraftTree.chain(4))
    np.testing.assert_array_equal(tree.num_accepted, chain.num_accepted)
    np.testing.assert_array_equal(tree.tokens, chain.tokens)


def test_bad_rounds():
    logits = one_hot_logits([[1, 2, 0, 0, 0]])
    with pytest.raises(TypeError, match="`tree` must be a DraftTree"):
        tree_greedy_acceptance(logits, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), (-1, 0))
    with pytest.raises(ValueError, match="one position per tree node, N = 3"):
        tree_greedy_acceptance(logits, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool), DraftTree.topk(2, 1))
    with pytest.raises(ValueError, match=r"`real` must be bool\[batch, N - 1\]"):
        tree_greedy_acceptance(logits, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 3), bool), TREE)
    with pytest.raises(ValueError, match="greedy params"):
        tree_sampling_acceptance(logits, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), TREE,
                                 jax.random.key(0), SamplingParams(0.0))


# -- sampling -----------------------------------------------------------------------------------

V3 = 3
TARGET = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]))  # next-token logits after each id
DRAFTER = np.array([[0.2, 0.3, 0.5], [0.5, 0.2, 0.3], [0.6, 0.1, 0.3]])  # another chain: its top-2 are the drafts
SAMPLE_TREE = DraftTree.topk(2, 2)
ROWS = 20000
CHI_SQUARE_0001_DF8 = 26.124  # the upper 0.1% point with 8 degrees of freedom (NIST/SEMATECH e-Handbook)


def tree_round(roots, key):
    """One round from per-row root tokens: drafts from the drafter chain (the first candidate of each depth
    expands to its top-2), logits from the target chain at every node."""
    top2 = np.argsort(-DRAFTER, axis=1)[:, :2]
    tokens = [roots]
    for j in range(1, SAMPLE_TREE.size):
        parent = tokens[SAMPLE_TREE.parents[j]]
        rank = (j - 1) % 2
        tokens.append(top2[parent, rank])
    tokens = np.stack(tokens, axis=1)  # [rows, N]
    logits = jnp.asarray(TARGET[tokens], jnp.float32)
    real = jnp.ones((len(roots), SAMPLE_TREE.size - 1), bool)
    return _accept(logits, jnp.asarray(tokens[:, 1:]), real, key)


@jax.jit
def _accept(logits, drafts, real, key):
    return tree_sampling_acceptance(logits, drafts, real, SAMPLE_TREE, key, SamplingParams(1.0))


def first_two_tokens():
    """The first two emitted tokens of ROWS rows from root 0 (a second round where the first emitted one)."""
    first = tree_round(np.zeros(ROWS, np.int64), jax.random.key(1))
    tokens, m = np.asarray(first.tokens), np.asarray(first.num_accepted)
    second = tree_round(tokens[:, 0], jax.random.key(2))
    return tokens[:, 0], np.where(m >= 2, tokens[:, 1], np.asarray(second.tokens)[:, 0]), m


def chi_square_pairs(a, b):
    probs = np.exp(TARGET[0])[:, None] * np.exp(TARGET)  # P(a) P(b | a)
    counts = np.bincount(a * V3 + b, minlength=V3 * V3)
    expected = len(a) * probs.ravel()
    return float(np.sum((counts - expected) ** 2 / expected))


def test_sampling_preserves_the_target_distribution():
    a, b, m = first_two_tokens()
    assert (m >= 1).all() and (m <= 3).all() and (m == 3).sum() > 1000 and (m == 1).sum() > 1000
    statistic = chi_square_pairs(a, b)
    assert statistic < CHI_SQUARE_0001_DF8, f"chi-square {statistic:.2f} over {ROWS} rows"


def test_a_wrong_residual_fails_the_distribution_check(monkeypatch):
    """Keeping p after a rejection (no residual) skews the tokens towards the drafts; the check catches it."""
    monkeypatch.setattr(tree_acceptance, "_residual_probs", lambda p, q: p)
    _accept.clear_cache()
    try:
        a, b, _ = first_two_tokens()
        assert chi_square_pairs(a, b) > CHI_SQUARE_0001_DF8
    finally:
        _accept.clear_cache()
