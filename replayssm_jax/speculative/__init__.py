"""Speculative decoding's model-free parts (DESIGN.md sections 3 and 7).

- :mod:`replayssm_jax.speculative.drafters`: the drafter interface
  (:class:`Drafts`, :class:`Drafter`) and the weight-free drafters
  (:class:`NgramDrafter`, prompt lookup; :class:`OracleDrafter`, for
  benchmarks and tests).
- :mod:`replayssm_jax.speculative.acceptance`: the acceptance rules, greedy
  and distribution-preserving speculative sampling, giving the new tokens of
  a round and how many every layer commits.
- :mod:`replayssm_jax.speculative.loop`: the loop itself, one compiled round
  (draft, verify, accept, commit) in blocks of rounds under
  `lax.while_loop`; `replayssm_jax.generation.Generator(speculative=...)`
  runs it.
"""

from replayssm_jax.speculative.acceptance import (
    Accepted,
    accept_drafts,
    greedy_acceptance,
    sampling_acceptance,
)
from replayssm_jax.speculative.drafters import Drafter, Drafts, NgramDrafter, OracleDrafter, check_history
from replayssm_jax.speculative.loop import SpeculativeCarry, make_block, speculative_round

__all__ = [
    "Accepted",
    "Drafter",
    "Drafts",
    "NgramDrafter",
    "OracleDrafter",
    "SpeculativeCarry",
    "accept_drafts",
    "check_history",
    "greedy_acceptance",
    "make_block",
    "sampling_acceptance",
    "speculative_round",
]
