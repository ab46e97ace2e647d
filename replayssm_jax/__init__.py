"""replayssm-jax: ReplaySSM decoding of hybrid SSM language models in JAX.

The public ops live in :mod:`replayssm_jax.ops` (arguments validated, with
a `backend=` choice); :mod:`replayssm_jax.reference` is the pure-JAX ground
truth (math only); the replay state pytrees are in :mod:`replayssm_jax.state`.
The replay-state functions below are those of :mod:`replayssm_jax.ops`.
"""

from replayssm_jax.ops import (
    GDNReplayState,
    Mamba2ReplayState,
    gdn_replay_init,
    mamba2_replay_init,
    replay_commit,
)

__version__ = "0.1.0"

__all__ = [
    "GDNReplayState",
    "Mamba2ReplayState",
    "gdn_replay_init",
    "mamba2_replay_init",
    "replay_commit",
]
