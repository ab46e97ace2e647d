"""The Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, ICLR 2025), Hugging Face names.

Matches transformers' `Qwen3NextGatedDeltaNet` (packed projections) and
`Qwen3_5GatedDeltaNet` (separate projections):

    q, k, v, z, b, a = projections(u)
    qkv = silu(conv1d([q ; k ; v]))           causal depthwise, width W, conv_state
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)      (float32, formed by the ops)
    o = GDN(q, k, v, g, beta)                  L2-normalised q, k; scale K**-0.5 (replayssm_jax.ops)
    o = norm(o, z)                             per value head: weight * rmsnorm(o) * silu(z)
    out = out_proj(o)

Dimension names: batch, T = seqlen, H = linear_num_key_heads, HV =
linear_num_value_heads (value head h uses key head h // (HV // H)),
K = linear_key_head_dim, V = linear_value_head_dim, W = linear_conv_kernel_dim,
conv_dim = 2 * H * K + HV * V.

Projection layouts:
- packed (Qwen3-Next): ``in_proj_qkvz`` [H * (2K + 2 (HV/H) V), hidden], laid out per
  key head as [q (K) | k (K) | v ((HV/H) V) | z ((HV/H) V)]; ``in_proj_ba``
  [2 HV, hidden], per key head [b (HV/H) | a (HV/H)].
- separate (Qwen3.5): ``in_proj_qkv`` [2 H K + HV V, hidden] as [q | k | v],
  ``in_proj_z`` [HV V, hidden], ``in_proj_b``, ``in_proj_a`` [HV, hidden].

The recurrent state is value-major, [batch, HV, V, K] (transformers stores
[batch, HV, K, V]). The three modes (prefill with ``ops.gdn_chunked``, standard
decode with ``ops.gdn_step``, ReplaySSM decode with ``ops.gdn_replay_step`` on a
state from `to_replay`) and the speculative `verify` / `commit` come from
`replayssm_jax.layers.ssm_mixer.SSMMixer`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from replayssm_jax import kernels, ops
from replayssm_jax.layers.cache import ConvWindow, SSMLayerState
from replayssm_jax.layers.conv import CausalConv1d
from replayssm_jax.layers.linear import Linear, default_rngs
from replayssm_jax.layers.norms import GatedRMSNorm
from replayssm_jax.layers.ssm_mixer import SSMMixer, check_mixer_config
from replayssm_jax.state import in_order

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(SSMMixer):
    """Gated DeltaNet token mixer.

    Args:
      hidden_size: model width.
      num_k_heads, num_v_heads, head_k_dim, head_v_dim: H, HV, K, V (H divides HV).
      conv_kernel: W.
      packed: Qwen3-Next packed projections (``in_proj_qkvz``, ``in_proj_ba``) if
        True, else Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
      norm_eps: epsilon of the gated RMSNorm (`rms_norm_eps`).
      chunk_size: chunk length of the prefill form.
      ssm_state_dtype: dtype of the ssm_state / checkpoint kept between steps.

    Parameters: the projections above, ``conv1d`` (weight [conv_dim, 1, W], no
    bias), ``dt_bias`` [HV], ``A_log`` [HV], ``norm`` (weight [V]), ``out_proj``.

    Raises:
      TypeError: a size not an int, an ssm_state_dtype other than float32 or bfloat16.
      ValueError: a size below 1, or H does not divide HV.
    """

    chunked_op = staticmethod(ops.gdn_chunked)
    step_op = staticmethod(ops.gdn_step)
    replay_step_op = staticmethod(ops.gdn_replay_step)
    replay_init_op = staticmethod(ops.gdn_replay_init)
    replay_verify_op = staticmethod(ops.gdn_replay_verify)
    verify_op = staticmethod(ops.gdn_verify)

    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, packed: bool, norm_eps: float = 1e-6, chunk_size: int = 64,
                 activation: str = "silu", ssm_state_dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        check_mixer_config("GatedDeltaNet", ssm_state_dtype, hidden_size=hidden_size, num_k_heads=num_k_heads,
                           num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                           conv_kernel=conv_kernel, chunk_size=chunk_size)
        rngs = default_rngs(rngs)
        if num_v_heads % num_k_heads:
            raise ValueError(f"GatedDeltaNet: `linear_num_key_heads` must divide linear_num_value_heads = "
                             f"{num_v_heads}; got {num_k_heads}")
        self.hidden_size = hidden_size
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.packed = packed
        self.chunk_size = chunk_size
        self.ssm_state_dtype = ssm_state_dtype
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kw = dict(bias=False, param_dtype=param_dtype, rngs=rngs)
        if packed:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, **kw)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, **kw)
        else:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, **kw)
            self.in_proj_z = Linear(hidden_size, self.value_dim, **kw)
            self.in_proj_b = Linear(hidden_size, num_v_heads, **kw)
            self.in_proj_a = Linear(hidden_size, num_v_heads, **kw)
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel, bias=False, activation=activation,
                                   param_dtype=param_dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((num_v_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, num_v_heads, dtype=jnp.float32)))
        self.norm = GatedRMSNorm(head_v_dim, group_size=head_v_dim, eps=norm_eps, norm_before_gate=True,
                                 param_dtype=param_dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, **kw)

    # -- pieces -------------------------------------------------------------------------------
    def _project(self, u):
        """u [..., hidden] -> (qkv [..., conv_dim] in conv channel order, z [..., HV, V], b, a [..., HV])."""
        lead = u.shape[:-1]
        H, K, V = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // H
        if self.packed:
            qkvz = self.in_proj_qkvz(u).reshape(*lead, H, 2 * K + 2 * r * V)
            q = qkvz[..., :K].reshape(*lead, H * K)
            k = qkvz[..., K:2 * K].reshape(*lead, H * K)
            v = qkvz[..., 2 * K:2 * K + r * V].reshape(*lead, H * r * V)
            z = qkvz[..., 2 * K + r * V:].reshape(*lead, self.num_v_heads, V)
            ba = self.in_proj_ba(u).reshape(*lead, H, 2 * r)
            b = ba[..., :r].reshape(*lead, self.num_v_heads)
            a = ba[..., r:].reshape(*lead, self.num_v_heads)
            qkv = jnp.concatenate([q, k, v], axis=-1)
        else:
            qkv = self.in_proj_qkv(u)
            z = self.in_proj_z(u).reshape(*lead, self.num_v_heads, V)
            b = self.in_proj_b(u)
            a = self.in_proj_a(u)
        return qkv, z, b, a

    def _heads(self, q, k, v):
        """q, k [..., H K], v [..., HV V] -> [..., H, K], [..., H, K], [..., HV, V] (free reshapes)."""
        lead = q.shape[:-1]
        H, K = self.num_k_heads, self.head_k_dim
        return q.reshape(*lead, H, K), k.reshape(*lead, H, K), v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def _ssm_inputs(self, u, conv_state, conv):
        qkv, z, b, a = self._project(u)
        # the conv returns q, k and v apart (in a decode step from its kernel, no slice: ops.conv_update)
        (q, k, v), conv_state = conv(qkv, conv_state, splits=(self.key_dim, 2 * self.key_dim))
        q, k, v = self._heads(q, k, v)
        # the raw gates: the ops form g and beta (inside the kernels in a decode step, no XLA launch)
        return dict(q=q, k=k, v=v, a=a, b=b), z, conv_state

    def _fused_step(self, u, state: SSMLayerState, backend: str | None):
        """The standard step with the conv fused (`ops.gdn_conv_step`: one launch forms q, k and v from the
        conv input and the ring and steps the state) where the op runs a kernel, the conv has no bias and an
        activation the kernel computes, the launch takes the shapes (`kernels.conv_step_fits`) and
        `kernels.fuse_conv_default` takes the batch; else None."""
        window, ssm_state = state.conv_state, state.ssm_state
        if (ops.backend_for("gdn_conv_step", backend) == "xla" or self.conv1d.bias is not None
                or self.conv1d.activation not in kernels.CONV_ACTIVATIONS
                or not kernels.fuse_conv_default(window.batch, ssm_state.dtype)):
            return None
        if kernels.conv_step_fits(ssm_state, self.conv_dim) is not None:
            return None
        qkv, z, b, a = self._project(u)
        o, ssm_state, columns = ops.gdn_conv_step(ssm_state, qkv, window.columns, window.start,
                                                  self.conv1d.weight[...][:, 0, :], num_k_heads=self.num_k_heads,
                                                  a=a, b=b, activation=self.conv1d.activation, backend=backend,
                                                  **self._op_params())
        window, o = in_order(window.replace(columns=columns), o)  # the kernel has read start before it moves
        return self._finish(o, z), SSMLayerState(conv_state=window.advance(1), ssm_state=ssm_state)

    def _op_params(self):
        return dict(use_qk_l2norm=True, A_log=self.A_log[...], dt_bias=self.dt_bias[...])

    def _replay_init_params(self):
        return dict(num_k_heads=self.num_k_heads)

    def exact_buffer_dtype(self, state: SSMLayerState):
        """The records' dtype for buffer_dtype None: float32, as the step computes them (the normalized
        keys, the deltas d = beta (v - S k)); a narrower buffer rounds them."""
        del state
        return jnp.dtype(jnp.float32)

    def _finish(self, o, z):
        o = self.norm(o.astype(z.dtype), z)
        return self.out_proj(o.reshape(*o.shape[:-2], self.value_dim))

    def state_dims(self) -> tuple[int, int, int]:
        """(HV, V, K): the value-major ssm_state [batch, HV, V, K] per row."""
        return self.num_v_heads, self.head_v_dim, self.head_k_dim

    def init_state(self, batch: int, dtype=jnp.float32) -> SSMLayerState:
        """The state of an empty prefix: zero conv window (max_window 1) and ssm_state [batch, HV, V, K]."""
        return SSMLayerState(conv_state=ConvWindow.from_conv_state(self.conv1d.init_state(batch, dtype)),
                             ssm_state=jnp.zeros((batch, *self.state_dims()), self.ssm_state_dtype))
