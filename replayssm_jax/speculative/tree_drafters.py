"""Tree drafts: a chain drafter's tokens as the spine of a top-k draft tree.

A tree round verifies the N nodes of a static :class:`DraftTree` of the
"first child expands" shape (:meth:`DraftTree.topk`: at each depth d =
1..D, `topk` candidates after the spine's first d - 1 tokens). The spine
(the rank-0 candidate of each depth) is what a chain drafter with
K = D proposes; ranks 1..topk - 1 are the drafter's next best tokens at
that depth, from its per-depth scores (`Drafts.scores`: the MTP head's or
the draft model's logits along the spine; the n-gram drafter's counts of
the tokens that followed every earlier occurrence of the matched n-gram)
or its ranked candidates (`Drafts.candidates`: the oracle drafter's).

:class:`TreeDrafter` wraps any drafter with scores: its state, `init_state`
and `update` are the wrapped drafter's (the loop gives `update` the
accepted path's tokens and hidden states, as a chain round's), and `draft`
returns :class:`TreeDrafts`. The loop accepts them with
:mod:`replayssm_jax.speculative.tree_acceptance`, treating every node as a
fixed proposal (q the point mass at it: distinct siblings are tried
without replacement), which preserves the target distribution whatever
the candidates are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from replayssm_jax.speculative.drafters import Drafts, Kept
from replayssm_jax.speculative.tree import DraftTree

__all__ = ["TreeDrafts", "TreeDrafter", "topk_of", "tree_candidates"]


@struct.dataclass
class TreeDrafts:
    """The draft tokens of one tree round.

    Attributes:
      tokens: i32[batch, N - 1], the draft of nodes 1 .. N - 1 (padding:
        any id).
      real: bool[batch, N - 1], the nodes with a real draft (padded nodes
        and their subtrees are never accepted).
    """

    tokens: jax.Array
    real: jax.Array


def topk_of(tree: DraftTree, depth: int) -> int:
    """topk of a tree that is DraftTree.topk(topk, depth).

    Raises:
      ValueError: any other tree (the error names the depth, the drafter's K).
    """
    topk = (tree.size - 1) // max(tree.max_depth, 1)
    if tree.max_depth != depth or tree != DraftTree.topk(topk, depth):
        raise ValueError(f"`tree` must be DraftTree.topk(topk, depth) with depth = the drafter's "
                         f"num_speculative_tokens = {depth} (the first child expands); got {tree}")
    return topk


def tree_candidates(drafts: Drafts, tree: DraftTree) -> TreeDrafts:
    """The nodes of a top-k tree from a chain drafter's spine and per-depth scores.

    Node 1 + topk (d - 1) + r (the rank-r candidate at depth d) holds the
    spine's draft d for r = 0, and for r >= 1 the token of the r-th highest
    score at depth d other than the spine's draft (ties: the lowest id). A
    depth past the row's real drafts (num_drafts) is padding, as is a
    candidate whose score is -inf (none left).

    Args:
      drafts: Drafts with tokens i32[batch, D], num_drafts, and scores
        f32[batch, D, vocab] (required unless topk = 1).
      tree: :meth:`DraftTree.topk` (topk, D) with D = the drafts' K.

    Returns:
      TreeDrafts(tokens i32[batch, N - 1], real bool[batch, N - 1]).

    Raises:
      ValueError: a tree of another shape, another depth than K, or no
        scores where topk > 1.
    """
    depth = drafts.tokens.shape[1]
    topk = topk_of(tree, depth)
    real_depth = jnp.arange(depth)[None, :] < drafts.num_drafts[:, None]  # [batch, D]
    if topk == 1:
        return TreeDrafts(tokens=drafts.tokens, real=real_depth)
    if drafts.candidates is not None:  # ranked candidates given
        if drafts.candidates.shape[-1] < topk - 1:
            raise ValueError(f"the drafter gives {drafts.candidates.shape[-1]} other candidates per position; the "
                             f"tree takes topk - 1 = {topk - 1}")
        token = drafts.candidates[..., :topk - 1]
        present = token >= 0
    elif drafts.scores is not None:
        vocab = drafts.scores.shape[-1]
        spine = jax.nn.one_hot(drafts.tokens, vocab, dtype=bool)
        others = jnp.where(spine, -jnp.inf, drafts.scores.astype(jnp.float32))
        score, token = jax.lax.top_k(others, topk - 1)  # [batch, D, topk - 1]
        present = score > -jnp.inf
    else:
        raise ValueError("the drafter gives no per-depth scores (`Drafts.scores`) or candidates "
                         "(`Drafts.candidates`), which a tree with topk > 1 takes its other candidates from")
    tokens = jnp.concatenate([drafts.tokens[..., None], token.astype(jnp.int32)], axis=-1)  # [batch, D, topk]
    real = real_depth[..., None] & jnp.concatenate([jnp.ones_like(present[..., :1]), present], -1)
    batch = tokens.shape[0]
    return TreeDrafts(tokens=tokens.reshape(batch, -1), real=real.reshape(batch, -1))


@struct.dataclass
class TreeDrafter:
    """A chain drafter's proposals as a top-k draft tree (see the module docstring).

    Attributes:
      base: the drafter (`replayssm_jax.speculative.Drafter`) whose
        num_speculative_tokens is the tree's depth D and whose Drafts carry
        per-depth scores (topk > 1).
      tree: static, :meth:`DraftTree.topk` (topk, D).

    Raises:
      ValueError: a tree that is not DraftTree.topk(topk, base.num_speculative_tokens).
    """

    base: Any
    tree: DraftTree = struct.field(pytree_node=False)

    def __post_init__(self):
        topk_of(self.tree, self.base.num_speculative_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        """D, the tree's depth (the most drafts a round accepts)."""
        return self.base.num_speculative_tokens

    @property
    def needs_hidden(self) -> bool:
        return self.base.needs_hidden

    def init_state(self, target, start):
        return self.base.init_state(target, start)

    def draft(self, target, state, history, lengths, key) -> tuple[TreeDrafts, Any]:
        """The base drafter's drafts as the tree's nodes (`tree_candidates`), and its state."""
        drafts, state = self.base.draft(target, state, history, lengths, key)
        return tree_candidates(drafts, self.tree), state

    def update(self, target, state, kept: Kept):
        """The base drafter's update with the accepted path's tokens and hidden states."""
        return self.base.update(target, state, kept)
