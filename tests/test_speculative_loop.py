"""The speculative-decoding loop (replayssm_jax.speculative.loop) through `Generator(speculative=...)` and the command.

Greedy speculative decoding must emit plain greedy decoding's tokens exactly,
whatever the drafts: the fixtures' `generated_ids` are plain greedy output
(tests/test_generation.py checks them against transformers'). Each fixture
runs two of the configurations below (every configuration on two fixtures):
the n-gram drafter and the oracle drafter at alpha 1 (every draft accepted),
0 (none) and 0.6 (mixed), with ReplaySSM at L = 4 and 8 with W = L (early
flushes) and with the standard state.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_generation import FIXTURES, model, reference

from replayssm_jax.generate import main
from replayssm_jax.generation import GenerationError, Generator, SpeculativeConfig
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


def speculative(method, K, alpha=None, reference_ids=None):
    if method == "ngram":
        return SpeculativeConfig("ngram", K)
    return SpeculativeConfig("oracle", K, alpha=alpha, reference=reference_ids)


@pytest.mark.parametrize("name, config", CASES, ids=[f"{n}-{c[0]}{'' if c[1] is None else c[1]}-{c[2]}{c[3] or ''}"
                                                      for n, c in CASES])
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


def test_ragged_prompts_and_rows_that_stop_in_different_rounds():
    """Prompts of 12 and 7 tokens (the prefill covers 7; the longer row's last 5 prompt tokens are fed as
    drafts that are always accepted), a stop token that ends row 0 early and max_new_tokens row 1: as plain greedy decoding, and
    on_token streams every row's new tokens in order."""
    name = "qwen3_5_tiny"
    ref = reference(name)
    prompts = [ref["prompt_ids"][0].tolist(), ref["prompt_ids"][1, :7].tolist()]
    stop = int(ref["generated_ids"][0, 12 + 5])  # the 6th new token of row 0
    plain = Generator(model(name), state="replay", buffer_len=4).generate(prompts, NEW_TOKENS, stop_tokens=[stop])
    assert plain.num_generated[0] == 6 and plain.num_generated[1] > 6
    calls = []
    gen = Generator(model(name), state="replay", buffer_len=4, block_size=2, speculative=SpeculativeConfig("ngram", 3))
    out = gen.generate(prompts, NEW_TOKENS, stop_tokens=[stop], on_token=lambda step, t: calls.append((step, t.copy())))
    assert out.sequences == plain.sequences and out.num_generated == plain.num_generated
    assert [step for step, _ in calls] == np.cumsum([0] + [len(t) for _, t in calls[:-1]]).tolist()
    streamed = np.concatenate([t for _, t in calls])
    assert len(streamed) == max(out.num_generated)
    for row, new in enumerate(out.new_ids):
        assert streamed[: len(new), row].tolist() == new
        assert (streamed[len(new):, row] == gen._pad_id).all()


def test_sampling_is_reproducible_for_a_seed():
    ref = reference("nemotron_h_tiny")
    gen = Generator(model("nemotron_h_tiny"), state="replay", buffer_len=4, speculative=SpeculativeConfig("ngram", 3))
    sampling = SamplingParams(temperature=0.8)
    first = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=3, stop_tokens=None)
    again = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=3, stop_tokens=None)
    other = gen.generate(ref["prompt_ids"], NEW_TOKENS, sampling=sampling, seed=4, stop_tokens=None)
    assert first.sequences == again.sequences and first.sequences != other.sequences
    assert first.num_generated == [NEW_TOKENS] * 2 and gen.compilations == 2


def test_speculative_config_errors():
    m = model("mamba2_tiny")
    with pytest.raises(GenerationError, match=r"`speculative.num_draft` \+ 1 = 5 verified positions must be <= "
                                              r"`buffer_len` = 4"):
        Generator(m, state="replay", buffer_len=4, speculative=SpeculativeConfig("ngram", 4))
    Generator(m, state="standard", speculative=SpeculativeConfig("ngram", 4))  # no buffer, no limit
    with pytest.raises(GenerationError, match="`speculative` must be a SpeculativeConfig or None; got str"):
        Generator(m, speculative="ngram")
    with pytest.raises(GenerationError, match=r"`speculative.method` must be one of \('ngram', 'oracle'\); got 'mtp'"):
        SpeculativeConfig("mtp", 2)
    with pytest.raises(GenerationError, match="`num_draft` must be >= 1; got 0"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(GenerationError, match=r"`alpha` must be a float in \[0, 1\]; got 1.5"):
        SpeculativeConfig("oracle", 2, alpha=1.5, reference=[[1]])
    with pytest.raises(GenerationError, match="`speculative.reference` is required with method 'oracle'"):
        SpeculativeConfig("oracle", 2)
    gen = Generator(m, state="replay", buffer_len=4, speculative=SpeculativeConfig("oracle", 2, reference=[[1, 2]]))
    with pytest.raises(GenerationError, match=r"`speculative.reference` must have one row per prompt \(2\); got 1"):
        gen.generate([[1, 2], [3, 4]], 4)
    assert gen.compilations == 1  # the prefill only; the Generator stays usable
    assert gen.generate([[1, 2]], 3).num_generated == [3]


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
