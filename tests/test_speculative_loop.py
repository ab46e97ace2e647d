"""The speculative-decoding loop (replayssm_jax.speculative.loop) through `Generator(speculative=...)` and the command.

Greedy speculative decoding must emit plain greedy decoding's tokens exactly,
whatever the drafts: the fixtures' `generated_ids` are plain greedy output
(tests/test_generation.py checks them against transformers'). Each fixture
runs two of the configurations below (every configuration on two fixtures; the
first of mamba2_tiny, nemotron_h_tiny and qwen3_5_tiny by default, the rest `slow`):
the n-gram drafter and the oracle drafter at alpha 1 (every draft accepted),
0 (none) and 0.6 (mixed), with ReplaySSM at L = 4 and 8 with W = L (early
flushes) and with the standard state. The drafters with a state run on every
fixture they apply to, each fixture with another state configuration: a
random MTP head (the fixtures with ``mtp.*`` tensors, `with_mtp_tensors`:
almost nothing accepted), the target itself as its draft model (every draft
accepted: K + 1 tokens a round) and the next fixture's model as the draft
model (other weights and architecture, the same vocabulary of 256 ids: few
accepted).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_generation import DATA, FIXTURES, model, reference
from test_mtp import HEAD_FIXTURES, with_mtp_tensors

from models import load_model
from models.random_init import init_model
from replayssm_jax import generation
from replayssm_jax.generate import main
from replayssm_jax.generation import (GenerationError, Generator, InsufficientMemoryError, SpeculativeConfig,
                                      format_bytes)
from replayssm_jax.layers.cache import KVCache
from replayssm_jax.sampling import SamplingParams

NEW_TOKENS = 16
# (method, alpha, state, L, K)
CONFIGS = [
    ("ngram", None, "replay", 4, 3),
    ("oracle", 1.0, "replay", 8, 7),
    ("oracle", 0.0, "standard", None, 2),
    ("oracle", 0.6, "replay", 4, 3),
]
CASES = [(name, CONFIGS[(i + j) % len(CONFIGS)]) for i, name in enumerate(FIXTURES) for j in (0, 2)]
# The default run keeps the first configuration of mamba2_tiny, nemotron_h_tiny and qwen3_5_tiny (the n-gram
# drafter, the oracle accepting every draft and none; ReplaySSM at L = 4 and 8 and the standard state), the
# rest `slow`: the oracle's mixed acceptance (alpha 0.6) is the n-gram drafter's too, and GDN layers under
# ReplaySSM run by default in test_ragged_prompts_and_rows_that_stop_in_different_rounds (qwen3_5_tiny, L = 4;
# with the drafter cases below, both layer types under each state).
CASE_PARAMS = [pytest.param(name, config, id=f"{name}-{config[0]}{'' if config[1] is None else config[1]}-"
                                             f"{config[2]}{config[3] or ''}",
                            marks=() if k % 2 == 0 and name != "qwen3_next_tiny" else pytest.mark.slow)
               for k, (name, config) in enumerate(CASES)]
# (state, L, K) for the drafters with a state
STATE_CONFIGS = [("replay", 4, 3), ("replay", 8, 7), ("standard", None, 2)]
DRAFTER_CASES = [(name, method, STATE_CONFIGS[(i + j) % len(STATE_CONFIGS)])
                 for j, method in enumerate(("mtp", "draft-self", "draft-other"))
                 for i, name in enumerate(FIXTURES) if method != "mtp" or name in HEAD_FIXTURES]
# The default run keeps the MTP head's first two cases (Nemotron-H at L = 8, Qwen3.5 on the standard state)
# and each draft model's first (Mamba-2 drafting for itself at L = 8, Nemotron-H drafting for Mamba-2 on the
# standard state); the rest are `slow`: both drafters with a state at L = 4 on a GDN target (and the draft
# model with GDN layers) run by default in test_ragged_prompts_and_rows_that_stop_in_different_rounds.
_DEFAULT_DRAFTER_CASES = {case for method, n in (("mtp", 2), ("draft-self", 1), ("draft-other", 1))
                          for case in [c for c in DRAFTER_CASES if c[1] == method][:n]}
DRAFTER_PARAMS = [pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2][0]}{case[2][1] or ''}",
                               marks=() if case in _DEFAULT_DRAFTER_CASES else pytest.mark.slow)
                  for case in DRAFTER_CASES]


def other_fixture(name):
    """The next fixture: a draft model of other weights and architecture, with the same vocabulary."""
    return FIXTURES[(FIXTURES.index(name) + 1) % len(FIXTURES)]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """name -> the fixture's model with a random MTP head (`with_mtp_tensors`), loaded once per module."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_model(with_mtp_tensors(name, tmp_path_factory.mktemp(name)), mtp=True)
        return loaded[name]

    return get


def model_drafter(method, name, K, mtp_model):
    """(target, SpeculativeConfig) of "mtp", "draft-self" (the target drafts for itself) or "draft-other"."""
    if method == "mtp":
        return mtp_model(name), SpeculativeConfig("mtp", K)
    draft = model(name) if method == "draft-self" else model(other_fixture(name))
    return model(name), SpeculativeConfig("draft", K, draft_model=draft)


def speculative(method, K, alpha=None, reference_ids=None):
    if method == "ngram":
        return SpeculativeConfig("ngram", K)
    return SpeculativeConfig("oracle", K, alpha=alpha, reference=reference_ids)


@pytest.mark.parametrize("name, config", CASE_PARAMS)
def test_greedy_speculative_equals_plain_greedy(name, config):
    method, alpha, state, L, K = config
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    T = prompts.shape[1]
    gen = Generator(model(name), state=state, buffer_len=L, block_size=4,
                    speculative=speculative(method, K, alpha, expected))
    out = gen.generate(prompts, NEW_TOKENS, stop_tokens=None)
    np.testing.assert_array_equal(np.array(out.sequences), expected[:, : T + NEW_TOKENS])
    assert out.num_generated == [NEW_TOKENS] * 2 and out.decode_tokens == 2 * (NEW_TOKENS - 1)
    assert out.tokens_per_s > 0 and 1.0 <= out.accepted_per_round <= K + 1
    if alpha == 0.0:
        assert out.accepted_per_round == 1.0  # the target's own token only
    if alpha == 1.0:
        assert out.accepted_per_round > K / 2 + 1
        assert out.decode_steps < NEW_TOKENS / 2  # rounds


def test_with_speculative_reuses_the_compiled_round():
    """Another oracle alpha on `Generator.with_speculative` compiles nothing more and keeps greedy output."""
    ref = reference("mamba2_tiny")
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    T = prompts.shape[1]
    gen = Generator(model("mamba2_tiny"), state="replay", buffer_len=4, block_size=4,
                    speculative=SpeculativeConfig("oracle", 2, alpha=1.0, reference=expected))
    first = gen.generate(prompts, NEW_TOKENS, stop_tokens=None)
    compiled = gen.compilations
    other = gen.with_speculative(SpeculativeConfig("oracle", 2, alpha=0.0, reference=expected))
    out = other.generate(prompts, NEW_TOKENS, stop_tokens=None)
    assert first.compile_s > 0 and out.compile_s == 0 and other.compilations == gen.compilations == compiled
    assert out.accepted_per_round == 1.0 and first.accepted_per_round > 2.0
    np.testing.assert_array_equal(np.array(out.sequences), expected[:, : T + NEW_TOKENS])
    with pytest.raises(GenerationError, match=r"`speculative` must keep this Generator's \(method, num_draft, "
                                              r"max_ngram, min_ngram, tree\) = \('oracle', 2, 3, 1, None\); got "
                                              r"\('oracle', 3, 3, 1, None\)"):
        gen.with_speculative(SpeculativeConfig("oracle", 3, reference=expected))
    with pytest.raises(GenerationError, match="this Generator is not speculative"):
        Generator(model("mamba2_tiny")).with_speculative(SpeculativeConfig("ngram", 2))
    drafting = Generator(model("mamba2_tiny"), speculative=SpeculativeConfig("draft", 2, draft_model=model(
        "mamba2_tiny")))
    with pytest.raises(GenerationError, match="`speculative.draft_model` must be this Generator's draft model"):
        drafting.with_speculative(SpeculativeConfig("draft", 2, draft_model="/nonexistent/folder"))


@pytest.mark.parametrize("name, method, config", DRAFTER_PARAMS)
def test_greedy_speculative_with_a_drafter_state_equals_plain_greedy(name, method, config, mtp_model):
    state, L, K = config
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    T = prompts.shape[1]
    target, spec = model_drafter(method, name, K, mtp_model)
    gen = Generator(target, state=state, buffer_len=L, block_size=4, speculative=spec)
    out = gen.generate(prompts, NEW_TOKENS, stop_tokens=None)
    np.testing.assert_array_equal(np.array(out.sequences), expected[:, : T + NEW_TOKENS])
    assert out.num_generated == [NEW_TOKENS] * 2 and out.decode_tokens == 2 * (NEW_TOKENS - 1)
    assert out.tokens_per_s > 0 and 1.0 <= out.accepted_per_round <= K + 1
    assert gen.compilations == 4  # the prefill, the rounds' start, the drafter's state, the block of rounds
    if method == "draft-self":  # q = p: every draft accepted, K + 1 tokens every round
        assert out.row_accepted_per_round == [K + 1.0] * 2
        assert out.decode_steps == -(-(NEW_TOKENS - 1) // (K + 1))
    else:
        assert out.accepted_per_round < K / 2 + 1  # random weights: few drafts accepted


_PLAIN: dict = {}


# The n-gram drafter `slow`: the forced prompt tokens and the rows' stops are the loop's code, which the
# drafters with a state run by default (and consume the forced tokens besides).
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "mtp", "draft-other"])
def test_ragged_prompts_and_rows_that_stop_in_different_rounds(method, mtp_model):
    """Prompts of 12 and 7 tokens (the prefill covers 7; the longer row's last 5 prompt tokens are fed as
    drafts that are always accepted), a stop token that ends row 0 early and max_new_tokens row 1: as plain greedy decoding, and
    on_token streams every row's new tokens in order. The drafters with a state consume the forced
    prompt tokens as kept positions (the MTP head steps over them, the draft model reads them)."""
    name = "qwen3_5_tiny"
    ref = reference(name)
    prompts = [ref["prompt_ids"][0].tolist(), ref["prompt_ids"][1, :7].tolist()]
    stop = int(ref["generated_ids"][0, 12 + 5])  # the 6th new token of row 0
    if "plain" not in _PLAIN:
        _PLAIN["plain"] = Generator(model(name), state="replay", buffer_len=4).generate(prompts, NEW_TOKENS,
                                                                                        stop_tokens=[stop])
    plain = _PLAIN["plain"]
    assert plain.num_generated[0] == 6 and plain.num_generated[1] > 6
    calls = []
    target, spec = (model(name), SpeculativeConfig("ngram", 3)) if method == "ngram" else model_drafter(
        method, name, 3, mtp_model)
    gen = Generator(target, state="replay", buffer_len=4, block_size=2, speculative=spec)
    out = gen.generate(prompts, NEW_TOKENS, stop_tokens=[stop], on_token=lambda step, t: calls.append((step, t.copy())))
    assert out.sequences == plain.sequences and out.num_generated == plain.num_generated
    assert [step for step, _ in calls] == np.cumsum([0] + [len(t) for _, t in calls[:-1]]).tolist()
    streamed = np.concatenate([t for _, t in calls])
    assert len(streamed) == max(out.num_generated)
    for row, new in enumerate(out.new_ids):
        assert streamed[: len(new), row].tolist() == new
        assert (streamed[len(new):, row] == gen._pad_id).all()


def test_sampling_with_a_draft_model():
    """Sampled drafts from the draft model's processed distribution q. With the target as its own
    draft model q = p (up to rounding), so min(1, p / q) accepts every draft: K + 1 tokens a round per
    row; another model's drafts are accepted less often, 1..K + 1 per round and row. Reproducible for
    a seed."""
    name, K = "nemotron_h_tiny", 3
    ref = reference(name)
    sampling = SamplingParams(temperature=0.8, top_k=50)
    stats = {}
    for method in ("draft-self", "draft-other"):
        target, spec = model_drafter(method, name, K, None)
        gen = Generator(target, state="replay", buffer_len=4, speculative=spec)
        out = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=5, stop_tokens=None)
        assert out.num_generated == [NEW_TOKENS] * 2
        stats[method] = out.row_accepted_per_round
        if method == "draft-other":
            again = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=5, stop_tokens=None)
            assert again.sequences == out.sequences and gen.compilations == 4
    assert all(r > K + 0.5 for r in stats["draft-self"]), stats
    assert all(1.0 <= r <= K + 1 for r in stats["draft-other"]), stats
    assert sum(stats["draft-other"]) < sum(stats["draft-self"]), stats


def test_sampling_is_reproducible_for_a_seed():
    ref = reference("nemotron_h_tiny")
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4, speculative=SpeculativeConfig("ngram", 3))
    sampling = SamplingParams(temperature=0.8)
    first = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=3, stop_tokens=None)
    again = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=3, stop_tokens=None)
    other = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=4, stop_tokens=None)
    assert first.sequences == again.sequences and first.sequences != other.sequences
    assert first.num_generated == [NEW_TOKENS] * 2 and gen.compilations == 3  # the prefill, the rounds' start, the block


def test_speculative_config_errors():
    m = model("mamba2_tiny")
    with pytest.raises(GenerationError, match=r"`speculative.num_draft` \+ 1 = 5 verified positions must be <= "
                                              r"`buffer_len` = 4"):
        Generator(m, state="replay", buffer_len=4, speculative=SpeculativeConfig("ngram", 4))
    Generator(m, state="standard", speculative=SpeculativeConfig("ngram", 4))  # no buffer, no limit
    with pytest.raises(GenerationError, match="`speculative` must be a SpeculativeConfig or None; got str"):
        Generator(m, speculative="ngram")
    with pytest.raises(GenerationError, match=r"`speculative.method` must be one of \('ngram', 'oracle', 'mtp', "
                                              r"'draft'\); got 'eagle'"):
        SpeculativeConfig("eagle", 2)
    with pytest.raises(GenerationError, match="`num_draft` must be >= 1; got 0"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(GenerationError, match="`max_ngram` must be >= `min_ngram` = 3; got 1"):
        SpeculativeConfig("ngram", 2, max_ngram=1, min_ngram=3)
    with pytest.raises(GenerationError, match="`max_ngram` must be >= 1; got 0"):
        SpeculativeConfig("ngram", 2, max_ngram=0)
    with pytest.raises(GenerationError, match=r"`alpha` must be a float in \[0, 1\]; got 1.5"):
        SpeculativeConfig("oracle", 2, alpha=1.5, reference=[[1]])
    with pytest.raises(GenerationError, match="`speculative.reference` is required with method 'oracle'"):
        SpeculativeConfig("oracle", 2)
    with pytest.raises(GenerationError, match="`speculative.draft_model` applies to method 'draft' only; got it "
                                              "with method 'ngram'"):
        SpeculativeConfig("ngram", 2, draft_model=m)
    gen = Generator(m, state="replay", buffer_len=4, speculative=SpeculativeConfig("oracle", 2, reference=[[1, 2]]))
    with pytest.raises(GenerationError, match=r"`speculative.reference` must have one row per prompt \(2\); got 1"):
        gen.generate([[1, 2], [3, 4]], 4)
    assert gen.compilations == 0  # refused before anything compiles; the Generator stays usable
    assert gen.generate([[1, 2]], 3).num_generated == [3]
    bad = gen.with_speculative(SpeculativeConfig("oracle", 2, reference=[[1, 2, 999]]))
    compiled = bad.compilations
    with pytest.raises(GenerationError, match=r"`speculative.reference` row 0 has token id 999 outside the vocabulary"):
        bad.generate([[1, 5]], 3)
    assert bad.compilations == compiled


def test_command_line_speculative(capsys):
    argv = ["--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "6", "--no-compile-cache", "--no-progress"]
    assert main(argv + ["--speculative", "ngram", "--num-draft", "3", "--buffer-len", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculative"] == "ngram" and report["num_draft"] == 3 and report["state"] == "replay"
    assert 1.0 <= report["mean_accepted"] <= 4 and report["tokens_per_s"] > 0
    assert main(argv + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["generated_ids"] == report["generated_ids"] and plain["speculative"] is None
    assert plain["mean_accepted"] is None
    for extra, message in [(["--num-draft", "4", "--buffer-len", "4"],
                            "--num-draft + 1 = 5 verified positions must be <= --buffer-len = 4 with --state replay"),
                           (["--num-draft", "0"], "--num-draft must be >= 1; got 0")]:
        assert main(argv + ["--speculative", "ngram"] + extra) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def _with_tokenizer(src, dst, vocab):
    """A copy of fixture folder `src` at `dst` with a tokenizer.json of `vocab` ({token: id})."""
    shutil.copytree(DATA / src, dst)
    (dst / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": []}))
    return dst


def test_model_drafter_errors(tmp_path):
    """Bad drafter input raises a GenerationError naming the argument when the Generator is built; the
    target stays usable."""
    m = model("mamba2_tiny")
    with pytest.raises(GenerationError, match=r"`speculative.draft_model` \(a model or a checkpoint folder\) is "
                                              r"required with method 'draft'"):
        SpeculativeConfig("draft", 2)
    with pytest.raises(GenerationError, match="`speculative.draft_model` must be a model of this package or a "
                                              "checkpoint folder; got int"):
        SpeculativeConfig("draft", 2, draft_model=3)
    with pytest.raises(GenerationError, match=r"`speculative.method` 'mtp' needs a model with a multi-token "
                                              r"prediction head; `model` \(NemotronHForCausalLM\) has none: load "
                                              r"it with models.load_model\(path, mtp=True\)"):
        Generator(m, speculative=SpeculativeConfig("mtp", 2))
    small = tmp_path / "small_vocab"
    shutil.copytree(DATA / "mamba2_tiny", small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 128}))
    with pytest.raises(GenerationError, match=r"`speculative.draft_model`: the draft model has vocab_size = 128; "
                                              r"the target has 256"):
        Generator(m, speculative=SpeculativeConfig("draft", 2, draft_model=init_model(small, seed=1)))
    missing = tmp_path / "missing"
    with pytest.raises(GenerationError, match=rf"`speculative.draft_model`: cannot load checkpoint "
                                              rf"'{re.escape(str(missing))}'"):
        Generator(m, speculative=SpeculativeConfig("draft", 2, draft_model=missing))
    with pytest.raises(GenerationError, match=r"`speculative.num_draft` \+ 1 = 5 verified positions must be <= "
                                              r"`buffer_len` = 4"):
        Generator(m, buffer_len=4, speculative=SpeculativeConfig("draft", 4, draft_model=m))
    assert Generator(m, state="replay", buffer_len=4).generate([[1, 2]], 3).num_generated == [3]


def test_memory_estimate_counts_the_draft_models_cache(monkeypatch):
    """With a draft model, the estimate (and so the check before allocating) holds the draft's own cache: a
    prefill of the draft model over the padded rows with one position more than the target's KV cache
    (its history) and the verify window; the refusal names it, the Generator stays usable, and the run's
    cache_bytes holds the draft's cache too."""
    target, draft = model("mamba2_tiny"), model("nemotron_h_tiny")  # the draft has attention layers
    prompts = [[5, 6, 7, 8]] * 3
    spec = Generator(target, state="replay", buffer_len=4,
                     speculative=SpeculativeConfig("draft", 2, draft_model=draft))
    estimate = spec.memory_estimate(prompts, 40)
    ids = jax.ShapeDtypeStruct((estimate.rows, 4), jnp.int32)
    _, cache = jax.eval_shape(lambda x: draft.prefill(x, estimate.max_len + 1, replay_buffer_len=4, max_window=3,
                                                      last_logits_only=True), ids)
    draft_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert estimate.draft_bytes == draft_bytes > _kv_bytes(cache) > 0
    ngram = Generator(target, state="replay", buffer_len=4, speculative=SpeculativeConfig("ngram", 2))
    assert ngram.memory_estimate(prompts, 40) == dataclasses.replace(
        estimate, kv_bytes=estimate.kv_bytes - _kv_bytes(cache), draft_bytes=0,
        state_bytes=estimate.state_bytes - draft_bytes + _kv_bytes(cache))
    need = estimate.total_bytes
    monkeypatch.setattr(generation, "free_memory", lambda device=None: (need - draft_bytes // 2, "test memory"))
    with pytest.raises(InsufficientMemoryError, match=rf"the draft's own {re.escape(format_bytes(draft_bytes))} "
                                                      rf"included"):
        spec.generate(prompts, 40, progress=False)
    assert spec.compilations == 0
    monkeypatch.undo()
    out = spec.generate(prompts, 40, progress=False)
    assert out.num_generated == [40] * 3
    # the run's cache (the draft's included) is the estimate's less the loop's tokens, flags and key
    assert 0 < estimate.kv_bytes + estimate.state_bytes - out.cache_bytes <= 64


@pytest.mark.parametrize("tree, temperature", [((3, 2), 0.0), (None, 0.8)], ids=["tree", "sampling"])
def test_memory_estimate_holds_what_a_tree_or_sampling_adds_to_the_drafter_state(tree, temperature, mtp_model):
    """The MTP head's state of a tree run (the drafts' scores) and of a sampling run (the draft
    distributions) is larger than a greedy chain's: the estimate for the run's sampling holds it."""
    gen = Generator(mtp_model("nemotron_h_tiny"), state="replay", buffer_len=8,
                    speculative=SpeculativeConfig("mtp", 2, tree=tree))
    prompts, sampling = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 11], [3, 4, 3, 4, 3, 4]], \
        SamplingParams(temperature=temperature)
    estimate = gen.memory_estimate(prompts, 24, sampling=sampling)
    out = gen.generate(prompts, 24, sampling=sampling, seed=1, stop_tokens=None, progress=False)
    assert 0 < estimate.kv_bytes + estimate.state_bytes - out.cache_bytes <= 64
    chain = Generator(mtp_model("nemotron_h_tiny"), state="replay", buffer_len=8,
                      speculative=SpeculativeConfig("mtp", 2)).memory_estimate(prompts, 24)
    assert estimate.draft_bytes > chain.draft_bytes > 0


def test_an_abstract_model_is_refused_by_generate():
    """An abstract model (nnx.eval_shape: parameters as shapes) serves `memory_estimate`; `generate` refuses it,
    as target or as draft, naming it, before anything compiles."""
    abstract = nnx.eval_shape(lambda: init_model(DATA / "mamba2_tiny", jnp.float32))
    for gen, what in ((Generator(abstract), "model"),
                      (Generator(model("mamba2_tiny"), speculative=SpeculativeConfig("draft", 2, draft_model=abstract)),
                       "speculative.draft_model")):
        assert gen.memory_estimate([[1, 2, 3]], 4).total_bytes > 0
        with pytest.raises(GenerationError, match=rf"`{what}` is abstract \(its parameters are shapes only"):
            gen.generate([[1, 2, 3]], 4, progress=False)
        assert gen.compilations == 0


def _kv_bytes(cache) -> int:
    return sum(a.size * a.dtype.itemsize for layer in cache.layers if isinstance(layer, KVCache)
               for a in (layer.k, layer.v))


def test_command_line_model_drafters(tmp_path, capsys):
    """--speculative mtp (the target loaded with its head) and draft:DIR through the command, and their
    one-line errors: a checkpoint without mtp.* tensors, a draft of another vocabulary or tokenizer."""
    argv = ["--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "6", "--no-compile-cache", "--no-progress",
            "--buffer-len", "4", "--num-draft", "3", "--json"]
    mamba = str(DATA / "mamba2_tiny")
    assert main(argv + ["--checkpoint", mamba, "--speculative", f"draft:{mamba}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculative"] == "draft" and report["draft_checkpoint"] == mamba and report["state"] == "replay"
    assert report["mean_accepted"] == 4.0 and report["tokens_per_s"] > 0  # the target drafts for itself
    assert main(argv + ["--checkpoint", mamba]) == 0
    assert json.loads(capsys.readouterr().out)["generated_ids"] == report["generated_ids"]
    head = with_mtp_tensors("nemotron_h_tiny", tmp_path / "mtp")
    assert main(argv + ["--checkpoint", str(head), "--speculative", "mtp"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculative"] == "mtp" and 1.0 <= report["mean_accepted"] <= 4
    a = _with_tokenizer("mamba2_tiny", tmp_path / "a", {"x": 0, "y": 1})
    b = _with_tokenizer("mamba2_tiny", tmp_path / "b", {"x": 1, "y": 0})
    small = tmp_path / "small_vocab"
    shutil.copytree(DATA / "mamba2_tiny", small)
    (small / "config.json").write_text(json.dumps({**json.loads((small / "config.json").read_text()),
                                                   "vocab_size": 128}))
    qwen = str(DATA / "qwen3_5_tiny")
    for extra, message in [
            (["--checkpoint", qwen, "--speculative", "mtp"], "no tensors under the prefix 'mtp.'"),
            (["--checkpoint", mamba, "--speculative", "mtp"], "model_type 'mamba2' has no multi-token prediction"),
            (["--speculative", "eagle"], "argument --speculative: must be one of ngram, mtp, draft:DIR; got 'eagle'"),
            (["--speculative", "draft:"], "argument --speculative: must be one of ngram, mtp, draft:DIR; got 'draft:'"),
            (["--checkpoint", mamba, "--speculative", f"draft:{small}"],
             f"--speculative draft:{small}: the draft model ({small}) has vocab_size = 128; the target ({mamba}) has "
             f"256"),
            (["--checkpoint", str(a), "--speculative", f"draft:{b}"],
             f"the draft model's tokenizer ({b}/tokenizer.json) differs from the target's ({a}/tokenizer.json): 2 "
             f"tokens have another id or are missing, e.g. 'x': id 1 in the draft's, 0 in the target's"),
            (["--checkpoint", mamba, "--speculative", f"draft:{tmp_path / 'none'}"], "does not exist")]:
        assert main(argv + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
