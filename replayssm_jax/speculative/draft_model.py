"""A separate draft model as the drafter of speculative decoding (ARCHITECTURE.md, "Speculative decoding").

Any model this project loads (`models.load_model`) with the target's
vocabulary drafts for it: greedy (the argmax) or sampled drafts (q = the
draft model's distribution after the run's temperature, top-k and top-p,
`choose_drafts`). The draft model keeps its own `models.HybridCache` (the
target's state mode and buffer length L, prefilled over the same prefix
with max_window = W = K + 1) as the drafter's state in the loop's carry.

**The scheme** (exact, no rollback of committed steps). Between rounds the
draft cache has consumed the history up to position q <= p + 1, with p the
target's position (history[p] is the last accepted token). A round:

1. verify the window history[q .. q + W - 1] on the draft cache and commit
   its first n = p + 1 - q positions (0..W: the tokens the target kept in the
   previous round, or the last token alone after the prefill); the logits at
   position n - 1 give draft 1, and the draft cache now stands at p + 1;
2. for j = 2..K: verify the window [d_1, .., d_{j-1}, padding] and commit 0
   positions (the records of a verified window are dead until committed, so
   the cache is unchanged and its buffers are updated in place); the logits
   at position j - 2 give draft j.

The target keeps m of its W positions; the next round's step 1 consumes them
(n = m). K draft-model calls per round, each a verify of W tokens: on a GPU
one such call costs about one decode step (a decode step is memory-bound, so
W tokens read the same weights and states once), so a round costs K draft
steps and one target verify. A done row (m = 0) has n = 0 from then on.

The draft cache's KV capacity is the history's length (the target's
max_len + W), which holds the window at p + 1 for every p the target reaches.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from replayssm_jax.ops import validate as v
from replayssm_jax.sampling import SamplingParams
from replayssm_jax.speculative import _checks
from replayssm_jax.speculative.drafters import DraftStart, Drafts, Kept, choose_drafts, gather_rows

__all__ = ["DraftModelDrafter", "check_draft_model", "tokenizer_vocabulary"]


def tokenizer_vocabulary(folder: str | os.PathLike) -> dict[str, int] | None:
    """{token: id} of the folder's tokenizer.json (its model's vocabulary and the added
    tokens), or None when the folder has no tokenizer.json.

    Raises:
      ValueError: a tokenizer.json that is not JSON or has no vocabulary (naming the file).
    """
    path = os.path.join(os.fspath(folder), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        vocab = data["model"]["vocab"]
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
            vocab = {piece[0]: i for i, piece in enumerate(vocab)}
        vocab = {str(tok): int(i) for tok, i in vocab.items()}
        for added in data.get("added_tokens", ()):
            vocab[str(added["content"])] = int(added["id"])
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{path}: not a tokenizer.json with a vocabulary (model.vocab): {e!r}") from None
    return vocab


def check_draft_model(target_config, draft_config, *, target_checkpoint=None, draft_checkpoint=None) -> None:
    """Raise unless a draft model can draft for the target: the same vocab_size and, where
    both checkpoint folders are given and both have a tokenizer.json, the same vocabulary
    (every token with the same id).

    Args:
      target_config, draft_config: the two models' configs (with ``vocab_size``).
      target_checkpoint, draft_checkpoint: the models' folders, or None (not known).

    Raises:
      ValueError: another vocab_size, or tokenizers whose vocabularies differ (naming both
        folders and a token that differs); as `tokenizer_vocabulary`.
    """
    target_vocab, draft_vocab = int(target_config.vocab_size), int(draft_config.vocab_size)
    draft_name = "" if draft_checkpoint is None else f" ({os.fspath(draft_checkpoint)})"
    target_name = "" if target_checkpoint is None else f" ({os.fspath(target_checkpoint)})"
    if target_vocab != draft_vocab:
        raise ValueError(f"the draft model{draft_name} has vocab_size = {draft_vocab}; the target{target_name} has "
                         f"{target_vocab} (a draft model must share the target's vocabulary)")
    if target_checkpoint is None or draft_checkpoint is None:
        return
    target_tok, draft_tok = tokenizer_vocabulary(target_checkpoint), tokenizer_vocabulary(draft_checkpoint)
    if target_tok is None or draft_tok is None or target_tok == draft_tok:
        return
    differ = sorted(t for t in set(target_tok) | set(draft_tok) if target_tok.get(t) != draft_tok.get(t))
    token = differ[0]
    raise ValueError(f"the draft model's tokenizer ({os.path.join(os.fspath(draft_checkpoint), 'tokenizer.json')}) "
                     f"differs from the target's ({os.path.join(os.fspath(target_checkpoint), 'tokenizer.json')}): "
                     f"{len(differ)} tokens have another id or are missing, e.g. {token!r}: id "
                     f"{draft_tok.get(token)} in the draft's, {target_tok.get(token)} in the target's (a draft model "
                     f"must share the target's vocabulary)")


@struct.dataclass
class DraftModelDrafter:
    """Drafts from a separate model of the target's vocabulary (the module docstring gives the scheme).

    Build it with `DraftModelDrafter.for_model`. A pytree: the draft model's
    parameters are its leaves (traced when the drafter is an argument of a
    jitted function), the rest is static. Its state in the loop is the draft
    model's `HybridCache`.

    Attributes:
      params: the draft model's parameters (`nnx.split(model)[1]`).
      graphdef: the draft model's static structure.
      num_speculative_tokens: K >= 1 drafts per round (every row proposes K).
      sampling: greedy (temperature 0: argmax drafts, q_probs None) or the
        run's sampling (drafts drawn from softmax(processed logits), q_probs
        that distribution).
      replay_buffer_len: the target's ReplaySSM buffer length L, or None for
        the standard state (W = K + 1 <= L).
      buffer_dtype: the ReplaySSM buffer dtype (None: each layer's narrowest exact one).
      backend: SSM op backend of the draft model's ops.
      scores: the Drafts also carry the draft model's logits at each draft
        position (`Drafts.scores`: a draft tree's other candidates).
    """

    params: Any
    graphdef: Any = struct.field(pytree_node=False)
    num_speculative_tokens: int = struct.field(pytree_node=False)
    sampling: SamplingParams = struct.field(pytree_node=False, default=SamplingParams())
    replay_buffer_len: int | None = struct.field(pytree_node=False, default=None)
    buffer_dtype: Any = struct.field(pytree_node=False, default=None)
    backend: str | None = struct.field(pytree_node=False, default=None)
    scores: bool = struct.field(pytree_node=False, default=False)

    #: The drafts depend on the token history only.
    needs_hidden = False

    @classmethod
    def for_model(cls, model, num_speculative_tokens: int, *, sampling: SamplingParams = SamplingParams(),
                  replay_buffer_len: int | None = None, buffer_dtype=None,
                  backend: str | None = None) -> "DraftModelDrafter":
        """The drafter of draft model `model` (a models.* causal LM with `prefill`, `verify`, `commit`).

        Raises:
          TypeError: `model` not an nnx.Module with a config, `sampling` not a SamplingParams.
          ValueError: K not an int >= 1, or K + 1 > replay_buffer_len.
        """
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise TypeError(f"`model` must be a model of this package (an nnx.Module with a `config`); got "
                            f"{type(model).__name__}")
        k = v.check_positive_int("num_speculative_tokens", num_speculative_tokens)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"`sampling` must be a SamplingParams; got {type(sampling).__name__}")
        if replay_buffer_len is not None and k + 1 > replay_buffer_len:
            raise ValueError(f"`num_speculative_tokens` + 1 = {k + 1} verified positions must be <= "
                             f"`replay_buffer_len` = {replay_buffer_len}")
        graphdef, params = nnx.split(model)
        return cls(params=params, graphdef=graphdef, num_speculative_tokens=k, sampling=sampling,
                   replay_buffer_len=replay_buffer_len, buffer_dtype=buffer_dtype, backend=backend)

    @property
    def weights_bytes(self) -> int:
        """Bytes of the draft model's parameters (also of an abstract model's)."""
        return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self.params))

    @property
    def window(self) -> int:
        """W = K + 1, the positions of each verify of the draft model."""
        return self.num_speculative_tokens + 1

    def init_state(self, target, start: DraftStart):
        """The draft model prefilled over history[:, :P] with max_window = W.

        Returns:
          The draft model's HybridCache at position P, KV capacity the history's length.
        """
        model = nnx.merge(self.graphdef, self.params)
        max_len = start.history.shape[1] - self.window + 1
        _, cache = model.prefill(start.history[:, :start.prefix_len], max_len,
                                 replay_buffer_len=self.replay_buffer_len, buffer_dtype=self.buffer_dtype,
                                 backend=self.backend, last_logits_only=True, max_window=self.window)
        return cache

    def draft(self, target, cache, history, lengths, key) -> tuple[Drafts, Any]:
        """K drafts per row after history[:, :lengths] (the module docstring's steps 1 and 2).

        Args:
          target: unused (the target model).
          cache: the draft model's HybridCache (from `init_state` or the last round), at a
            position q with lengths - W <= q <= lengths per row.
          history: i32[rows, max_len]; lengths: i32[rows], the tokens known (the last one
            is the token the target verifies first).
          key: a PRNG key (used when sampling; row b draws from fold_in(key, b)).

        Returns:
          (Drafts(tokens i32[rows, K], num_drafts = K, q_probs f32[rows, K, vocab] or None),
          the draft cache at position lengths).
        """
        model = nnx.merge(self.graphdef, self.params)
        k, w = self.num_speculative_tokens, self.window
        rows = history.shape[0]
        keys = None if self.sampling.greedy else _checks.row_keys(key, rows, k)
        n = jnp.clip(lengths - cache.position, 0, w)
        known = gather_rows(history, cache.position[:, None] + jnp.arange(w))

        def step(carry, xs):
            # i = 0: the known tokens' window, n positions committed, draft 1 read at n - 1;
            # i >= 1: the window [d_1, .., d_i, padding], nothing committed, draft i + 1 read at i - 1.
            cache, drafts = carry
            i, step_keys = xs
            window = jnp.where(i == 0, known, jnp.where(jnp.arange(w) < i, jnp.pad(drafts, ((0, 0), (0, 1))), 0))
            logits, cache = model.verify(window, cache, backend=self.backend)
            at = jnp.where(i == 0, jnp.maximum(n - 1, 0), i - 1)
            read = jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]
            token, q = choose_drafts(read, self.sampling, step_keys)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, token, i, axis=1)
            return (model.commit(cache, jnp.where(i == 0, n, 0)), drafts), (q, read if self.scores else None)

        (cache, drafts), (q, scores) = jax.lax.scan(step, (cache, jnp.zeros((rows, k), jnp.int32)),
                                                    (jnp.arange(k), keys))
        q_probs = None if q is None else jnp.swapaxes(q, 0, 1)
        scores = None if scores is None else jnp.swapaxes(scores, 0, 1)
        return Drafts(tokens=drafts, num_drafts=jnp.full((rows,), k, jnp.int32), q_probs=q_probs,
                      scores=scores), cache

    def update(self, target, cache, kept: Kept):
        """The draft cache unchanged: the next `draft` consumes the kept tokens from the history."""
        return cache
