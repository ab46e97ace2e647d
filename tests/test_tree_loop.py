"""Tree speculation through the compiled loop: `Generator(speculative=SpeculativeConfig(..., tree=))` and
`--tree TOPK,DEPTH`.

Greedy tree-speculative decoding must emit plain greedy decoding's tokens
(the fixtures' `generated_ids`): the n-gram drafter (its several
continuations as branches) with ReplaySSM on every fixture; the target as
its own draft model (the spine always right: D + 1 tokens a round) on the
standard state's per-node path; a random MTP head (almost nothing
accepted: the root's token, or a branch). Bad trees are refused when the
config is built.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_generation import FIXTURES, model, reference
from test_mtp import HEAD_FIXTURES, with_mtp_tensors

from models import load_model
from replayssm_jax.generate import main
from replayssm_jax.generation import GenerationError, Generator, SpeculativeConfig
from replayssm_jax.speculative import DraftTree, NgramDrafter
from replayssm_jax.speculative.tree_drafters import TreeDrafter

NEW_TOKENS = 12


def check_greedy(target, name, spec, state="replay", L=8):
    ref = reference(name)
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    T = prompts.shape[1]
    out = Generator(target, state=state, buffer_len=L, block_size=4, speculative=spec).generate(
        prompts, NEW_TOKENS, stop_tokens=None)
    np.testing.assert_array_equal(np.array(out.sequences), expected[:, :T + NEW_TOKENS])
    assert out.num_generated == [NEW_TOKENS] * 2
    return out


# `slow`: the loop's n-gram tree runs in the default suite through the command (test_command_line_tree), and
# tests/test_tree_model.py runs a tree loop on every fixture.
@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_ngram_tree_equals_plain_greedy(name):
    out = check_greedy(model(name), name, SpeculativeConfig("ngram", 3, tree=(2, 3)))
    assert 1.0 <= out.accepted_per_round <= 4


@pytest.mark.slow  # the per-node standard state runs in the default suite in tests/test_tree_model.py
def test_draft_model_tree_accepts_the_full_depth():
    name = "mamba2_tiny"
    out = check_greedy(model(name), name, SpeculativeConfig("draft", 2, draft_model=model(name), tree=(2, 2)),
                       state="standard", L=None)
    assert out.accepted_per_round == 3.0  # the spine is the target's own greedy continuation


@pytest.mark.slow
def test_mtp_tree_equals_plain_greedy(tmp_path):
    name = HEAD_FIXTURES[0]
    target = load_model(with_mtp_tensors(name, tmp_path), mtp=True)
    check_greedy(target, name, SpeculativeConfig("mtp", 2, tree=DraftTree.topk(3, 2)))


def test_ngram_branches():
    """The n-gram tree's other candidates are the continuations of the earlier occurrences."""
    history = np.array([[5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 9, 3, 5, 6]], np.int32)
    drafter = TreeDrafter(NgramDrafter(2, max_ngram=2, vocab_size=16), DraftTree.topk(3, 2))
    nodes, _ = jax.jit(lambda h, n: drafter.draft(None, None, h, n, None))(history, np.array([14]))
    # The latest occurrence of (5, 6) continues 9, 3 (the spine); the others 8, 2 and 7, 1.
    np.testing.assert_array_equal(nodes.tokens, [[9, 7, 8, 3, 1, 2]])
    assert bool(np.all(nodes.real))


def test_bad_trees_are_refused():
    m = model("mamba2_tiny")
    with pytest.raises(GenerationError, match=r"`speculative.tree`: `tree` must be DraftTree.topk\(topk, depth\) "
                                              r"with depth = the drafter's num_speculative_tokens = 3"):
        SpeculativeConfig("ngram", 3, tree=(2, 2))
    with pytest.raises(GenerationError, match="`speculative.tree`: `speculative.tree` must be a DraftTree or"):
        SpeculativeConfig("ngram", 3, tree=[2, 3])
    with pytest.raises(GenerationError, match="`speculative.tree`'s nodes = 7 verified positions must be <= "
                                              "`buffer_len` = 4"):
        Generator(m, buffer_len=4, speculative=SpeculativeConfig("ngram", 3, tree=(2, 3)))
    with pytest.raises(ValueError, match="no per-depth scores"):
        TreeDrafter(NgramDrafter(2), DraftTree.topk(2, 2)).draft(None, None, np.zeros((1, 4), np.int32),
                                                                 np.array([4]), None)


def test_command_line_tree(capsys):
    """--tree through the command on ragged prompts (the longer one's prompt tokens go on the tree's first
    branch): the tokens of plain greedy decoding, and the tree's fields in the report."""
    argv = ["--prompt-ids", "5,6,7,5,6,8,5,6,7,5;5,6,7,5", "--max-new-tokens", "6", "--no-compile-cache",
            "--no-progress"]
    assert main(argv + ["--speculative", "ngram", "--tree", "2,3", "--buffer-len", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tree"] == [2, 3] and report["tree_nodes"] == 7 and report["num_draft"] == 3
    assert 1.0 <= report["mean_accepted"] <= 4 and len(report["row_mean_accepted"]) == 2
    assert main(argv + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["generated_ids"] == report["generated_ids"] and plain["num_generated"] == report["num_generated"]
    for extra, message in [(["--tree", "2,3", "--buffer-len", "4"],
                            "--tree's 1 + TOPK * DEPTH = 7 verified positions must be <= --buffer-len = 4"),
                           (["--tree", "2,3", "--num-draft", "2"], "--num-draft must equal --tree's DEPTH = 3"),
                           (["--tree", "2"], "TOPK,DEPTH")]:
        assert main(argv + ["--speculative", "ngram"] + extra) == 2
        assert message in capsys.readouterr().err
