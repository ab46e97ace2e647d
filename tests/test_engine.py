"""The continuous-batching engine (replayssm_jax.engine): requests of different prompt lengths arriving
at different steps, more of them than slots, prefilled in chunks and decoded in one compiled step with
padding rows, get the greedy tokens the fixed-batch Generator gives them; prefix caching skips the
shared prefix's prefill and changes no token."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model
from models.random_init import init_model
from replayssm_jax.engine import Engine, EngineError
from replayssm_jax.generation import Generator, SpeculativeConfig
from replayssm_jax.sampling import SamplingParams

DATA = Path(__file__).parent / "data"
CHUNK = 8
# (arrival step, prompt length, max_new_tokens): 5 requests for 3 slots; prompts of one, two and three
# chunks (whole chunks and a rest of 4: few prefill shapes to compile).
REQUESTS = [(0, 12, 6), (0, 4, 9), (1, 20, 3), (4, 4, 7), (4, 12, 5)]


@pytest.fixture(scope="module")
def model():
    return load_model(DATA / "nemotron_h_tiny")


def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, size=n).tolist() for _, n, _ in REQUESTS]


def _run(engine, prompts, stops=None, samplings=None):
    """Outputs by request id, the requests added at their arrival steps; `stops`: {request: its stop id};
    `samplings`: {request: its SamplingParams} (the others greedy)."""
    stops, samplings = stops or {}, samplings or {}
    outputs, step = {}, 0
    while step <= max(r[0] for r in REQUESTS) or engine.num_unfinished:
        for i, (arrival, _, new) in enumerate(REQUESTS):
            if arrival == step:
                stop_ids = (stops[i],) if stops.get(i) is not None else ()
                assert engine.add_request(prompts[i], new, stop_ids=stop_ids, sampling=samplings.get(i)) == i
        outputs.update({o.request_id: o for o in engine.step()})
        step += 1
    return outputs


@pytest.fixture(scope="module")
def generated(model):
    """(prompts, each request's greedy tokens from one fixed-batch Generator run (ReplaySSM, L = 4) of
    the longest max_new_tokens)."""
    prompts = _prompts(0)
    generator = Generator(model, state="replay", buffer_len=4, backend="xla")
    out = generator.generate(prompts, max(r[2] for r in REQUESTS), progress=False, stop_tokens=())
    return prompts, [list(sequence[len(prompt):]) for prompt, sequence in zip(prompts, out.sequences)]


def _expected(prompts, tokens, stops=None):
    """Each request's sequence: its prompt and Generator tokens cut at its max_new_tokens (and after its stop
    token, `stops`: {request: its stop id})."""
    stops = stops or {}
    expected = []
    for i, (prompt, (_, _, new), generated) in enumerate(zip(prompts, REQUESTS, tokens)):
        generated = generated[:new]
        if stops.get(i) in generated:
            generated = generated[:generated.index(stops[i]) + 1]
        expected.append(list(prompt) + generated)
    return expected


@pytest.mark.parametrize("state", ["replay", "standard"])
def test_engine_gives_the_generator_tokens(model, generated, state):
    """5 requests, 3 slots, a decode batch of 3: every request's sequence is the Generator's (greedy; the
    standard state's and ReplaySSM's are the same tokens); the long prompt takes 3 prefill steps while
    the others decode. ReplaySSM: request 2 stops at its stop token, its second generated one."""
    prompts, tokens = generated
    stop = tokens[2][1] if state == "replay" else None
    engine = Engine(model, 3, state=state, buffer_len=4 if state == "replay" else None, prefill_chunk=CHUNK,
                    max_len=40, backend="xla")
    outputs = _run(engine, prompts, {2: stop})
    assert [outputs[i].sequence for i in range(len(REQUESTS))] == _expected(prompts, tokens, {2: stop})
    reasons = ["stop" if i == 2 and stop is not None else "length" for i in range(len(REQUESTS))]
    assert [outputs[i].finish_reason for i in range(len(REQUESTS))] == reasons
    if stop is not None:
        assert outputs[2].num_generated == tokens[2].index(stop) + 1 <= 2
    assert engine.stats["prefill_tokens"] == sum(n for _, n, _ in REQUESTS)
    assert engine.pool.free_slots == 3


K = 2  # drafts per speculative round: W = 3 verified positions (<= L = 4)
# By default the oracle (every draft accepted, and none) on ReplaySSM and the n-gram drafter on the standard
# state; the oracle on the standard state and the n-gram drafter on ReplaySSM `slow`: the standard state's
# verify and commit over the pool run in the n-gram case, and the n-gram rounds on ReplaySSM by default in
# test_speculative_sampling_depends_on_the_request_only (its greedy requests get the Generator's tokens).
_SPECULATIVE_DEFAULT = {("oracle-all", "replay"), ("oracle-none", "replay"), ("ngram", "standard")}
SPECULATIVE_CASES = [pytest.param(method, alpha, state, id=f"{drafter}-{state}",
                                  marks=() if (drafter, state) in _SPECULATIVE_DEFAULT else pytest.mark.slow)
                     for state in ("replay", "standard")
                     for method, alpha, drafter in (("oracle", 1.0, "oracle-all"), ("oracle", 0.0, "oracle-none"),
                                                    ("ngram", 1.0, "ngram"))]


@pytest.mark.parametrize("method, alpha, state", SPECULATIVE_CASES)
def test_speculative_engine_gives_the_generator_tokens(model, generated, state, method, alpha):
    """Speculative rounds over the pool (K = 2, W = 3): every request's sequence is the plain greedy
    Generator's, token for token, with the oracle drafting each request's own greedy continuation at alpha 1
    (every draft accepted: ceil((n - 1) / W) rounds for n tokens) and alpha 0 (none: n - 1 rounds), and with
    the n-gram drafter reading each slot's history."""
    prompts, tokens = generated
    engine = Engine(model, 3, state=state, buffer_len=4 if state == "replay" else None, prefill_chunk=CHUNK,
                    max_len=40, backend="xla", speculative=SpeculativeConfig(method, K, alpha=alpha, reference=()))
    references = [list(prompt) + list(generated) for prompt, generated in zip(prompts, tokens)]
    outputs, step = {}, 0
    while step <= max(r[0] for r in REQUESTS) or engine.num_unfinished:
        for i, (arrival, _, new) in enumerate(REQUESTS):
            if arrival == step:
                options = dict(draft_reference=references[i]) if method == "oracle" else {}
                assert engine.add_request(prompts[i], new, **options) == i
        outputs.update({o.request_id: o for o in engine.step()})
        step += 1
    assert [outputs[i].sequence for i in range(len(REQUESTS))] == _expected(prompts, tokens)
    assert engine.pool.free_slots == 3
    if method == "oracle":
        rounds = [-(-(new - 1) // (K + 1)) if alpha == 1.0 else new - 1 for _, _, new in REQUESTS]
        assert engine.stats["round_rows"] == sum(rounds)


def test_speculative_sampling_depends_on_the_request_only(model, generated):
    """A sampled request (speculative sampling's rejection rule, its draws keyed by its id and token index)
    in n-gram rounds: the same sequence among the other requests as alone (after three one-token requests
    that finish at their prefill, so that it keeps its id), within max_new_tokens; the greedy requests keep
    the Generator's tokens."""
    prompts, tokens = generated
    options = dict(buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla",
                   speculative=SpeculativeConfig("ngram", K))
    sampling = SamplingParams(temperature=1.0)
    among = _run(Engine(model, 3, **options), prompts, samplings={3: sampling})
    alone = Engine(model, 3, **options)
    assert [alone.add_request([3], 1) for _ in range(3)] + [alone.add_request(prompts[3], REQUESTS[3][2],
                                                                              sampling=sampling)] == [0, 1, 2, 3]
    assert alone.run_until_done()[3].sequence == among[3].sequence
    assert among[3].num_generated == REQUESTS[3][2]
    expected = _expected(prompts, tokens)
    assert [among[i].sequence for i in (0, 1, 2, 4)] == [expected[i] for i in (0, 1, 2, 4)]


def test_staggered_stops_free_slots_that_new_requests_reuse(model, generated):
    """Stop tokens end requests 0, 1 and 3 at their 3rd, 2nd and 4th tokens while the others are admitted
    into 2 slots: the step dispatched before the host reads a stop token computes one more token of the
    stopped request (dropped), and the request admitted into its slot is written after that step; every
    sequence is the Generator's, cut at its stop token."""
    prompts, tokens = generated
    stops = {0: tokens[0][2], 1: tokens[1][1], 3: tokens[3][3]}
    engine = Engine(model, 2, buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla")
    outputs = _run(engine, prompts, stops)
    assert [outputs[i].sequence for i in range(len(REQUESTS))] == _expected(prompts, tokens, stops)
    assert [outputs[i].finish_reason for i in range(len(REQUESTS))] == ["stop", "stop", "length", "stop", "length"]
    assert engine.pool.free_slots == 2 and all(len(o.token_s) == o.num_generated for o in outputs.values())


MIXED = {1: SamplingParams(0.8, top_k=5), 2: SamplingParams(1.0, top_p=0.9), 3: SamplingParams(1.0),
         4: SamplingParams(0.5, top_k=3, top_p=0.8)}


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", K)], ids=["decode", "ngram"])
def test_mixed_sampling_compiles_one_step(model, generated, speculative):
    """Requests of four different SamplingParams and a greedy one, 4 slots and a batch of 2 rows (the
    running requests take turns, so the batch's mix changes every step): one compiled decode step (or
    speculative round) serves every mix; each sampled request draws the tokens it draws alone (its draws
    keyed by its id and token index; alone after one-token requests that keep its id), the greedy one
    gets the Generator's tokens."""
    prompts, tokens = generated
    options = dict(buffer_len=4, batch_size=2, prefill_chunk=CHUNK, max_len=40, backend="xla",
                   speculative=speculative)
    engine = Engine(model, 4, **options)
    step = engine._decode if speculative is None else engine._round
    before = step._cache_size()
    among = _run(engine, prompts, samplings=MIXED)
    assert step._cache_size() - before == 1
    assert among[0].sequence == _expected(prompts, tokens)[0]
    for i, sampling in MIXED.items():
        alone = Engine(model, 4, **options)
        ids = [alone.add_request([3], 1) for _ in range(i)] + [alone.add_request(prompts[i], REQUESTS[i][2],
                                                                                 sampling=sampling)]
        assert ids == list(range(i + 1))
        assert alone.run_until_done()[i].sequence == among[i].sequence, i
        assert among[i].num_generated == REQUESTS[i][2]


def test_int8_checkpoints_give_each_request_its_tokens_alone(model):
    """An engine of int8 ReplaySSM checkpoints (the pool's scales and write counts indexed by slot): every
    request's greedy sequence is the one `Generator(state_dtype=int8)` gives it alone (batch 1: the same
    prefill, flushes and requantizations)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, size=4).tolist() for _ in range(4)]  # one prefill shape: few compilations
    engine = Engine(model, 2, buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla", state_dtype="int8")
    assert [engine.add_request(prompt, 9) for prompt in prompts] == [0, 1, 2, 3]  # 2 slots: 2 and 3 wait
    outputs = engine.run_until_done()
    generator = Generator(model, state="replay", buffer_len=4, backend="xla", state_dtype="int8")
    alone = [list(generator.generate([prompt], 9, progress=False, stop_tokens=()).sequences[0]) for prompt in prompts]
    assert [o.sequence for o in outputs] == alone


@pytest.mark.parametrize("store", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_prefix_caching_skips_the_shared_prefix(model, store):
    """Prompts sharing a system prompt of one block (+ 4 tokens): the later requests restore the block's
    state and prefill only the rest; every sequence equals the engine's without the cache (whose decode
    batch of 2 rows serves 3 slots in turns; a sampled request draws the same tokens)."""
    rng = np.random.default_rng(1)
    system = rng.integers(3, 250, size=CHUNK + 4).tolist()
    tail = lambda n: rng.integers(3, 250, size=n).tolist()  # noqa: E731
    # Request 0 is the system prompt; 2 and 4 continue its first block; 1 and 3 share nothing.
    prompts = [system, tail(4), system + tail(8), tail(4), system[:CHUNK] + tail(4)]
    cached = Engine(model, 3, buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla", prefix_caching=True,
                    prefix_store=store)
    # Without the cache, and a decode batch of 2 for 3 slots (the running requests take turns).
    plain = Engine(model, 3, buffer_len=4, batch_size=2, prefill_chunk=CHUNK, max_len=40, backend="xla")
    sampling = SamplingParams(temperature=1.0)  # request 3 samples: its draws depend on its id and logits only
    samplings = {3: sampling}
    with_cache, without = _run(cached, prompts, samplings=samplings), _run(plain, prompts, samplings=samplings)
    assert [with_cache[i].sequence for i in range(len(REQUESTS))] == [without[i].sequence for i in range(len(REQUESTS))]
    assert [with_cache[i].cached_tokens for i in range(len(REQUESTS))] == [0, 0, CHUNK, 0, CHUNK]
    assert cached.stats["prefill_tokens"] == plain.stats["prefill_tokens"] - cached.stats["cached_tokens"]
    # Two requests admitted in one step: the second restores the block that the first one's prefill kept
    # just before it (the cache is looked up at a request's first prefill chunk, not at its admission).
    block = rng.integers(3, 250, size=CHUNK).tolist()
    pair = [block + tail(4), block + tail(4)]
    for engine in (cached, plain):
        assert [engine.add_request(prompt, 3) for prompt in pair] == [5, 6]
    with_cache, without = cached.run_until_done(), plain.run_until_done()
    assert [o.sequence for o in with_cache] == [o.sequence for o in without]
    assert [o.cached_tokens for o in with_cache] == [0, CHUNK]


def test_bad_requests_and_options(model):
    """Bad options and requests: EngineError naming the argument, nothing queued."""
    with pytest.raises(EngineError, match="`state`"):
        Engine(model, 2, state="paged")
    with pytest.raises(EngineError, match="`batch_size` must be <= capacity"):
        Engine(model, 2, batch_size=3, backend="xla")
    with pytest.raises(EngineError, match="`route` must be one of .*; got 'fast'"):
        Engine(model, 2, route="fast", backend="xla")
    with pytest.raises(EngineError, match="`prefix_store` must be 'device' or 'host'; got 'disk'"):
        Engine(model, 2, prefix_caching=True, prefix_store="disk", backend="xla")
    with pytest.raises(EngineError, match="needs prefix_caching=True; got prefix_store='host' with prefix_caching=False"):
        Engine(model, 2, prefix_store="host", backend="xla")
    with pytest.raises(EngineError, match="`prefix_caching` must be a bool; got 'no'"):
        Engine(model, 2, prefix_caching="no", backend="xla")
    for seed in (-1, 2**32, 1.5, True):
        with pytest.raises(EngineError, match=r"`seed` must be an int in \[0, 2\*\*32 - 1\]"):
            Engine(model, 2, seed=seed, backend="xla")
    for speculative, match in [
            (SpeculativeConfig("ngram", 4), r"`speculative.num_draft` \+ 1 = 5 .* <= `buffer_len` = 4"),
            (SpeculativeConfig("mtp", 2), "'mtp' is not supported by the Engine.*runs 'ngram', 'oracle'"),
            (SpeculativeConfig("ngram", 2, tree=(2, 2)), "`speculative.tree`"),
            (SpeculativeConfig("oracle", 2, reference=[[1, 2]]), "`speculative.reference` must be empty"),
            ("ngram", "`speculative` must be a SpeculativeConfig")]:
        with pytest.raises(EngineError, match=match):
            Engine(model, 2, buffer_len=4, backend="xla", speculative=speculative)
    with pytest.raises(EngineError, match="`state_dtype` applies to state 'replay'"):
        Engine(model, 2, state="standard", backend="xla", state_dtype="int8")
    oracle = Engine(model, 2, buffer_len=4, max_len=16, backend="xla",
                    speculative=SpeculativeConfig("oracle", 2, reference=()))
    with pytest.raises(EngineError, match="`draft_reference` is required"):
        oracle.add_request([3], 4)
    with pytest.raises(EngineError, match="`draft_reference` has token id 999"):
        oracle.add_request([3], 4, draft_reference=[3, 999])
    engine = Engine(model, 2, buffer_len=4, max_len=16, backend="xla")
    with pytest.raises(EngineError, match="`draft_reference` applies to speculative method 'oracle' only; the "
                                          "engine runs no speculation"):
        engine.add_request([3], 4, draft_reference=[3, 4])
    with pytest.raises(EngineError, match="empty"):
        engine.add_request([], 4)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request([3, 999], 4)
    for prompt, match in [([1.7, 2], "integer token ids; got dtype float64"),
                          ([[1, 2], [3, 4]], r"1-D .*shape \(2, 2\)"), ("abc", "got a str")]:
        with pytest.raises(EngineError, match=f"`prompt_ids` must .*{match}"):
            engine.add_request(prompt, 4)
    with pytest.raises(EngineError, match=r"`stop_ids` must be a 1-D .*shape \(2, 1\)"):
        engine.add_request([3], 4, stop_ids=[[5], [6]])
    with pytest.raises(EngineError, match=r"`stop_ids` must be a 1-D sequence of integer token ids; got the scalar "
                                          r"True"):
        engine.add_request([3], 4, stop_ids=True)
    with pytest.raises(EngineError, match=r"`request_id` must be an id that add_request returned \(none yet: no "
                                          r"request has been added\); got 0"):
        engine.abort(0)
    with pytest.raises(EngineError, match=r"`stop_ids` has token id 999 outside the vocabulary"):
        engine.add_request([3], 4, stop_ids=999)
    with pytest.raises(EngineError, match=r"`stop_ids` has token id 999 outside the vocabulary"):
        engine.add_request([3], 4, stop_ids=[999])
    with pytest.raises(EngineError, match="max_len = 16"):
        engine.add_request([3] * 10, 7)
    with pytest.raises(EngineError, match="`max_new_tokens`"):
        engine.add_request([3], 0)
    assert engine.num_unfinished == oracle.num_unfinished == 0
    assert engine.add_request([3], 2, stop_ids=None) == 0  # None: no stop ids, as ()
    assert engine.add_request([3], 2, stop_ids=5) == 1  # one id, as Generator's stop_tokens
    assert engine._waiting[-1].stop_ids == {5}
    assert engine.add_request([3], 2, stop_ids=jnp.int32(6)) == 2  # a 0-d integer array: one id too
    assert engine._waiting[-1].stop_ids == {6}
    for not_a_model in ("tests/data/nemotron_h_tiny", None):
        with pytest.raises(EngineError, match=r"`model` must be a model of this package \(with `prefill`, `decode` "
                                              r"and `config`"):
            Engine(not_a_model, 2, backend="xla")
    abstract = nnx.eval_shape(lambda: init_model(DATA / "nemotron_h_tiny", jnp.float32))
    with pytest.raises(EngineError, match=r"`model` is abstract \(its parameters are shapes only"):
        Engine(abstract, 2, backend="xla")
    with pytest.raises(TypeError, match="`buffer_dtype` must be a floating dtype; got int32"):
        Engine(model, 2, buffer_len=4, max_len=16, backend="xla", buffer_dtype=jnp.int32)


def test_abort_frees_the_slot_and_keeps_the_other_requests_tokens(model, generated):
    """Requests ended by `abort` while waiting, prefilling (after the first of its three chunks) and
    decoding (a dispatched step holding it, whose token is dropped): each returns its sequence so far,
    finish reason "abort", and frees its slot; a request admitted into that slot and the one that ran
    beside them get the Generator's tokens; an ended request's abort returns None, an unknown id raises
    before anything changes."""
    prompts, tokens = generated
    expected = _expected(prompts, tokens)
    engine = Engine(model, 2, buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla")
    ids = [engine.add_request(prompts[i], REQUESTS[i][2]) for i in range(4)]  # 0, 1 admitted; 2, 3 wait
    outputs = {}
    for _ in range(4):  # 0: two chunks; 1: one chunk, then decoding
        outputs.update({o.request_id: o for o in engine.step()})
    decoding = engine._decoding
    assert decoding is not None and ids[1] in [r.request_id for r in decoding.rows]
    aborted = {ids[1]: engine.abort(ids[1]), ids[3]: engine.abort(ids[3])}  # decoding; waiting
    assert engine.pool.free_slots == 1
    outputs.update({o.request_id: o for o in engine.step()})  # 2 admitted: its first chunk of three
    assert engine.pool.free_slots == 0 and engine._prefilling[0].request_id == ids[2]
    aborted[ids[2]] = engine.abort(ids[2])
    for request_id in (-1, 4, True, "0"):
        with pytest.raises(EngineError, match="`request_id` must be an id that add_request returned"):
            engine.abort(request_id)
    assert engine.num_unfinished == 1 and engine.pool.free_slots == 1
    assert engine.add_request(prompts[4], REQUESTS[4][2]) == 4  # into the freed slot
    outputs.update({o.request_id: o for o in engine.run_until_done()})
    assert sorted(outputs) == [0, 4] and [outputs[i].sequence for i in (0, 4)] == [expected[0], expected[4]]
    for request_id, output in aborted.items():
        assert output.finish_reason == "abort" and output.request_id == request_id
        assert output.sequence == expected[request_id][: len(output.sequence)]
        assert output.num_generated == len(output.sequence) - len(prompts[request_id]) == len(output.token_s)
    assert aborted[ids[1]].num_generated >= 1 and aborted[ids[2]].num_generated == aborted[ids[3]].num_generated == 0
    assert engine.abort(ids[1]) is None and engine.abort(0) is None
    assert engine.pool.free_slots == 2


@pytest.mark.parametrize("prefix_caching", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_batched_prefill_gives_each_request_its_tokens(model, prefix_caching):
    """prefill_batch = 4: the chunks of up to four requests of one length and kind run in one call (three of
    them padded to 4 rows); every sequence equals the engine's with one request's chunk per step."""
    rng = np.random.default_rng(2)
    system = rng.integers(3, 250, size=CHUNK).tolist()
    prompts = [system + rng.integers(3, 250, size=n).tolist() for n in (4, 4, 9, CHUNK, 4)] + \
        [rng.integers(3, 250, size=n).tolist() for n in (3, 3, 3)]
    samplings = {1: SamplingParams(temperature=1.0, top_k=20)}
    options = dict(buffer_len=4, prefill_chunk=CHUNK, max_len=40, backend="xla", prefix_caching=prefix_caching)
    outputs = []
    for engine in (Engine(model, 6, prefill_batch=4, **options), Engine(model, 6, **options)):
        for i, prompt in enumerate(prompts):
            assert engine.add_request(prompt, 4, sampling=samplings.get(i)) == i
        outputs.append(engine.run_until_done())
        assert engine.stats["prefill_tokens"] + engine.stats["cached_tokens"] == sum(map(len, prompts))
    batched, single = outputs
    assert [o.sequence for o in batched] == [o.sequence for o in single]
