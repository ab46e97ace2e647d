"""The drafters with a state in the speculative loop (`replayssm_jax.speculative.Drafter`): the draft
model's drafts against its greedy continuation, the MTP head's cache against one head pass over the
committed sequence after a loop with ragged prompts, and the draft model's compatibility checks.

The generation-level tests (greedy output equals plain greedy output on every fixture, sampling,
the command) are in tests/test_speculative_loop.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generation import DATA, model
from test_mtp import with_mtp_tensors

from models import load_model, split_params
from models.mtp import MTPDrafter, mtp_forward
from replayssm_jax.sampling import SamplingParams
from replayssm_jax.speculative import DraftStart, SpeculativeCarry, make_block
from replayssm_jax.speculative.draft_model import DraftModelDrafter, check_draft_model, tokenizer_vocabulary


_forward = jax.jit(lambda graphdef, params, ids: nnx.merge(graphdef, params)(ids), static_argnums=0)


def greedy_continuation(m, row, n, width=32):
    """The n greedy tokens after `row` (a 1-D id array) by full causal forwards of a fixed width
    (the model is causal: the zeros after the known tokens change nothing before them)."""
    graphdef, params = split_params(m)
    forward = lambda p, x: _forward(graphdef, p, x)  # noqa: E731
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(row)] = row
    for t in range(len(row), len(row) + n):
        ids[0, t] = int(np.argmax(np.asarray(forward(params, jnp.asarray(ids)))[0, t - 1]))
    return ids[0, len(row):len(row) + n]


@pytest.mark.parametrize("state, L", [("replay", 4), ("standard", None)])
def test_draft_model_drafts_are_its_greedy_continuation(state, L, rng):
    """After the prefill (one new token to consume) and after rounds that kept m = 1..W tokens per row
    (the rows differently), the K drafts are the draft model's greedy tokens after the known history."""
    m = model("mamba2_tiny")
    K, P, rows = 3, 6, 2
    drafter = DraftModelDrafter.for_model(m, K, replay_buffer_len=L)
    history = rng.integers(0, 256, (rows, 32)).astype(np.int32)
    start = DraftStart(history=jnp.asarray(history), hidden=None, key=jax.random.key(0), prefix_len=P)
    cache = jax.jit(lambda d, s: d.init_state(None, s))(drafter, start)
    draft = jax.jit(lambda d, c, h, n: d.draft(None, c, h, n, jax.random.key(0)))
    lengths = np.array([P + 1, P + 1])
    for kept in ([0, 0], [4, 1], [2, 3], [1, 4]):  # the m of the previous round, per row (the first: the prefill)
        lengths = lengths + np.array(kept)
        drafts, cache = draft(drafter, cache, jnp.asarray(history), jnp.asarray(lengths, jnp.int32))
        np.testing.assert_array_equal(np.asarray(cache.position), lengths)
        np.testing.assert_array_equal(np.asarray(drafts.num_drafts), [K, K])
        assert drafts.q_probs is None
        for b in range(rows):
            want = greedy_continuation(m, history[b, :lengths[b]], K)
            np.testing.assert_array_equal(np.asarray(drafts.tokens[b]), want, err_msg=f"row {b}, kept {kept}")


def test_mtp_head_cache_follows_the_target_through_the_loop(tmp_path):
    """Greedy rounds with ragged prompts (row 0's last 5 prompt tokens forced, so it keeps up to W
    positions a round) until both rows are done, and then more rounds: the head's cache length is
    the target's position per row, and its K / V entries are one head pass over the committed
    sequence (the target's final-normed hidden states, the tokens one position later)."""
    m = load_model(with_mtp_tensors("nemotron_h_tiny", tmp_path), mtp=True)
    graphdef, params = split_params(m)
    K, W, P, new, L = 3, 4, 7, 8, 4
    ref = np.load(DATA / "nemotron_h_tiny" / "reference.npz")
    prompt = ref["prompt_ids"]
    lengths = np.array([prompt.shape[1], P], np.int32)
    width = 48
    history = np.zeros((2, width), np.int32)
    history[0, :lengths[0]], history[1, :P] = prompt[0], prompt[1, :P]
    prefill = jax.jit(lambda p, ids: nnx.merge(graphdef, p).prefill(
        ids, width - W, replay_buffer_len=L, max_window=W, last_logits_only=True, return_hidden=True))
    logits, hidden, cache = prefill(params, jnp.asarray(history[:, :P]))
    history[1, P] = int(np.argmax(np.asarray(logits[1])))
    drafter = MTPDrafter.for_model(m, K)
    start = DraftStart(history=jnp.asarray(history), hidden=hidden, key=jax.random.key(0), prefix_len=P)
    state = jax.jit(lambda p, d, s: d.init_state(nnx.merge(graphdef, p), s))(params, drafter, start)
    np.testing.assert_array_equal(np.asarray(state.cache.length), [P, P])
    known = np.maximum(lengths, P + 1)
    carry = SpeculativeCarry(cache=cache, history=jnp.asarray(history), known=jnp.asarray(known),
                             done=jnp.zeros(2, bool), rounds=jnp.zeros((), jnp.int32), accepted=jnp.zeros(2, jnp.int32),
                             row_rounds=jnp.zeros(2, jnp.int32), key=jax.random.key(0), drafter_state=state)
    block = make_block(graphdef, rounds=64, max_new_tokens=new, sampling=SamplingParams(), pad_id=0)
    carry = block(params, drafter, carry, jnp.asarray(lengths), jnp.full((4,), -1, jnp.int32))
    assert bool(np.all(np.asarray(carry.done)))
    position = np.asarray(carry.cache.position)
    head = carry.drafter_state.cache
    np.testing.assert_array_equal(np.asarray(head.length), position)
    seq = np.asarray(carry.history)
    n = int(position.max())
    forward = jax.jit(lambda p, ids: nnx.merge(graphdef, p).prefill(ids, ids.shape[1], return_hidden=True)[1])
    full_hidden = forward(params, jnp.asarray(seq[:, :n + 1]))
    empty = drafter.init_cache(2, n)
    _, _, full = jax.jit(lambda p, h, t, c: mtp_forward(nnx.merge(graphdef, p), h, t, c))(
        params, full_hidden[:, :n], jnp.asarray(seq[:, 1:n + 1]), empty)
    for got, want in zip(head.layers, full.layers):
        if got is None:
            continue
        for b in range(2):
            p = position[b]
            np.testing.assert_allclose(np.asarray(got.k[b, :p]), np.asarray(want.k[b, :p]), atol=1e-4)
            np.testing.assert_allclose(np.asarray(got.v[b, :p]), np.asarray(want.v[b, :p]), atol=1e-4)


def _tokenizer(folder, vocab, added=()):
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": list(added)}))
    return folder


def test_check_draft_model(tmp_path):
    target = model("mamba2_tiny").config
    other = model("qwen3_5_tiny").config
    check_draft_model(target, other)  # the same vocab_size
    small = type("Config", (), {"vocab_size": 128})()
    with pytest.raises(ValueError, match=r"the draft model \(d\) has vocab_size = 128; the target \(t\) has 256"):
        check_draft_model(target, small, target_checkpoint="t", draft_checkpoint="d")
    a = _tokenizer(tmp_path / "a", {"x": 0, "y": 1}, [{"id": 2, "content": "<eos>"}])
    same = _tokenizer(tmp_path / "same", {"y": 1, "x": 0}, [{"id": 2, "content": "<eos>"}])
    unigram = _tokenizer(tmp_path / "unigram", [["x", -1.0], ["y", -2.0]], [{"id": 2, "content": "<eos>"}])
    added = _tokenizer(tmp_path / "added", {"x": 0, "y": 1}, [{"id": 3, "content": "<eos>"}])
    assert tokenizer_vocabulary(a) == {"x": 0, "y": 1, "<eos>": 2} == tokenizer_vocabulary(unigram)
    assert tokenizer_vocabulary(tmp_path) is None
    for folder in (same, unigram, tmp_path):  # equal vocabularies, or a folder without tokenizer.json
        check_draft_model(target, other, target_checkpoint=a, draft_checkpoint=folder)
    with pytest.raises(ValueError, match=rf"the draft model's tokenizer \({added}/tokenizer.json\) differs from "
                                         rf"the target's \({a}/tokenizer.json\): 1 tokens have another id or are "
                                         rf"missing, e.g. '<eos>': id 3 in the draft's, 2 in the target's"):
        check_draft_model(target, other, target_checkpoint=a, draft_checkpoint=added)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad/tokenizer.json: not a tokenizer.json with a vocabulary"):
        check_draft_model(target, other, target_checkpoint=a, draft_checkpoint=tmp_path / "bad")


def test_draft_model_drafter_arguments():
    m = model("mamba2_tiny")
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be >= 1; got 0"):
        DraftModelDrafter.for_model(m, 0)
    with pytest.raises(ValueError, match=r"`num_speculative_tokens` \+ 1 = 5 verified positions must be <= "
                                         r"`replay_buffer_len` = 4"):
        DraftModelDrafter.for_model(m, 4, replay_buffer_len=4)
    with pytest.raises(TypeError, match="`sampling` must be a SamplingParams; got float"):
        DraftModelDrafter.for_model(m, 2, sampling=0.5)
    with pytest.raises(TypeError, match="`model` must be a model of this package"):
        DraftModelDrafter.for_model("mamba2_tiny", 2)
    drafter = DraftModelDrafter.for_model(m, 3, replay_buffer_len=4)
    assert drafter.window == 4 and not drafter.needs_hidden
    assert drafter.weights_bytes == sum(x.nbytes for x in jax.tree.leaves(split_params(m)[1]))
