"""Acceptance rules of tree speculation: which path of a verified draft tree a round keeps.

A tree round (ARCHITECTURE.md, "The verify window"; :mod:`replayssm_jax.speculative.tree`):
the target verifies the N nodes of a static :class:`DraftTree` in one call,
node 0 the last accepted token and node j >= 1 the draft drafts[:, j - 1],
and returns logits [batch, N, vocab]; node j's logits give the target's
next token after the path root .. j, so draft j is judged by its parent's
logits. A rule keeps one path from the root: its accepted drafts, then one
token from the target at the path's last node; m = depth + 1 in 1..D + 1
new tokens per row (D the tree's depth), and every layer commits the path's
m nodes (`path`).

- :func:`tree_greedy_acceptance`: a draft is acceptable if it is the
  target's argmax after its parent; the kept path ends at the deepest node
  whose drafts are all acceptable (the first in node order on a tie), and
  the extra token is the argmax there. The output is plain greedy
  decoding's, token for token (the chain's :func:`greedy_acceptance` is the
  case of a chain).
- :func:`tree_sampling_acceptance`: multi-draft recursive rejection
  sampling (SpecInfer: Miao et al., 2024, "SpecInfer: Accelerating Large
  Language Model Serving with Tree-based Speculative Inference and
  Verification", multi-step speculative sampling; Yang et al., 2024,
  "Multi-Candidate Speculative Decoding"): at the current node, with p the
  target's distribution there, try its children in node order: accept
  child x with probability min(1, p(x) / q(x)) and move to it, else set
  p <- normalize(max(p - q, 0)) and try the next child; when every child
  is rejected (or the node is a leaf), draw the extra token from p. Each
  emitted token has the target's distribution given the tokens before it.

Padded nodes (`real` False) are never accepted and do not change p. Both
rules run under `jax.jit` with fixed shapes; the tree is static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from replayssm_jax.ops import validate as v
from replayssm_jax.sampling import SamplingParams, token_log_probs
from replayssm_jax.speculative import _checks
from replayssm_jax.speculative.acceptance import _check_fill_id, _residual_probs
from replayssm_jax.speculative.tree import DraftTree

__all__ = ["TreeAccepted", "tree_greedy_acceptance", "tree_sampling_acceptance"]


@struct.dataclass
class TreeAccepted:
    """The outcome of one round of tree acceptance.

    Attributes:
      tokens: i32[batch, D + 1], the new tokens of each row: the drafts on
        its accepted path (depth 1 .. m - 1), then the token from the
        target, then `fill_id` up to D + 1.
      num_accepted: i32[batch] in 1..D + 1, m = accepted drafts + 1, the
        number of valid entries of `tokens` and of `path`.
      path: i32[batch, D + 1], the accepted nodes root first (path[:, 0] =
        0); entries from m on repeat the last node. Commit with
        ``model.commit(cache, num_accepted, path)``.
    """

    tokens: jax.Array
    num_accepted: jax.Array
    path: jax.Array


def _check_tree_round(logits, drafts, real, tree, q_probs=None):
    """(logits f32[batch, N, vocab], drafts i32[batch, N - 1], real bool[batch, N - 1], q_probs | None)
    checked against the tree and each other."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"`tree` must be a DraftTree; got {type(tree).__name__}")
    if tree.size < 2:
        raise ValueError(f"`tree` must have at least one draft node (N >= 2); got N = {tree.size}")
    logits = v.check_float("logits", logits)
    v.check_rank("logits", logits, "batch, N, vocab")
    batch, nodes, vocab = logits.shape
    if nodes != tree.size:
        raise ValueError(f"`logits` must have one position per tree node, N = {tree.size}; got shape "
                         f"{tuple(logits.shape)}")
    drafts = _checks.int_array("drafts", drafts, "batch, N - 1", (batch, nodes - 1))
    real = v.as_array("real", real)
    if real.dtype != jnp.bool_ or tuple(real.shape) != (batch, nodes - 1):
        raise ValueError(f"`real` must be bool[batch, N - 1] = bool{[batch, nodes - 1]}; got {real.dtype}"
                         f"{list(real.shape)}")
    q_probs = v.optional_float_arg("q_probs", q_probs, "batch, N - 1, vocab", (batch, nodes - 1, vocab))
    return logits.astype(jnp.float32), drafts, real, q_probs


def _emit_path(tree: DraftTree, drafts, last, extra, fill_id: int) -> TreeAccepted:
    """The accepted path ending at node `last` i32[batch] and the extra token there, as a TreeAccepted."""
    path = jnp.asarray(tree.path_table)[last]  # [batch, D + 1]
    m = jnp.asarray(tree.depth, jnp.int32)[last] + 1
    full = jnp.concatenate([jnp.zeros_like(drafts[:, :1]), drafts], axis=1)  # node j's token (root unused)
    along = jnp.take_along_axis(full, path, axis=1)
    position = jnp.arange(path.shape[1])[None, :]
    # Position i < m - 1 holds the draft of path node i + 1; position m - 1 the extra token.
    shifted = jnp.concatenate([along[:, 1:], jnp.zeros_like(along[:, :1])], axis=1)
    tokens = jnp.where(position < m[:, None] - 1, shifted, jnp.where(position == m[:, None] - 1, extra[:, None],
                                                                      fill_id))
    return TreeAccepted(tokens=tokens.astype(jnp.int32), num_accepted=m.astype(jnp.int32),
                        path=path.astype(jnp.int32))


def tree_greedy_acceptance(logits, drafts, real, tree: DraftTree, *, fill_id: int = 0) -> TreeAccepted:
    """Greedy tree acceptance: the deepest path whose drafts all equal the target's argmax.

    Node j >= 1 matches where real[:, j - 1] and drafts[:, j - 1] ==
    argmax(logits[:, parents[j]]); a node is acceptable where it and all its
    ancestors match (the root always is). The kept path ends at the deepest
    acceptable node (ties: the first in node order) and the extra token is
    argmax(logits) there, so tree-speculative greedy decoding emits plain
    greedy decoding's tokens (argmax ties to the lowest id).

    Args:
      logits: f32 | bf16[batch, N, vocab], the target's logits at the N
        nodes of `tree`.
      drafts: integer[batch, N - 1], the drafted token of nodes 1 .. N - 1.
      real: bool[batch, N - 1]: the node holds a real draft (else padding,
        never accepted; its subtree neither).
      tree: the static DraftTree of the round (N >= 2).
      fill_id: the id written after the new tokens (static).

    Returns:
      TreeAccepted(tokens i32[batch, D + 1], num_accepted i32[batch] in
      1..D + 1, path i32[batch, D + 1]).

    Raises:
      TypeError: a non-float `logits`, non-integer `drafts`, `tree` not a
        DraftTree, a non-int `fill_id`.
      ValueError: a tree of one node; `logits` not [batch, N, vocab],
        `drafts` / `real` not [batch, N - 1].
    """
    logits, drafts, real, _ = _check_tree_round(logits, drafts, real, tree)
    fill_id = _check_fill_id(fill_id)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch, N]
    parents = np.asarray(tree.parents[1:])
    match = real & (drafts == target[:, parents])  # [batch, N - 1]
    ok = jnp.concatenate([jnp.ones_like(match[:, :1]), match], axis=1)  # [batch, N]
    acceptable = ~jnp.any(tree.ancestors[None] & ~ok[:, None, :], axis=-1)  # [batch, N]: all of the path
    N = tree.size
    rank = np.asarray(tree.depth) * N + (N - 1 - np.arange(N))  # deeper first, then the first in node order
    last = jnp.argmax(jnp.where(acceptable, rank[None, :], -1), axis=-1).astype(jnp.int32)
    return _emit_path(tree, drafts, last, jnp.take_along_axis(target, last[:, None], axis=1)[:, 0], fill_id)


def tree_sampling_acceptance(logits, drafts, real, tree: DraftTree, key, params: SamplingParams, q_probs=None, *,
                             fill_id: int = 0) -> TreeAccepted:
    """Multi-draft recursive rejection sampling over a draft tree (SpecInfer): emits the target's distribution.

    From the root, with p the target's distribution at the current node
    (softmax of :func:`replayssm_jax.sampling.processed_logits`, as plain
    sampling) and each child x drawn from q (the drafter's distribution
    after the current node, the same for all siblings; None: the point mass
    at x, a deterministic drafter such as top-k), the children are tried in
    node order: x is accepted with probability min(1, p(x) / q(x)) (the test
    u * q(x) < p(x), no division) and the walk moves to it with a fresh p;
    a rejection sets p <- normalize(max(p - q, 0)) (a residual with no mass
    keeps p) and the next child is tried. When every child of the current
    node is rejected, or it is a leaf, the extra token is drawn from p.
    With a deterministic drafter a rejected token's mass is removed, so
    distinct siblings are tried without replacement.

    Randomness: row b uses only fold_in(key, b) (one uniform per node, one
    categorical draw), so rows are independent.

    Args:
      logits, drafts, real, tree, fill_id: as :func:`tree_greedy_acceptance`.
      key: a PRNG key.
      params: SamplingParams (static) with temperature > 0.
      q_probs: f32[batch, N - 1, vocab] (q_probs[:, j - 1]: the distribution
        node j was drawn from, after its parent) or None.

    Returns:
      TreeAccepted as :func:`tree_greedy_acceptance`.

    Raises:
      TypeError: `params` not a SamplingParams, a bad key; otherwise as
        :func:`tree_greedy_acceptance`.
      ValueError: greedy `params`; as :func:`tree_greedy_acceptance`;
        `q_probs` not [batch, N - 1, vocab].
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"`params` must be a SamplingParams; got {type(params).__name__}")
    if params.greedy:
        raise ValueError("`params` must have temperature > 0 for tree_sampling_acceptance; greedy params "
                         "(temperature 0) take tree_greedy_acceptance")
    logits, drafts, real, q_probs = _check_tree_round(logits, drafts, real, tree, q_probs)
    key = _checks.check_key(key)
    fill_id = _check_fill_id(fill_id)
    batch, N, vocab = logits.shape
    p_nodes = jnp.exp(token_log_probs(logits, params))  # [batch, N, vocab]
    accept_key, token_key = _checks.row_keys(key, batch, 2)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (N,)))(accept_key)  # node j's uniform at [:, j]

    current = jnp.zeros((batch,), jnp.int32)  # the walk's node
    walking = jnp.ones((batch,), bool)  # the last step moved down: the current node's children are tried
    p = p_nodes[:, 0]
    for level in tree.per_depth[1:]:
        chosen = jnp.full((batch,), -1, jnp.int32)
        for j in level:  # the candidates of this depth in node order; those under `current` take part
            x = drafts[:, j - 1]
            q = jax.nn.one_hot(x, vocab, dtype=jnp.float32) if q_probs is None else q_probs[:, j - 1]
            active = walking & (current == tree.parents[j]) & (chosen < 0) & real[:, j - 1]
            in_vocab = (x >= 0) & (x < vocab)
            index = jnp.clip(x, 0, vocab - 1)[:, None]
            p_x = jnp.take_along_axis(p, index, axis=1)[:, 0]
            q_x = jnp.take_along_axis(q, index, axis=1)[:, 0]
            accept = active & in_vocab & (u[:, j] * q_x < p_x)
            residual = _residual_probs(p, q)
            mass = jnp.sum(residual, axis=-1, keepdims=True)
            rejected = (active & ~accept)[:, None] & (mass > 0)
            p = jnp.where(rejected, residual / jnp.where(mass > 0, mass, 1.0), p)
            chosen = jnp.where(accept, j, chosen)
        moved = chosen >= 0
        current = jnp.where(moved, chosen, current)
        p = jnp.where(moved[:, None], jnp.take_along_axis(p_nodes, current[:, None, None], axis=1)[:, 0], p)
        walking = moved
    extra = jax.vmap(jax.random.categorical)(token_key, jnp.log(p)).astype(jnp.int32)
    return _emit_path(tree, drafts, current, extra, fill_id)
