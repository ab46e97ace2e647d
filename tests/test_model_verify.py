"""Speculative verify and commit through whole models (`verify`, `commit`, `make_verify_step`, `make_commit`).

A speculative greedy loop written here (ARCHITECTURE.md, "Speculative decoding"): each round
verifies the last accepted token plus K = W - 1 drafts taken from the true
greedy continuation (the fixture's `generated_ids`) with some positions
corrupted or padded, accepts with `replayssm_jax.speculative.greedy_acceptance`
and commits. It must emit exactly plain greedy decoding's tokens, and the
logits of every verified position whose tokens are all true must equal the
plain decode step's (`step_logits`). The round schedule gives the two rows
different accepted counts (so their replay buffers flush in different
rounds), rounds where every row accepts everything and where none accepts a
draft, rows with fewer drafts, and a plain decode step between rounds.
Run for the ReplaySSM state (L = 4 with W = 4, L = 8 with W = 7: early
flushes) and for the standard-state baseline.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model, make_commit, make_decode_step, make_prefill, make_verify_step, split_params
from replayssm_jax.layers import KVCache, ReplayLayerState, SSMLayerState
from replayssm_jax.speculative import greedy_acceptance

DATA = os.path.join(os.path.dirname(__file__), "data")
FIXTURES = ["mamba2_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_next_tiny"]
TOL = {"float32": 1e-4}
NEW_TOKENS = 16
# (replay_buffer_len or None for the standard state, verify window W)
STATES = [(4, 4), (8, 7), (None, 3)]

_MODELS: dict = {}


def get_model(name):
    if name not in _MODELS:
        _MODELS[name] = load_model(os.path.join(DATA, name))
    return _MODELS[name]


def reference(name):
    return dict(np.load(os.path.join(DATA, name, "reference.npz")))


def schedule(K):
    """Per round: "decode" (a plain decode step), or per row (corrupted draft index, real drafts);
    an index >= the real drafts corrupts none of them."""
    return [
        ((K, K), (K, K)),  # every row accepts every draft
        ((0, K), (0, K)),  # no row accepts a draft: the bonus token only
        ((1, K), (K, K)),
        ((K, K), (2 % K, K - 1)),  # row 1 with one draft fewer
        "decode",
        ((K - 1, K), (K, 0)),  # row 1 without drafts (padding only)
        ((0, K), (K, K)),
        ((K, K), (1 % K, K)),
    ]


def speculative_greedy(name, replay_buffer_len, window, backend):
    """The loop above; returns (tokens [batch, NEW_TOKENS], rounds, the verified-logit comparisons)."""
    model, ref = get_model(name), reference(name)
    graphdef, params = split_params(model)
    prompt, gen, step_logits = ref["prompt_ids"], ref["generated_ids"], ref["step_logits"]
    batch, T = prompt.shape
    true_new = gen[:, T:]
    K = window - 1
    prefill = make_prefill(graphdef, max_len=T + NEW_TOKENS + window, replay_buffer_len=replay_buffer_len,
                           last_logits_only=True, backend=backend, max_window=window)
    verify = make_verify_step(graphdef, backend=backend)
    commit = make_commit()
    decode = make_decode_step(graphdef, backend=backend, donate_cache=True)
    logits, cache = prefill(params, jnp.asarray(prompt))
    assert cache.max_window == window
    out = [[int(t)] for t in np.argmax(np.asarray(logits), axis=-1)]
    rounds, checked, tol = 0, 0, TOL[str(step_logits.dtype)]
    plan = schedule(K)
    while min(len(o) for o in out) < NEW_TOKENS:
        spec = plan[rounds % len(plan)]
        rounds += 1
        if spec == "decode":
            logits, cache = decode(params, cache, jnp.asarray([o[-1] for o in out], jnp.int32))
            for b, t in enumerate(np.argmax(np.asarray(logits), axis=-1)):
                out[b].append(int(t))
            continue
        drafts = np.zeros((batch, K), np.int32)
        num_drafts = np.zeros((batch,), np.int32)
        for b, (bad, real) in enumerate(spec):
            n = len(out[b])
            drafts[b] = true_new[b, n:n + K]
            if bad < real:
                drafts[b, bad] = (drafts[b, bad] + 1) % step_logits.shape[-1]
            drafts[b, real:] = (true_new[b, n + real:n + K] + 7) % step_logits.shape[-1]  # padding, never true
            num_drafts[b] = real
        tokens = np.concatenate([np.array([[o[-1]] for o in out], np.int32), drafts], axis=1)
        logits, cache = verify(params, cache, jnp.asarray(tokens))
        assert logits.shape == (batch, window, step_logits.shape[-1]) and cache.window == window
        lg = np.asarray(logits)
        for b in range(batch):
            n = len(out[b])
            true = np.concatenate([[True], drafts[b] == true_new[b, n:n + K]])
            valid = int(np.argmin(true)) if not true.all() else window  # positions 0..valid-1 hold true tokens
            err = np.max(np.abs(lg[b, :valid] - step_logits[n:n + valid, b]))
            assert err < tol, f"{name}: round {rounds} row {b}: verify logits vs decode steps max abs err {err:.3g}"
            checked += valid
        accepted = greedy_acceptance(logits, jnp.asarray(drafts), jnp.asarray(num_drafts))
        cache = commit(cache, accepted.num_accepted)
        assert cache.window == 0
        m = np.asarray(accepted.num_accepted)
        for b in range(batch):
            out[b] += [int(t) for t in np.asarray(accepted.tokens)[b, :m[b]]]
        np.testing.assert_array_equal(np.asarray(cache.position), [T + len(o) - 1 for o in out])
    return np.array([o[:NEW_TOKENS] for o in out]), true_new[:, :NEW_TOKENS], cache, checked


# Each state on two fixtures by default (each fixture under two of the states, both layer types under
# every state), the other pairs `slow`.
DEFAULT_PAIRS = {(4, 4): ("nemotron_h_tiny", "qwen3_next_tiny"), (8, 7): ("mamba2_tiny", "qwen3_5_tiny"),
                 (None, 3): ("mamba2_tiny", "qwen3_5_tiny")}
SPEC_CASES = [pytest.param(L, W, name, marks=() if name in DEFAULT_PAIRS[(L, W)] else pytest.mark.slow,
                           id=f"{f'replay-L{L}-W{W}' if L else f'standard-W{W}'}-{name}")
              for L, W in STATES for name in FIXTURES]


@pytest.mark.parametrize(("replay_buffer_len", "window", "name"), SPEC_CASES)
def test_speculative_greedy_equals_greedy(name, replay_buffer_len, window):
    tokens, want, cache, checked = speculative_greedy(name, replay_buffer_len, window, "xla")
    np.testing.assert_array_equal(tokens, want)
    assert checked >= NEW_TOKENS
    kinds = {type(s) for s in cache.layers} - {KVCache, type(None)}
    assert kinds == {ReplayLayerState if replay_buffer_len else SSMLayerState}


@pytest.mark.parametrize(("replay_buffer_len", "window"), [(4, 4), (None, 3)], ids=["replay-L4-W4", "standard-W3"])
def test_speculative_greedy_interpret(replay_buffer_len, window):
    tokens, want, _, _ = speculative_greedy("qwen3_5_tiny", replay_buffer_len, window, "interpret")
    np.testing.assert_array_equal(tokens, want)


def test_verify_and_commit_errors():
    """Bad windows and counts raise before any op runs, naming the argument; the cache stays usable."""
    name = "qwen3_5_tiny"
    model, ref = get_model(name), reference(name)
    graphdef, params = split_params(model)
    prompt = jnp.asarray(ref["prompt_ids"])
    T = prompt.shape[1]
    _, cache = make_prefill(graphdef, max_len=T + 2, replay_buffer_len=2, max_window=2)(params, prompt)
    assert cache.layers[3].length.tolist() == [T, T] and cache.layers[3].max_len == T + 3
    tokens = jnp.asarray(ref["generated_ids"][:, T:T + 3])
    with pytest.raises(ValueError, match="max_window = 2"):
        model.verify(tokens, cache)
    with pytest.raises(ValueError, match=r"`tokens` must have shape \[batch, seqlen\]"):
        model.verify(tokens[:, 0], cache)
    with pytest.raises(ValueError, match="no pending verify window"):
        model.commit(cache, jnp.array([1, 1]))
    with pytest.raises(ValueError, match="`max_window` must be <= replay_buffer_len = 2"):
        model.prefill(prompt, T + 2, replay_buffer_len=2, max_window=3)
    with pytest.raises(ValueError, match="`max_window` must be an int >= 1"):
        model.prefill(prompt, T + 2, max_window=0)
    _, small = make_prefill(graphdef, max_len=T + 2, replay_buffer_len=1, max_window=1)(params, prompt)
    with pytest.raises(ValueError, match="max_window = 1"):
        model.verify(tokens[:, :2], small)
    verify = make_verify_step(graphdef, donate_cache=False)
    logits, pending = verify(params, cache, tokens[:, :2])
    with pytest.raises(ValueError, match="pending verify window"):
        model.verify(tokens[:, :2], pending)
    with pytest.raises(ValueError, match="pending verify window"):
        model.decode(tokens[:, 0], pending)
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 2\]"):
        model.commit(pending, jnp.array([3, 1]))
    with pytest.raises(TypeError, match="`num_accepted` must have an integer dtype"):
        model.commit(pending, jnp.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="`path` is for a draft tree's window; the pending window is a chain's"):
        model.commit(pending, jnp.array([2, 2]), jnp.array([[0, 1], [0, 1]]))
    with pytest.raises(ValueError, match=r"`tokens` must have 2 rows, the cache's batch; got shape \(3, 2\)"):
        model.verify(jnp.ones((3, 2), jnp.int32), cache)
    committed = model.commit(pending, jnp.array([2, 2]))  # the failed calls left `pending` usable
    assert committed.position.tolist() == [T + 2, T + 2] and committed.layers[3].length.tolist() == [T + 2] * 2
    with pytest.raises(ValueError, match="KV cache holds 14 of max_len = 15"):
        model.verify(tokens[:, :2], committed)
    assert np.max(np.abs(np.asarray(logits[:, 0]) - ref["step_logits"][1])) < TOL["float32"]


# The standard state by default: the hidden states are the final norm's output whatever the state, and
# ReplaySSM's verify with them runs by default in the MTP head's speculative loops (tests/test_speculative_loop.py,
# nemotron_h_tiny at L = 8); ReplaySSM `slow` here.
@pytest.mark.parametrize("replay_buffer_len", [pytest.param(4, id="replay-L4", marks=pytest.mark.slow),
                                               pytest.param(None, id="standard")])
def test_verify_returns_the_final_normed_hidden_states(replay_buffer_len):
    """`verify(return_hidden=True)`: the same logits and cache, and the hidden states after the final
    norm at the W positions, those of a prefill over the longer sequence (the MTP head's input)."""
    name, window = "mamba2_tiny", 3
    model, ref = get_model(name), reference(name)
    graphdef, params = split_params(model)
    prompt, gen = ref["prompt_ids"], ref["generated_ids"]
    T = prompt.shape[1]
    _, cache = make_prefill(graphdef, max_len=T + window, replay_buffer_len=replay_buffer_len,
                            last_logits_only=True, max_window=window)(params, jnp.asarray(prompt))
    tokens = jnp.asarray(gen[:, T:T + window])
    logits, pending = make_verify_step(graphdef, donate_cache=False)(params, cache, tokens)
    logits_h, hidden, pending_h = make_verify_step(graphdef, donate_cache=False, return_hidden=True)(
        params, cache, tokens)
    np.testing.assert_array_equal(np.asarray(logits_h), np.asarray(logits))
    assert jax.tree.structure(pending_h) == jax.tree.structure(pending)
    for a, b in zip(jax.tree.leaves(pending_h), jax.tree.leaves(pending)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hidden.shape == (prompt.shape[0], window, model.config.hidden_size)
    _, full, _ = make_prefill(graphdef, max_len=T + window, last_logits_only=True, return_hidden=True)(
        params, jnp.asarray(gen[:, :T + window]))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, T:]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(model._lm_head(hidden)), np.asarray(logits), atol=1e-5)
