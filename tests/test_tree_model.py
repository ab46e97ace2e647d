"""Tree speculation through whole models: `verify(tokens, cache, tree=)`, `commit(cache, m, path)`.

A tree-speculative greedy loop written here: each round verifies the last
accepted token and the N - 1 drafts of a static tree (top-2 per depth, the
first candidate expanding: nodes 1, 2 at depth 1, nodes 3, 4 under node 1
at depth 2), with the true greedy continuation (the fixture's
`generated_ids`) placed on one branch per row and wrong tokens elsewhere,
accepts with `tree_greedy_acceptance` and commits the accepted path. The
rows take different branches in a round, and over the rounds each row's
accepted path is a first child's (the full depth), a last child's at
depth 1 and at depth 2, and the root only. The loop must emit plain greedy
decoding's tokens, and the logits of every node on the true branch must
equal the plain decode step's. Run for the ReplaySSM state on every fixture
and for the per-node standard state on one. Bad trees are refused before
the first round, and the cache then serves the loop.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model, make_commit, make_prefill, make_verify_step, split_params
from replayssm_jax.layers import KVCache, ReplayLayerState, SSMLayerState
from replayssm_jax.speculative import DraftTree, tree_greedy_acceptance

DATA = os.path.join(os.path.dirname(__file__), "data")
FIXTURES = ["mamba2_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_next_tiny"]
TREE = DraftTree.topk(2, 2)
NEW_TOKENS = 12
TOL = 1e-4
# The true branch per scenario (the nodes holding the true continuation, root excluded) and the path it
# accepts: the first children (full depth), the last child at depth 1, the last child at depth 2, none.
BRANCHES = {"first": (1, 3), "last": (2,), "last-deep": (1, 4), "root": ()}
# Per round, each row's scenario: the rows take different branches.
SCHEDULE = [("first", "last"), ("last-deep", "root"), ("root", "first"), ("last", "last-deep")]


@jax.jit
def _accept(logits, drafts, real):
    return tree_greedy_acceptance(logits, drafts, real, TREE)


def check_bad_trees(model, verify, commit, params, cache):
    """Bad trees and paths raise before any op runs (the jitted steps raise while tracing), naming them."""
    batch = cache.position.shape[0]
    tokens = jnp.zeros((batch, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"one node per verified position, N = tokens.shape\[1\] = 3; got a tree "
                                         r"of 5 nodes"):
        verify(params, cache, tokens)
    with pytest.raises(TypeError, match="`tree` must be None or a DraftTree"):
        model.verify(tokens, cache, tree=(2, 1))
    with pytest.raises(ValueError, match="no pending verify window"):
        commit(cache, jnp.ones(batch, jnp.int32), jnp.zeros((batch, 3), jnp.int32))


def check_bad_paths(model, cache, tree):
    """A tree's pending window is committed only along a path of the tree, root first: no path, a path
    off the root or across siblings raises (`tree` has nodes 1 and 2 under the root, 3 under 1), naming
    the row; so do the commits of the model's layers on their own states."""
    batch = cache.position.shape[0]
    m = jnp.full(batch, 3, jnp.int32)
    with pytest.raises(ValueError, match="`path` is required after a draft tree's verify"):
        model.commit(cache, m)
    across = np.tile(np.array([0, 1, 3], np.int32), (batch, 1))
    across[-1] = (0, 1, 2)
    assert tree.parents[3] == 1 and tree.parents[2] == 0
    with pytest.raises(ValueError, match=rf"`path` must follow the draft tree's edges; row {batch - 1}: node 2 "
                                         r"\(position 2\) has parent 0, not node 1"):
        model.commit(cache, m, jnp.asarray(across))
    with pytest.raises(ValueError, match="`path` must start at the root, node 0; row 0 starts at node 1"):
        model.commit(cache, m, jnp.asarray(np.tile(np.array([1, 3, 0], np.int32), (batch, 1))))
    # Each layer's state records the tree too, and the layers' own commits check against it.
    for block, state in zip(model._blocks, cache.layers):
        if state is None:
            continue
        assert state.tree == tree.parents, type(state).__name__
        with pytest.raises(ValueError, match="`path` is required after a draft tree's verify"):
            block.mixer.commit(state, m)
        with pytest.raises(ValueError, match=rf"row {batch - 1}: node 2 \(position 2\) has parent 0, not node 1"):
            block.mixer.commit(state, m, jnp.asarray(across))


def tree_greedy(name, replay_buffer_len):
    model = load_model(os.path.join(DATA, name))
    ref = dict(np.load(os.path.join(DATA, name, "reference.npz")))
    graphdef, params = split_params(model)
    prompt, gen, step_logits = ref["prompt_ids"], ref["generated_ids"], ref["step_logits"]
    batch, T = prompt.shape
    true_new, vocab = gen[:, T:], step_logits.shape[-1]
    prefill = make_prefill(graphdef, max_len=T + NEW_TOKENS + TREE.size, replay_buffer_len=replay_buffer_len,
                           last_logits_only=True, max_window=TREE.size)
    verify, commit = make_verify_step(graphdef, tree=TREE), make_commit()
    logits, cache = prefill(params, jnp.asarray(prompt))
    check_bad_trees(model, verify, commit, params, cache)  # before any round: the cache stays usable
    out = [[int(t)] for t in np.argmax(np.asarray(logits), axis=-1)]
    seen, rounds = set(), 0
    while min(len(o) for o in out) < NEW_TOKENS:
        scenarios = SCHEDULE[rounds % len(SCHEDULE)]
        rounds += 1
        drafts = np.zeros((batch, TREE.size - 1), np.int32)
        for b, scenario in enumerate(scenarios):
            n = len(out[b])
            drafts[b] = (true_new[b, n + np.asarray(TREE.depth[1:]) - 1] + 1) % vocab  # wrong everywhere
            for j in BRANCHES[scenario]:
                drafts[b, j - 1] = true_new[b, n + TREE.depth[j] - 1]
        tokens = np.concatenate([np.array([[o[-1]] for o in out], np.int32), drafts], axis=1)
        logits, cache = verify(params, cache, jnp.asarray(tokens))
        assert cache.window == TREE.size
        lg = np.asarray(logits)
        for b, scenario in enumerate(scenarios):
            n = len(out[b])
            for j in (0, *BRANCHES[scenario]):  # the nodes on the true branch: the plain decode step's logits
                err = np.max(np.abs(lg[b, j] - step_logits[n + TREE.depth[j], b]))
                assert err < TOL, f"{name}: round {rounds} row {b} node {j}: max abs err {err:.3g}"
        accepted = _accept(logits, jnp.asarray(drafts), jnp.ones(drafts.shape, bool))
        m, path = np.asarray(accepted.num_accepted), np.asarray(accepted.path)
        if rounds == 1:
            check_bad_paths(model, cache, TREE)  # the cache stays usable: committed below
        for b, scenario in enumerate(scenarios):
            assert tuple(path[b, :m[b]]) == (0, *BRANCHES[scenario]), (name, rounds, b, scenario)
            seen.add(scenario)
        cache = commit(cache, accepted.num_accepted, accepted.path)
        assert cache.window == 0
        for b in range(batch):
            out[b] += [int(t) for t in np.asarray(accepted.tokens)[b, :m[b]]]
        np.testing.assert_array_equal(np.asarray(cache.position), [T + len(o) - 1 for o in out])
    assert seen == set(BRANCHES)
    return np.array([o[:NEW_TOKENS] for o in out]), true_new[:, :NEW_TOKENS], cache


# The hybrids of both layer types by default (each with attention layers under the ancestor mask); the
# others `slow`.
@pytest.mark.parametrize("name", [n if n in ("nemotron_h_tiny", "qwen3_5_tiny") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FIXTURES])
def test_tree_greedy_equals_greedy(name):
    tokens, want, cache = tree_greedy(name, 8)
    np.testing.assert_array_equal(tokens, want)
    assert {type(s) for s in cache.layers} - {KVCache, type(None)} == {ReplayLayerState}


def test_tree_greedy_equals_greedy_standard_state():
    """The per-node standard state (one state per node; commit selects the accepted node's)."""
    tokens, want, cache = tree_greedy("mamba2_tiny", None)
    np.testing.assert_array_equal(tokens, want)
    assert {type(s) for s in cache.layers} - {KVCache, type(None)} == {SSMLayerState}
