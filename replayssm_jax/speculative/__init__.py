"""Speculative decoding's model-free parts (ARCHITECTURE.md, "The verify window" and "Speculative decoding").

- :mod:`replayssm_jax.speculative.drafters`: the drafter interface
  (:class:`Drafts`, :class:`Drafter` with its state: :class:`DraftStart`,
  :class:`Kept`; :class:`StatelessDrafter`) and the weight-free drafters
  (:class:`NgramDrafter`, prompt lookup; :class:`OracleDrafter`, for
  benchmarks and tests).
- :mod:`replayssm_jax.speculative.draft_model`: a separate draft model as the
  drafter (:class:`DraftModelDrafter`); the MTP head's drafter is
  `models.mtp.MTPDrafter`.
- :mod:`replayssm_jax.speculative.acceptance`: the acceptance rules, greedy
  and distribution-preserving speculative sampling, giving the new tokens of
  a round and how many every layer commits.
- :mod:`replayssm_jax.speculative.tree`: the static draft tree of tree
  speculation (:class:`DraftTree`: parent indices, derived masks, the chain
  and top-k shapes); :mod:`replayssm_jax.speculative.tree_acceptance`: its
  acceptance rules (greedy; multi-draft recursive rejection sampling).
- :mod:`replayssm_jax.speculative.loop`: the loop itself, one compiled round
  (draft, verify, accept, commit) in blocks of rounds under
  `lax.while_loop`; `replayssm_jax.generation.Generator(speculative=...)`
  runs it.
"""

from replayssm_jax.speculative.acceptance import (
    Accepted,
    accept_drafts,
    accept_drafts_batch,
    greedy_acceptance,
    sampling_acceptance,
)
from replayssm_jax.speculative.draft_model import DraftModelDrafter
from replayssm_jax.speculative.drafters import (
    Drafter,
    Drafts,
    DraftStart,
    Kept,
    NgramDrafter,
    OracleDrafter,
    StatelessDrafter,
    check_history,
    choose_drafts,
)
from replayssm_jax.speculative.loop import SpeculativeCarry, make_block, speculative_round
from replayssm_jax.speculative.tree import DraftTree, as_tree
from replayssm_jax.speculative.tree_acceptance import TreeAccepted, tree_greedy_acceptance, tree_sampling_acceptance

__all__ = [
    "Accepted",
    "DraftModelDrafter",
    "DraftStart",
    "DraftTree",
    "Drafter",
    "Drafts",
    "Kept",
    "NgramDrafter",
    "OracleDrafter",
    "SpeculativeCarry",
    "StatelessDrafter",
    "TreeAccepted",
    "accept_drafts",
    "accept_drafts_batch",
    "as_tree",
    "check_history",
    "choose_drafts",
    "greedy_acceptance",
    "make_block",
    "sampling_acceptance",
    "speculative_round",
    "tree_greedy_acceptance",
    "tree_sampling_acceptance",
]
