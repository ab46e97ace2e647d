"""Pure-JAX reference of every ReplaySSM op: the ground truth for the kernels.

Glossary (letters used in shapes; config field; paper symbol):

  Mamba-2 (mamba_ssm / transformers Mamba2, NemotronH)
    batch                          sequences in the batch
    H  nheads      num_heads / mamba_num_heads     heads
    P  head_dim    head_dim / mamba_head_dim       per-head channels (x)
    N  d_state     state_size / ssm_state_size     state size (B, C)
    G  n_groups    n_groups / mamba_n_groups       B/C groups; head h uses group h // (H // G)
    A  f32[H] = -exp(A_log), negative; dt_bias [H]; D [H]; dt_limit = time_step_limit

  Gated DeltaNet (flash-linear-attention / Qwen3-Next, Qwen3.5)
    H   linear_num_key_heads       key heads (q, k)
    HV  linear_num_value_heads     value heads; value head h uses key head h // (HV // H)
    K   linear_key_head_dim        key / query dim
    V   linear_value_head_dim      value dim
    g   log decay <= 0 = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b) in (0, 1)

  ReplaySSM (ARCHITECTURE.md)
    L   buffer length (steps buffered between flushes);  W  verify window length
    checkpoint [batch, heads, V, K] (Mamba-2: V = head_dim, K = d_state)
    scale f32[batch, heads, V], one per row of an int8 | float8_e4m3fn checkpoint (over K)
    cursor i32[batch], steps buffered since the checkpoint

  Per-draft standard verify (the speculative baseline, *_verify)
    slotted state [batch, slots, heads, V, K], one state per draft position
    index i32[batch], the slot of each row's current state; draft t's at (index + 1 + t) mod slots

States are value-major, [batch, heads, V, K], as mamba_ssm's ssm_state and
FLA's recurrent state; transformers' GDN cache is [batch, HV, K, V].
Everything runs under jax.jit and is batched over batch and heads; all
arithmetic is float32, clear rather than fast.

This package holds the math only. Its functions take arguments as
:mod:`replayssm_jax.ops` validates them (the same names and signatures,
less `backend` and `config`; a replay step's route is "output", "state" or
"direct", with "auto" resolved by the ops) and check nothing themselves:
called with bad shapes or dtypes they may fail with JAX's own errors, or
return garbage. Call :mod:`replayssm_jax.ops` with backend="xla" for the
same math with every argument checked.
"""

from replayssm_jax.reference.attention import attend, attention_decode
from replayssm_jax.reference.conv import conv_update
from replayssm_jax.reference.gdn import (
    gdn_chunked,
    gdn_conv_step,
    gdn_gates,
    gdn_replay_flush,
    gdn_replay_materialize,
    gdn_replay_step,
    gdn_replay_verify,
    gdn_step,
    gdn_verify,
)
from replayssm_jax.reference.mamba2 import (
    mamba2_chunked,
    mamba2_replay_flush,
    mamba2_replay_materialize,
    mamba2_replay_step,
    mamba2_replay_verify,
    mamba2_step,
    mamba2_verify,
)
from replayssm_jax.state import (
    GDNReplayState,
    Mamba2ReplayState,
    gdn_replay_init,
    mamba2_replay_init,
    replay_commit,
)

__all__ = [
    "GDNReplayState",
    "Mamba2ReplayState",
    "attend",
    "attention_decode",
    "conv_update",
    "gdn_chunked",
    "gdn_conv_step",
    "gdn_gates",
    "gdn_replay_flush",
    "gdn_replay_init",
    "gdn_replay_materialize",
    "gdn_replay_step",
    "gdn_replay_verify",
    "gdn_step",
    "gdn_verify",
    "mamba2_chunked",
    "mamba2_replay_flush",
    "mamba2_replay_init",
    "mamba2_replay_materialize",
    "mamba2_replay_step",
    "mamba2_replay_verify",
    "mamba2_step",
    "mamba2_verify",
    "replay_commit",
]
