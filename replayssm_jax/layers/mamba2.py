"""The Mamba-2 mixer (Dao & Gu 2024), with Hugging Face parameter names.

Matches transformers' `Mamba2Mixer` and `NemotronHMamba2Mixer` (torch_forward):

    zxbcdt = in_proj(u)                        [batch, T, d_inner + conv_dim + nheads]
    z, xBC, dt = split(zxbcdt)                 d_inner, conv_dim = d_inner + 2 G N, nheads
    xBC = silu(conv1d(xBC))                    causal depthwise, width W, conv_state
    x, B, C = split(xBC)                       [.., nheads, head_dim], [.., G, N], [.., G, N]
                                               (the conv reads xBC in zxbcdt and returns x, B, C apart)
    y = SSM(x, dt, A = -exp(A_log), B, C, D, dt_bias, dt_limit)   (replayssm_jax.ops; dt read in zxbcdt)
    y = norm(y, z)                             gated RMSNorm, groups of norm_group_size
    out = out_proj(y)

Dimension names: batch, T = seqlen, H = nheads, P = head_dim, N = d_state
(`state_size` / `ssm_state_size`), G = n_groups, W = conv_kernel,
d_inner = H * P, conv_dim = d_inner + 2 * G * N.

The three modes (prefill with ``ops.mamba2_chunked``, standard decode with
``ops.mamba2_step``, ReplaySSM decode with ``ops.mamba2_replay_step`` on a state
from `to_replay`) and the speculative `verify` / `commit` come from
`replayssm_jax.layers.ssm_mixer.SSMMixer`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax.layers.cache import ConvWindow, SSMLayerState
from replayssm_jax.layers.conv import CausalConv1d
from replayssm_jax.layers.linear import Linear, default_rngs
from replayssm_jax.layers.norms import GatedRMSNorm
from replayssm_jax.layers.ssm_mixer import SSMMixer, check_mixer_config

__all__ = ["Mamba2Mixer"]


class Mamba2Mixer(SSMMixer):
    """Mamba-2 mixer: in_proj, conv1d, SSM, gated RMSNorm, out_proj.

    Args:
      hidden_size: model width.
      num_heads, head_dim, state_size, n_groups: H, P, N, G (G must divide H).
      conv_kernel: W.
      use_conv_bias: conv1d has a bias.
      use_bias: in_proj / out_proj have biases.
      chunk_size: chunk length of the prefill (SSD) form.
      dt_limit: (low, high) clamp of the processed dt. Plain Mamba2 uses the
        config's `time_step_limit`; transformers' Nemotron-H clamps at
        `time_step_min` from below (see models.nemotron_h).
      norm_eps: epsilon of the gated RMSNorm.
      norm_group_size: group size of the gated RMSNorm (Nemotron-H: d_inner // G;
        transformers' Mamba2: d_inner).
      ssm_state_dtype: dtype of the ssm_state / checkpoint kept between steps.

    Parameters: ``in_proj``, ``conv1d`` (weight [conv_dim, 1, W], bias), ``dt_bias`` [H],
    ``A_log`` [H], ``D`` [H], ``norm`` (weight [d_inner]), ``out_proj``.

    Raises:
      TypeError: a size not an int, an ssm_state_dtype other than float32 or bfloat16.
      ValueError: a size below 1, G does not divide H, or norm_group_size does not divide d_inner.
    """

    chunked_op = staticmethod(ops.mamba2_chunked)
    step_op = staticmethod(ops.mamba2_step)
    replay_step_op = staticmethod(ops.mamba2_replay_step)
    replay_init_op = staticmethod(ops.mamba2_replay_init)
    replay_verify_op = staticmethod(ops.mamba2_replay_verify)
    verify_op = staticmethod(ops.mamba2_verify)

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int = 4, use_conv_bias: bool = True, use_bias: bool = False, chunk_size: int = 128,
                 dt_limit: tuple[float, float] = (0.0, math.inf), norm_eps: float = 1e-5,
                 norm_group_size: int | None = None, activation: str = "silu", ssm_state_dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        check_mixer_config("Mamba2Mixer", ssm_state_dtype, hidden_size=hidden_size, num_heads=num_heads,
                           head_dim=head_dim, state_size=state_size, n_groups=n_groups, conv_kernel=conv_kernel,
                           chunk_size=chunk_size)
        rngs = default_rngs(rngs)
        if num_heads % n_groups:
            raise ValueError(f"Mamba2Mixer: `n_groups` must divide nheads = {num_heads}; got {n_groups}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.state_size = state_size
        self.n_groups = n_groups
        self.chunk_size = chunk_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.ssm_state_dtype = ssm_state_dtype
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * state_size
        self.in_proj = Linear(hidden_size, self.d_inner + self.conv_dim + num_heads, bias=use_bias,
                              param_dtype=param_dtype, rngs=rngs)
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel, bias=use_conv_bias, activation=activation,
                                   param_dtype=param_dtype, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.full((num_heads,), math.log(math.expm1(0.01)), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, num_heads + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((num_heads,), jnp.float32))
        self.norm = GatedRMSNorm(self.d_inner, group_size=norm_group_size or self.d_inner, eps=norm_eps,
                                 norm_before_gate=False, param_dtype=param_dtype)
        self.out_proj = Linear(self.d_inner, hidden_size, bias=use_bias, param_dtype=param_dtype, rngs=rngs)

    # -- pieces -------------------------------------------------------------------------------
    def _heads(self, x, B, C):
        """x [..., d_inner], B and C [..., G N] -> [..., H, P], [..., G, N], [..., G, N] (free reshapes)."""
        lead = x.shape[:-1]
        return (x.reshape(*lead, self.num_heads, self.head_dim), B.reshape(*lead, self.n_groups, self.state_size),
                C.reshape(*lead, self.n_groups, self.state_size))

    def _op_params(self):
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        return dict(A=A, D=self.D[...], dt_bias=self.dt_bias[...], dt_softplus=True, dt_limit=self.dt_limit,
                    dt_offset=self.d_inner + self.conv_dim)  # dt: the last H columns of zxbcdt

    def _ssm_inputs(self, u, conv_state, conv):
        # The conv reads xBC at its offset in in_proj's output and returns x, B and C apart (in a decode
        # step one kernel launch, no slice of zxbcdt or of the conv's output: ops.conv_update); the SSM
        # kernels read dt inside zxbcdt (dt_offset, `_op_params`).
        zxbcdt = self.in_proj(u)
        d, gn = self.d_inner, self.n_groups * self.state_size
        (x, B, C), conv_state = conv(zxbcdt, conv_state, offset=d, splits=(d, d + gn))
        x, B, C = self._heads(x, B, C)
        return dict(x=x, dt=zxbcdt, B=B, C=C), zxbcdt[..., :d], conv_state

    def _replay_init_params(self):
        return dict(n_groups=self.n_groups)

    def exact_buffer_dtype(self, state: SSMLayerState):
        """The records' dtype for buffer_dtype None: x and B are buffered as the step receives them, in the
        activations' dtype (the conv window's), which bfloat16 or float32 holds exactly; other activation
        dtypes (float16, which overflows these recurrences) take float32. dt is buffered in float32 regardless."""
        dtype = jnp.dtype(state.conv_state.columns.dtype)
        return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.dtype(jnp.float32)

    def _finish(self, y, z):
        y = y.reshape(*z.shape[:-1], self.d_inner)
        return self.out_proj(self.norm(y, z))

    def state_dims(self) -> tuple[int, int, int]:
        """(H, P, N): the ssm_state [batch, H, P, N] per row."""
        return self.num_heads, self.head_dim, self.state_size

    def init_state(self, batch: int, dtype=jnp.float32) -> SSMLayerState:
        """The state of an empty prefix: zero conv window (max_window 1) and ssm_state [batch, H, P, N]."""
        return SSMLayerState(conv_state=ConvWindow.from_conv_state(self.conv1d.init_state(batch, dtype)),
                             ssm_state=jnp.zeros((batch, *self.state_dims()), self.ssm_state_dtype))
