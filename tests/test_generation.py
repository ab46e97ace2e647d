"""Generation on the real fixture checkpoints: greedy tokens equal transformers'
with the standard state and with ReplaySSM, ragged batches equal each prompt
alone, stop tokens and sampling behave, the decode loop updates its states in
place. The command line is tested in test_cli.py."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from hlo_checks import per_step_copies
from models import GenerationConfig, load_generation_config, load_model
from models.random_init import init_model
from replayssm_jax import generation
from replayssm_jax.generation import (GenerationError, Generator, InsufficientMemoryError, SpeculativeConfig,
                                      free_memory, generate)
from replayssm_jax.sampling import SamplingParams, sample_tokens
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

DATA = pathlib.Path(__file__).parent / "data"
FIXTURES = ["mamba2_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_next_tiny"]
# The Generator hands the buffer length to the model only: its own code (buckets, blocks, the donated
# carry) is the same for every L, so the default run takes the standard state and L = 4; L = 1 (a flush
# every step) and L = 16 (a partly filled buffer at the end) are `slow` here, and run by default at the
# model level with the logits (test_models.py::test_decode_matches_transformers).
MODES = [("standard", None, "standard"), ("replay", 4, "replay-L4"), ("replay", 1, "replay-L1"),
         ("replay", 16, "replay-L16")]
# The Generator's path is the same code in every family (the families differ in their layers, which
# test_models.py checks against the reference logits with both states on every fixture): the standard
# state runs by default on one fixture of each layer type (mamba2_tiny and qwen3_5_tiny) and L = 4 on
# nemotron_h_tiny (GDN's ReplaySSM decodes the reference tokens through the Generator by default in
# test_direct_route_tokens_match_transformers[qwen3_5_tiny] and test_stop_tokens_end_only_their_sequence),
# the other cases `slow`; L = 1 and 16 `slow`.
_DEFAULT_GREEDY = {None: ("mamba2_tiny", "qwen3_5_tiny"), 4: ("nemotron_h_tiny",)}
GREEDY_CASES = [pytest.param(name, state, L, id=f"{name}-{mode_id}",
                             marks=() if name in _DEFAULT_GREEDY.get(L, ()) else pytest.mark.slow)
                for name in FIXTURES for state, L, mode_id in MODES]
_MODELS = {}


def model(name):
    if name not in _MODELS:
        _MODELS[name] = load_model(DATA / name)
    return _MODELS[name]


def reference(name):
    return np.load(DATA / name / "reference.npz")


@pytest.mark.parametrize("name, state, L", GREEDY_CASES)
def test_greedy_tokens_match_transformers(name, state, L):
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    gen = Generator(model(name), state=state, buffer_len=L)
    out = gen.generate(prompts, expected.shape[1] - prompts.shape[1])
    np.testing.assert_array_equal(np.array(out.sequences), expected)


def test_generate_has_the_generator_defaults():
    """The one-call `generate` passes its options to `Generator`: the same defaults (route "auto" included)."""
    ours, theirs = inspect.signature(generate).parameters, inspect.signature(Generator).parameters
    shared = ours.keys() & theirs.keys()
    assert {"state", "buffer_len", "buffer_dtype", "backend", "route"} <= shared
    for name in shared - {"model"}:
        assert ours[name].default == theirs[name].default, name


# One fixture per layer type by default (the route is the layers' code, the same in every family that has
# the layer); the other two `slow`.
@pytest.mark.parametrize("name", ["nemotron_h_tiny", "qwen3_5_tiny",
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in ("mamba2_tiny", "qwen3_next_tiny"))])
def test_direct_route_tokens_match_transformers(name):
    """The direct route (the state written every step, the buffer left to speculative decoding) decodes the
    reference's greedy tokens."""
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    out = Generator(model(name), state="replay", buffer_len=4, route="direct").generate(
        prompts, expected.shape[1] - prompts.shape[1])
    np.testing.assert_array_equal(np.array(out.sequences), expected)
    # The default route, "auto", on the kernels (interpreted; at this batch their grids are latency-bound,
    # so it is the direct route: test_kernels.py) decodes the same tokens.
    gen = Generator(model(name), state="replay", buffer_len=4, backend="interpret")
    assert gen.route == "auto"
    out = gen.generate(prompts, expected.shape[1] - prompts.shape[1])
    np.testing.assert_array_equal(np.array(out.sequences), expected)


def _traced_routes(monkeypatch, m) -> list:
    """The `route` of each trace of m's decode (a list the calls append to)."""
    routes, decode = [], type(m).decode

    def traced(self, *args, route="auto", **kw):
        routes.append(route)
        return decode(self, *args, route=route, **kw)

    monkeypatch.setattr(type(m), "decode", traced)
    return routes


# GDN's lockstep by default: test_cli.py's lockstep test decodes qwen3_next_tiny's reference tokens in lockstep
# (its GDN layers on the append and direct routes), test_direct_route_tokens_match_transformers[qwen3_5_tiny]
# takes the default (None) on the kernels; the Generator's cycle is the same code for both layer types.
@pytest.mark.parametrize("name", ["nemotron_h_tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)])
def test_lockstep_decodes_the_reference_tokens(name, monkeypatch):
    """lockstep: each cycle of L steps runs L - 1 steps on the append route (the output route without a flush)
    and then every row's flush as one direct step; L = 3 and blocks of 6 (39 steps: 6 blocks, then one of 4: a
    cycle and a tail of one step). The greedy tokens are transformers'. With the default (None) on the kernels,
    the tiny batch's layers take the direct route (latency-bound grids), so every step is direct and no cycle is
    compiled."""
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    m = model(name)
    routes = _traced_routes(monkeypatch, m)
    gen = Generator(m, state="replay", buffer_len=3, route="output", lockstep=True, block_size=6)
    out = gen.generate(prompts, expected.shape[1] - prompts.shape[1])
    np.testing.assert_array_equal(np.array(out.sequences), expected)
    assert set(routes) == {"append", "direct"}, routes
    assert out.lockstep
    routes.clear()
    gen = Generator(m, state="replay", buffer_len=3, backend="interpret", block_size=6)
    assert gen.lockstep is None  # on where it applies
    assert not gen.generate(prompts[:1, :4], 3).lockstep
    assert set(routes) == {"auto"}, routes


def test_lockstep_errors():
    m = model("mamba2_tiny")
    with pytest.raises(GenerationError, match="block_size = 6 not a multiple of buffer_len = 4"):
        Generator(m, state="replay", buffer_len=4, block_size=6, lockstep=True)
    with pytest.raises(GenerationError, match=r"got state 'standard' \(no buffer\)"):
        Generator(m, state="standard", lockstep=True)
    with pytest.raises(GenerationError, match="route 'direct'"):
        Generator(m, state="replay", buffer_len=4, route="direct", lockstep=True)
    with pytest.raises(GenerationError, match=r"an 8-bit checkpoint \(int8\)"):
        Generator(m, state="replay", buffer_len=4, state_dtype=jnp.int8, lockstep=True)
    with pytest.raises(GenerationError, match="`lockstep` must be True, False or None; got 'yes'"):
        Generator(m, state="replay", buffer_len=4, lockstep="yes")
    # None where it cannot apply: off, silently.
    assert Generator(m, state="replay", buffer_len=4, block_size=6).lockstep is False
    assert Generator(m, state="standard").lockstep is False


@pytest.mark.parametrize("name", ["nemotron_h_tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)])
def test_ragged_batch_equals_each_prompt_alone(name, rng):
    vocab = model(name).config.vocab_size
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (9, 3, 6)]
    gen = Generator(model(name), state="replay", buffer_len=4)
    together = gen.generate(prompts, 10).sequences
    for prompt, row in zip(prompts, together):
        assert gen.generate([prompt], 10).sequences[0] == row


def test_prefill_in_passes_of_rows_gives_the_same_tokens(rng):
    """prefill_rows = 2 for 5 rows (3 passes, the last filled up) == one pass."""
    m = model("nemotron_h_tiny")
    prompts = [rng.integers(3, m.config.vocab_size, size=7).tolist() for _ in range(5)]
    whole = Generator(m, state="replay", buffer_len=4).generate(prompts, 6).sequences
    assert Generator(m, state="replay", buffer_len=4, prefill_rows=2).generate(prompts, 6).sequences == whole
    with pytest.raises(GenerationError, match="`prefill_rows` must be >= 1"):
        Generator(m, prefill_rows=0)


def test_buffer_len_above_the_kernel_limit_is_refused_up_front():
    with pytest.raises(GenerationError, match="`buffer_len` must be <= 64 with backend 'interpret'"):
        Generator(model("nemotron_h_tiny"), state="replay", buffer_len=65, backend="interpret")
    Generator(model("nemotron_h_tiny"), state="replay", buffer_len=65, backend="xla")  # no kernel, no limit


def test_stop_tokens_end_only_their_sequence():
    ref = reference("qwen3_5_tiny")
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    T = prompts.shape[1]
    stop = int(expected[0, T + 5])  # the 6th token of row 0
    gen = Generator(model("qwen3_5_tiny"), state="replay", buffer_len=4, block_size=8)
    out = gen.generate(prompts, 30, stop_tokens=[stop])
    for row in range(2):
        new = expected[row, T : T + 30].tolist()
        cut = new.index(stop) + 1 if stop in new else len(new)
        assert out.sequences[row] == prompts[row].tolist() + new[:cut]
        assert out.num_generated[row] == cut


# `slow`: the sampled decode block runs by default in test_generation_config_gives_the_default_stop_token_and_sampling
# (top-k) and test_sampled_row_does_not_depend_on_the_other_rows (seeded), sample_tokens' top-k and top-p
# filters in test_sample_tokens_stays_in_top_k_and_top_p.
@pytest.mark.slow
def test_sampling_is_seeded_and_respects_top_k():
    ref = reference("nemotron_h_tiny")
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4)
    sampling = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    a = gen.generate(ref["prompt_ids"], 12, sampling=sampling, seed=7).sequences
    b = gen.generate(ref["prompt_ids"], 12, sampling=sampling, seed=7).sequences
    c = gen.generate(ref["prompt_ids"], 12, sampling=sampling, seed=8).sequences
    assert a == b and a != c
    greedy = gen.generate(ref["prompt_ids"], 12).sequences
    assert gen.generate(ref["prompt_ids"], 12, sampling=SamplingParams(1.0, top_k=1), seed=3).sequences == greedy


def test_sampled_row_does_not_depend_on_the_other_rows(rng):
    gen = Generator(model("qwen3_5_tiny"), state="replay", buffer_len=4)
    first, a, b = (rng.integers(3, 256, size=n).tolist() for n in (6, 4, 9))
    sampling = SamplingParams(temperature=1.0)
    with_a = gen.generate([first, a], 8, sampling=sampling, seed=5).sequences
    with_b = gen.generate([first, b], 8, sampling=sampling, seed=5).sequences
    assert with_a[0] == with_b[0]


def test_sample_tokens_stays_in_top_k_and_top_p(rng):
    logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    probs = np.asarray(jax.nn.softmax(logits))
    for i in range(20):
        key = jax.random.key(i)
        t = np.asarray(sample_tokens(logits, key, SamplingParams(1.0, top_k=3)))
        assert all(t[r] in top3[r] for r in range(4))
        t = np.asarray(sample_tokens(logits, key, SamplingParams(1.0, top_p=0.5)))
        for r in range(4):
            order = np.argsort(-probs[r])
            mass_before = np.cumsum(probs[r][order]) - probs[r][order]
            allowed = set(order[mass_before < 0.5].tolist())
            assert t[r] in allowed
    with pytest.raises(ValueError, match=r"`top_p` must be in \(0, 1\]; got 0.0"):
        SamplingParams(1.0, top_p=0.0)
    tiny = np.asarray(sample_tokens(logits, jax.random.key(0), SamplingParams(1e-38)))
    np.testing.assert_array_equal(tiny, np.argmax(np.asarray(logits), axis=-1))  # no overflow to inf


@pytest.mark.parametrize("name", ["nemotron_h_tiny", "qwen3_next_tiny"])
def test_decode_loop_copies_no_checkpoint(name):
    gen = Generator(model(name), state="replay", buffer_len=4, block_size=16)
    ref = reference(name)
    gen.generate(ref["prompt_ids"], 17)  # one block of 16 steps
    (hlo,) = gen.decode_hlo()
    cfg = model(name).config
    prompts = jnp.asarray(ref["prompt_ids"])
    _, cache = jax.eval_shape(lambda ids: model(name).prefill(ids, 32, replay_buffer_len=4), prompts)  # shapes only
    checkpoints = [s.replay.checkpoint for s in cache.layers if hasattr(s, "replay")]
    assert checkpoints and all(isinstance(s.replay, (Mamba2ReplayState, GDNReplayState))
                               for s in cache.layers if hasattr(s, "replay"))
    assert "while" in hlo, "the decode block should compile to a loop"
    for c in checkpoints:  # the checkpoints are in the loop state, so a copy would show
        assert f"f32[{','.join(map(str, c.shape))}]" in hlo
    found = per_step_copies(hlo, checkpoints)
    assert not found, f"{cfg.model_type}: per-step copies of a checkpoint:\n" + "\n".join(found)


def test_generator_errors():
    gen = Generator(model("mamba2_tiny"), state="replay", buffer_len=4)
    with pytest.raises(GenerationError, match=r"prompt 1 has token id 256 outside the vocabulary \[0, 256\)"):
        gen.generate([[1, 2], [3, 256]], 4)
    with pytest.raises(GenerationError, match="prompt 0 is empty"):
        gen.generate([[]], 4)
    with pytest.raises(GenerationError, match="`max_new_tokens` must be >= 0; got -1"):
        gen.generate([[1, 2]], -1)
    with pytest.raises(GenerationError, match=r"<= 2147483647 positions \(int32 positions and cursors\); "
                                              r"got 3000000000 \+ 3 = 3000000003"):
        gen.generate([[1, 2, 3], [4]], 3_000_000_000)  # refused before any array is allocated
    with pytest.raises(GenerationError, match="`buffer_len` must be >= 1; got 0"):
        Generator(model("mamba2_tiny"), state="replay", buffer_len=0)
    with pytest.raises(GenerationError, match="`route` must be one of 'output', 'state', 'direct', 'deferred', 'auto'; got 'fast'"):
        Generator(model("mamba2_tiny"), route="fast")
    with pytest.raises(GenerationError, match="`buffer_dtype` must be a floating dtype"):
        Generator(model("mamba2_tiny"), buffer_dtype=jnp.int32)
    with pytest.raises(GenerationError, match="`prompts` must be a list of token-id sequences; got NoneType"):
        gen.generate(None, 4)
    with pytest.raises(GenerationError, match="prompt 0 is not a flat list of token ids"):
        gen.generate([[1, [2, 3]]], 4)
    with pytest.raises(GenerationError, match=r"prompt 0 is empty or not a flat list of ids \(shape \(\)\) "
                                              r"\(`prompts` is a list of sequences"):
        gen.generate([1, 2, 3], 4)
    with pytest.raises(GenerationError, match=r"prompt 1 must be a sequence of integer token ids; got a string 'abc' "
                                              r"\(tokenize text first"):
        gen.generate([[1, 2], "abc"], 4)
    for sampling in (None, {"temperature": 1.0}):
        with pytest.raises(GenerationError, match="`sampling` must be a SamplingParams; got"):
            gen.generate([[1, 2]], 4, sampling=sampling)
    with pytest.raises(GenerationError, match="`model` must be a model of this package"):
        Generator("tests/data/mamba2_tiny")
    assert gen.generate([[5, 6, 7]], 0).sequences == [[5, 6, 7]]
    # stop_tokens=None: no stop tokens, as ()
    assert gen.generate([[5, 6]], 3, stop_tokens=None).sequences == gen.generate([[5, 6]], 3).sequences


def test_prompt_beyond_its_prefill_bucket_decodes_the_reference():
    """A 19-token prompt is prefilled over 16 tokens and its last 3 are fed by decode steps (Mamba-2 and
    attention layers): the greedy tokens are still transformers'."""
    expected = reference("nemotron_h_tiny")["generated_ids"]
    prompts = expected[:, :19]
    out = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4).generate(prompts, expected.shape[1] - 19)
    np.testing.assert_array_equal(np.array(out.sequences), expected)


def test_requests_in_one_bucket_compile_once(rng):
    """Prompt lengths 17-19 (prefill bucket 16), batches 3 and 4 (padded to 4) and max_new_tokens 9-12 (one
    block of 8 and one of 4, a KV cache of 32 positions) reuse the compiled prefill and decode blocks."""
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4, block_size=8)
    ids = lambda n: rng.integers(3, 256, size=n).tolist()  # noqa: E731
    first = gen.generate([ids(17)], 11)
    compiled = gen.compilations
    assert compiled == 3 and first.compile_s > 0  # the prefill and blocks of 8 and 4 steps
    out = gen.generate([ids(19)], 9)
    assert gen.compilations == compiled and out.compile_s == 0
    gen.generate([ids(18), ids(17), ids(19)], 9)
    assert gen.compilations == 2 * compiled  # a new batch bucket
    out = gen.generate([ids(16)] * 4, 12)
    assert gen.compilations == 2 * compiled and out.compile_s == 0 and out.num_generated == [12] * 4


def test_generation_config_gives_the_default_stop_token_and_sampling():
    """The issue's case: sampled rows that emit generation_config.json's eos (2) end there; explicit arguments
    win over the checkpoint's defaults."""
    gc = load_generation_config(DATA / "nemotron_h_tiny")
    assert gc.eos_token_id == (2,) and gc.pad_token_id == 0 and gc.do_sample is None
    m = model("nemotron_h_tiny")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    sampling = SamplingParams(1.0, top_k=5)
    gen = Generator(m, state="replay", buffer_len=4, generation_config=gc)
    stopped = gen.generate(prompts, 50, sampling=sampling)
    plain = gen.generate(prompts, 50, sampling=sampling, stop_tokens=())  # as without a generation_config
    assert plain.sequences == gen.generate(prompts, 50, sampling=sampling, stop_tokens=None).sequences
    assert any(2 in new[:-1] for new in plain.new_ids)  # without the checkpoint's eos, rows go on past it
    for new, cut in zip(plain.new_ids, stopped.new_ids):
        assert cut == new[: new.index(2) + 1 if 2 in new else len(new)]
    # Its sampling defaults (the same programs: the sampling is the same)
    gen.generation_config = dataclasses.replace(gc, do_sample=True, temperature=1.0, top_k=5)
    out = gen.generate(prompts, 50)
    assert out.sequences == stopped.sequences and out.compile_s == 0


def test_sampling_from_generation_config():
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95)
    assert SamplingParams.from_generation_config(gc) == SamplingParams(0.6, top_k=50, top_p=0.95)
    assert SamplingParams.from_generation_config(GenerationConfig(do_sample=True)) == SamplingParams(1.0, 50, 1.0)
    assert SamplingParams.from_generation_config(GenerationConfig(temperature=0.6, top_k=3)) == SamplingParams()
    assert SamplingParams.from_generation_config(None) == SamplingParams()
    assert SamplingParams.from_generation_config(gc, temperature=0) == SamplingParams()  # its filters dropped
    assert SamplingParams.from_generation_config(gc, top_k=0) == SamplingParams(0.6, top_k=0, top_p=0.95)
    assert SamplingParams.from_generation_config(None, temperature=0.5) == SamplingParams(0.5)
    with pytest.raises(ValueError, match=r"`top_k` and `top_p` apply to sampling: give `temperature` > 0"):
        SamplingParams.from_generation_config(gc, temperature=0, top_p=0.5)
    for kwargs in (dict(top_p=0.5), dict(top_k=3)):  # the command line refuses the same
        with pytest.raises(ValueError, match=r"`top_k` and `top_p` apply to sampling: give `temperature` > 0"):
            SamplingParams(**kwargs)


def test_route_with_the_standard_state_warns():
    with pytest.warns(UserWarning, match="`route` 'direct' applies to state 'replay' only"):
        Generator(model("mamba2_tiny"), state="standard", route="direct")


def test_buffer_len_with_the_standard_state_warns():
    """As the CLI warns for --buffer-len with --state standard; the default (None) does not warn."""
    with pytest.warns(UserWarning, match="`buffer_len` 8 applies to state 'replay' only; the standard state ignores it"):
        gen = Generator(model("mamba2_tiny"), state="standard", buffer_len=8)
    assert gen.buffer_len is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Generator(model("mamba2_tiny"), state="standard").buffer_len is None
        assert Generator(model("mamba2_tiny"), state="replay").buffer_len == 16


def test_on_token_streams_the_new_tokens():
    """on_token gets every row's new tokens in order, block after block, with the pad token after a stop."""
    ref = reference("qwen3_5_tiny")
    prompts = [ref["prompt_ids"][0].tolist(), ref["prompt_ids"][1, :7].tolist()]
    stop = int(ref["generated_ids"][0, 12 + 9])
    calls = []
    gen = Generator(model("qwen3_5_tiny"), state="replay", buffer_len=4, block_size=4)
    out = gen.generate(prompts, 20, stop_tokens=[stop], on_token=lambda step, t: calls.append((step, t.copy())))
    assert len(calls) > 2 and all(t.dtype == np.int32 and t.shape[1] == 2 for _, t in calls)
    assert [step for step, _ in calls] == np.cumsum([0] + [len(t) for _, t in calls[:-1]]).tolist()
    streamed = np.concatenate([t for _, t in calls])
    assert len(streamed) == max(out.num_generated) and out.num_generated[0] == 10
    for row, new in enumerate(out.new_ids):
        assert streamed[: len(new), row].tolist() == new
        assert (streamed[len(new):, row] == 0).all()  # the pad token
    with pytest.raises(GenerationError, match="`on_token` must be callable or None; got int"):
        gen.generate(prompts, 2, on_token=3)


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", 3)], ids=["plain", "ngram"])
def test_on_token_stops_with_the_longest_row(speculative):
    """Every row stops early inside one decode block: the streamed columns end with the longest row's
    output (no column of padding alone), in plain and speculative decoding alike."""
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4, block_size=16, backend="xla",
                    speculative=speculative)
    prompts = [[5, 9, 2, 7, 3], [11, 4], [8, 8, 6]]
    first = gen.generate(prompts, 12).new_ids
    stops = [first[0][1], first[1][2], first[2][0]]  # every row stops within its first three tokens
    calls = []
    out = gen.generate(prompts, 12, stop_tokens=stops, on_token=lambda step, t: calls.append(t.copy()))
    assert max(out.num_generated) <= 3 < 12
    streamed = np.concatenate(calls)
    assert len(streamed) == max(out.num_generated)
    for row, new in enumerate(out.new_ids):
        assert streamed[: len(new), row].tolist() == new


def test_oversized_prompt_id_is_named():
    with pytest.raises(GenerationError, match=r"prompt 1 has token id 99999999999999999999 outside the "
                                              r"vocabulary \[0, 256\)"):
        Generator(model("mamba2_tiny"), state="replay", buffer_len=4).generate([[1], [99999999999999999999]], 2)


def test_a_cache_that_does_not_fit_is_refused_before_allocating(monkeypatch):
    """In 64 MiB, 4 rows of 1e6 new tokens (a KV cache of 256 B per row and position) do not fit: the error says
    so before anything is compiled or allocated, its suggestions fit, and the Generator stays usable."""
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4)
    monkeypatch.setattr(generation, "free_memory", lambda device=None: (64 * 2**20, "test memory"))
    prompts = [[5, 6, 7]] * 4
    with pytest.raises(InsufficientMemoryError, match=r"`prompts` \(4 rows, padded to 4\) with `max_new_tokens` "
                                                      r"do not fit: the decode cache of 1048576 positions needs "
                                                      r"1.0 GiB \(KV caches 1.0 GiB") as info:
        gen.generate(prompts, 1_000_000)
    assert isinstance(info.value, MemoryError) and gen.compilations == 0
    message = str(info.value)
    assert "the test memory is 64.0 MiB" in message and "not even one row fits" not in message
    new = int(re.search(r"`max_new_tokens` up to about (\d+) fits at this batch", message).group(1))
    assert gen.memory_estimate(prompts, new).total_bytes <= 64 * 2**20 < gen.memory_estimate(prompts, 2 * new).total_bytes
    assert "no batch fits at this length" in message
    with pytest.raises(InsufficientMemoryError, match="a batch of up to 2 fits at this length"):
        gen.generate(prompts, 100_000)
    assert gen.memory_estimate(prompts[:2], 100_000).total_bytes <= 64 * 2**20
    assert gen.generate([[5, 6, 7]], 3).num_generated == [3]
    free, where = free_memory()
    assert free > 0 and where in ("available host memory", "free host memory")


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "ngram"])
def test_a_decode_block_whose_temporaries_do_not_fit_is_refused_before_it_runs(monkeypatch, speculative):
    """The decode (or speculative) block's temporaries, from its compiled program (XLA's buffer assignment),
    are checked before the block runs, beside the cache: where they do not fit (here 1 TiB reported for
    every program compiled after the prefill) the error names the block and its temporaries, and the
    Generator stays usable."""
    spec = generation.SpeculativeConfig("ngram", 2) if speculative else None
    hybrid = model("nemotron_h_tiny") if speculative else load_model(DATA / "nemotron_h_tiny", dtype=jnp.bfloat16)
    gen = Generator(hybrid, state="replay", buffer_len=4, block_size=4, speculative=spec)
    real, seen = generation._temp_bytes, []
    monkeypatch.setattr(generation, "_temp_bytes", lambda e: (seen.append(e), real(e) if len(seen) == 1 else 2**40)[1])
    program = r"the speculative block of 4 rounds" if speculative else r"the decode block of \d+ steps"
    with pytest.raises(InsufficientMemoryError, match=program + r" needs 1\.0 TiB of temporaries beside the weights "
                                                      r"and the decode cache.*: no batch or length fits") as info:
        gen.generate([[5, 6, 7]] * 2, 6, progress=False)
    # the CPU's float32 copies of a bfloat16 model's weights are named (f32 weights: no such copies)
    assert ("float32 copies of its weights" in str(info.value)) == (jax.devices()[0].platform == "cpu" and not speculative)
    monkeypatch.setattr(generation, "_temp_bytes", real)
    assert gen.generate([[5, 6, 7]] * 2, 6, progress=False).num_generated == [6, 6]
    assert 0 < real(gen._compiled[next(k for k in gen._compiled if k[0] in ("block", "spec"))]) < 2**30


def test_memory_estimate_of_an_abstract_model_equals_the_loaded_ones():
    """The command estimates before loading, from nnx.eval_shape of the model: same numbers, nothing allocated."""
    abstract = nnx.eval_shape(lambda: init_model(DATA / "nemotron_h_tiny", jnp.float32))
    estimate = Generator(abstract, state="replay", buffer_len=4).memory_estimate([[1, 2, 3]] * 3, 40)
    loaded = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4)
    assert estimate == loaded.memory_estimate([[1, 2, 3]] * 3, 40) and estimate.rows == 4 and estimate.kv_bytes > 0
    assert Generator(abstract).weights_bytes == loaded.weights_bytes == sum(
        a.nbytes for a in jax.tree.leaves(loaded.params))
    out = loaded.generate([[1, 2, 3]] * 3, 40, progress=False)
    carried = estimate.kv_bytes + estimate.state_bytes
    assert 0 < carried - out.cache_bytes <= 64  # the loop's token, position, done flags and key come on top


def test_default_buffer_dtype_is_each_layers_exact_one():
    """buffer_dtype None (the default): a bf16 model buffers Mamba-2's x and B in bf16 (the values the
    step receives, at half the bytes of f32) and GDN's computed records in f32; the tokens are those of f32
    records, token for token, and the estimate counts the narrower buffers."""
    hybrid = load_model(DATA / "nemotron_h_tiny", dtype=jnp.bfloat16)
    prompts = reference("nemotron_h_tiny")["prompt_ids"][:, :5]
    _, cache = jax.eval_shape(lambda ids: hybrid.prefill(ids, 12, replay_buffer_len=4), prompts)  # shapes only
    mamba = [s.replay for s in cache.layers if isinstance(getattr(s, "replay", None), Mamba2ReplayState)]
    assert mamba and all(r.x.dtype == r.B.dtype == jnp.bfloat16 and r.dt.dtype == jnp.float32 for r in mamba)
    gdn_model = load_model(DATA / "qwen3_5_tiny", dtype=jnp.bfloat16)
    _, cache = jax.eval_shape(lambda ids: gdn_model.prefill(ids, 12, replay_buffer_len=4), prompts)
    gdn = [s.replay for s in cache.layers if isinstance(getattr(s, "replay", None), GDNReplayState)]
    assert gdn and all(r.d.dtype == r.k.dtype == jnp.float32 for r in gdn)

    exact, wide = (Generator(hybrid, buffer_len=4, buffer_dtype=d) for d in (None, jnp.float32))
    np.testing.assert_array_equal(np.array(exact.generate(prompts, 6, progress=False).sequences),
                                  np.array(wide.generate(prompts, 6, progress=False).sequences))
    saved = sum(r.x.size + r.B.size for r in mamba) * 2  # bytes: the bf16 records at 2 bytes, not 4
    assert wide.memory_estimate(prompts, 6).state_bytes - exact.memory_estimate(prompts, 6).state_bytes == saved


def test_a_warning_raised_while_a_program_traces_names_the_callers_line():
    """The unsafe-format warning of an int8 GDN checkpoint is raised while the Generator's programs trace
    (inside JAX's tracing frames): it still names this file, the caller's code."""
    gen = Generator(load_model(DATA / "qwen3_next_tiny"), state="replay", buffer_len=4, state_dtype="int8")
    with pytest.warns(UserWarning, match="a replay checkpoint of int8 with nearest rounding on gdn layers") as record:
        gen.generate([[1, 2, 3]], 2)
    assert {w.filename for w in record if "replay checkpoint of int8" in str(w.message)} == {__file__}
