"""Feed-forward layers: dense MLP (relu2 or SwiGLU) and top-k mixture of experts.

Sources (transformers 5.x):
- `MLP(gated=False, activation="relu2")`: NemotronHMLP, ``down(relu(up(x))**2)``.
- `MLP(gated=True, activation="silu")`: Qwen3NextMLP / Qwen3_5MLP,
  ``down(silu(gate(x)) * up(x))``.
- `MoE(router="sigmoid")`: NemotronHMoE (DeepSeek-V3 style): scores =
  sigmoid(x @ W_r^T) in float32; experts chosen on scores + e_score_correction_bias
  within the `topk_group` best of `n_group` expert groups (a group scores the sum
  of its two best biased scores); weights are the *unbiased* scores of the
  chosen experts, divided by their sum (+1e-20) if norm_topk_prob, times
  routed_scaling_factor; non-gated relu2 experts; the shared expert
  (``shared_experts``) is added ungated; optional latent projections.
- `MoE(router="softmax")`: Qwen3NextSparseMoeBlock: weights = top-k of
  softmax(x @ W_r^T), renormalised if norm_topk_prob; SwiGLU experts; the shared
  expert (``shared_expert``) is scaled by sigmoid(shared_expert_gate(x)).

Dimension names: N tokens (batch * seqlen flattened), hidden_size, E = num_experts,
k = num_experts_per_tok, I = moe_intermediate_size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax.layers.conv import get_activation
from replayssm_jax.layers.linear import Linear, default_rngs

__all__ = ["MLP", "Experts", "MoE"]


class MLP(nnx.Module):
    """Dense feed-forward block.

    Args:
      hidden_size, intermediate_size: sizes.
      activation: transformers `hidden_act` name ("relu2", "silu", ...).
      gated: SwiGLU-style (``gate_proj``, ``up_proj``, ``down_proj``) if True,
        else ``up_proj``, ``down_proj``.
      bias: linear biases (`mlp_bias`).

    Call: x [..., hidden_size] -> [..., hidden_size].
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str, gated: bool, bias: bool = False,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.gated = gated
        self.activation = activation
        self._act = get_activation(activation)
        kw = dict(bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw) if gated else None
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)

    def _hidden(self, x: jax.Array) -> jax.Array:
        """The activation before down_proj, [..., intermediate_size]."""
        if self.gated:
            return self._act(self.gate_proj(x)) * self.up_proj(x)
        return self._act(self.up_proj(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self._hidden(x))

    def partial(self, x: jax.Array) -> jax.Array:
        """down_proj's product without its bias or collective: under tensor parallelism over the
        intermediate dimension, this shard's term of the output sum (`MoE` sums it with the experts')."""
        return self.down_proj.project(self._hidden(x))


class Experts(nnx.Module):
    """E expert MLPs with stacked weights (transformers 5 keeps them as 3-D tensors).

    Parameters: ``up_proj``: [E, I, D]; ``down_proj``: [E, D, I]; ``gate_proj``: [E, I, D]
    (gated experts only), D being the expert input width (hidden_size or moe_latent_size).
    A checkpoint stores them per expert (``experts.{e}.up_proj.weight``, ...); the
    loader stacks them.

    Call: ``x`` [N, D], ``indices`` int[N, k], ``weights`` f32[N, k] -> [N, D] of x.dtype:
    ``sum_j weights[n, j] * expert_{indices[n, j]}(x[n])``, accumulated in float32.
    Few tokens (N * k <= E) gather only the chosen experts' weights (the decode
    case); otherwise every expert runs on every token and the combine weights are
    zero for the unchosen ones (exact, E / k times the minimal FLOPs).
    """

    def __init__(self, num_experts: int, dim: int, intermediate_size: int, *, activation: str, gated: bool,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.num_experts = num_experts
        self.gated = gated
        self.activation = activation
        self._act = get_activation(activation)

        def init(shape):
            return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape, param_dtype))

        self.gate_proj = init((num_experts, intermediate_size, dim)) if gated else None
        self.up_proj = init((num_experts, intermediate_size, dim))
        self.down_proj = init((num_experts, dim, intermediate_size))

    def __call__(self, x: jax.Array, indices: jax.Array, weights: jax.Array) -> jax.Array:
        n, k = indices.shape
        up = self.up_proj[...]
        down = self.down_proj[...]
        gate = self.gate_proj[...] if self.gated else None
        if n * k <= self.num_experts:
            h = jnp.einsum("nd,nkid->nki", x, up[indices])
            if self.gated:
                h = self._act(jnp.einsum("nd,nkid->nki", x, gate[indices])) * h
            else:
                h = self._act(h)
            out = jnp.einsum("nki,nkdi->nkd", h, down[indices], preferred_element_type=jnp.float32)
            y = jnp.einsum("nkd,nk->nd", out, weights.astype(jnp.float32))
        else:
            combine = jnp.zeros((n, self.num_experts), jnp.float32)
            combine = combine.at[jnp.arange(n)[:, None], indices].add(weights.astype(jnp.float32))
            h = jnp.einsum("nd,eid->nei", x, up)
            if self.gated:
                h = self._act(jnp.einsum("nd,eid->nei", x, gate)) * h
            else:
                h = self._act(h)
            out = jnp.einsum("nei,edi->ned", h, down, preferred_element_type=jnp.float32)
            y = jnp.einsum("ned,ne->nd", out, combine)
        return y.astype(x.dtype)


class _Router(nnx.Module):
    """Router parameters: ``weight`` [E, hidden]; ``e_score_correction_bias`` [E] (sigmoid routers)."""

    def __init__(self, hidden_size: int, num_experts: int, *, correction_bias: bool, param_dtype, rngs):
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (num_experts, hidden_size), param_dtype))
        self.e_score_correction_bias = (
            nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if correction_bias else None)


class MoE(nnx.Module):
    """Top-k mixture of experts with an optional shared expert.

    Args:
      hidden_size: model width.
      num_experts, top_k, intermediate_size: E, k, I.
      activation, gated: expert MLP form (see `MLP`).
      router: "softmax" (Qwen3-Next) or "sigmoid" (Nemotron-H, with score-correction bias).
      norm_topk_prob: renormalise the k chosen weights to sum to 1.
      routed_scaling_factor: multiplies the routed weights ("sigmoid" router).
      n_group, topk_group: group-limited routing ("sigmoid" router): experts are
        split into n_group consecutive groups, only the topk_group best groups compete.
      shared_intermediate_size: width of the shared expert (0: none).
      shared_name: attribute name of the shared expert ("shared_experts" in
        Nemotron-H, "shared_expert" in Qwen3-Next).
      shared_expert_gate: a ``shared_expert_gate`` Linear(hidden, 1) scales the
        shared expert by sigmoid (Qwen3-Next).
      latent_size: Nemotron-H `moe_latent_size`: experts work in this width, with
        ``fc1_latent_proj`` / ``fc2_latent_proj`` around them.
      bias: linear biases of the shared expert and latent projections.

    Parameters: ``gate`` (router: ``weight``, ``e_score_correction_bias``), ``experts``
    (`Experts`), the shared expert (`MLP`), ``shared_expert_gate``, ``fc1_latent_proj``,
    ``fc2_latent_proj``.

    Call: x [..., hidden_size] -> [..., hidden_size] of x.dtype.

    Tensor parallelism (`models.sharding`, inside ``jax.shard_map``): with
    ``reduce_axis`` set (a mesh axis name) the experts and the shared expert
    hold this shard's part of their intermediate dimension (the router, the
    gates and the latent projections are replicated); the routed and the shared
    partial outputs are summed over the axis in one ``lax.psum`` (with latent
    projections, of the routed latent output and the shared output side by
    side), the shared expert's down_proj bias added once after it.

    Raises:
      ValueError: unknown router, top_k > E, n_group not dividing E, topk_group > n_group.
    """

    reduce_axis: str | None = None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *, activation: str,
                 gated: bool, router: str, norm_topk_prob: bool, routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, shared_intermediate_size: int = 0, shared_name: str = "shared_expert",
                 shared_expert_gate: bool = False, latent_size: int | None = None, bias: bool = False,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: `router` must be 'softmax' or 'sigmoid'; got {router!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: `num_experts_per_tok` must be in [1, num_experts = {num_experts}]; got {top_k}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"MoE: `n_group` must divide num_experts = {num_experts}; got {n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"MoE: `topk_group` must be in [1, n_group = {n_group}]; got {topk_group}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = router
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group = n_group
        self.topk_group = topk_group
        self.shared_name = shared_name
        self.gate = _Router(hidden_size, num_experts, correction_bias=(router == "sigmoid"), param_dtype=param_dtype,
                            rngs=rngs)
        dim = latent_size if latent_size else hidden_size
        self.experts = Experts(num_experts, dim, intermediate_size, activation=activation, gated=gated,
                               param_dtype=param_dtype, rngs=rngs)
        if latent_size:
            self.fc1_latent_proj = Linear(hidden_size, latent_size, bias=bias, param_dtype=param_dtype, rngs=rngs)
            self.fc2_latent_proj = Linear(latent_size, hidden_size, bias=bias, param_dtype=param_dtype, rngs=rngs)
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None
        shared = None
        if shared_intermediate_size:
            shared = MLP(hidden_size, shared_intermediate_size, activation=activation, gated=gated, bias=bias,
                         param_dtype=param_dtype, rngs=rngs)
        setattr(self, shared_name, shared)
        self.shared_expert_gate = (
            Linear(hidden_size, 1, bias=False, param_dtype=param_dtype, rngs=rngs) if shared_expert_gate else None)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Routing. x [N, hidden] -> (indices int32[N, k], weights f32[N, k])."""
        w = self.gate.weight[...]
        if self.router == "softmax":
            logits = jnp.einsum("nd,ed->ne", x, w).astype(jnp.float32)
            probs = jax.nn.softmax(logits, axis=-1)
            weights, indices = jax.lax.top_k(probs, self.top_k)
            if self.norm_topk_prob:
                weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
            return indices, weights
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), w.astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.gate.e_score_correction_bias[...].astype(jnp.float32)
        if self.n_group > 1:
            n = choice.shape[0]
            per_group = self.num_experts // self.n_group
            grouped = choice.reshape(n, self.n_group, per_group)
            group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)
            _, group_idx = jax.lax.top_k(group_scores, self.topk_group)
            group_mask = jnp.zeros((n, self.n_group), bool).at[jnp.arange(n)[:, None], group_idx].set(True)
            expert_mask = jnp.repeat(group_mask, per_group, axis=1)
            choice = jnp.where(expert_mask, choice, -jnp.inf)
        _, indices = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return indices, weights * self.routed_scaling_factor

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: `x` last axis must be hidden_size = {self.hidden_size}; got shape {shape}")
        flat = x.reshape(-1, shape[-1])
        indices, weights = self.route(flat)
        h = self.fc1_latent_proj(flat) if self.fc1_latent_proj is not None else flat
        y = self.experts(h, indices, weights)
        shared = getattr(self, self.shared_name)
        if self.reduce_axis is not None:
            y = self._reduced(flat, y, shared)
        else:
            if self.fc2_latent_proj is not None:
                y = self.fc2_latent_proj(y)
            if shared is not None:
                y = y + self._shared_gate(flat, shared(flat))
        return y.reshape(shape).astype(x.dtype)

    def _shared_gate(self, flat, s):
        """The shared expert's output `s` scaled by sigmoid(shared_expert_gate(x)) where there is a gate."""
        if self.shared_expert_gate is None:
            return s
        return jax.nn.sigmoid(self.shared_expert_gate(flat).astype(jnp.float32)).astype(s.dtype) * s

    def _reduced(self, flat, y, shared):
        """The MoE output from this shard's routed partial output `y` [N, D]: one psum over reduce_axis."""
        if shared is None:
            y = jax.lax.psum(y, self.reduce_axis)
            return self.fc2_latent_proj(y) if self.fc2_latent_proj is not None else y
        s = self._shared_gate(flat, shared.partial(flat))
        if self.fc2_latent_proj is None:
            y = jax.lax.psum(y + s.astype(y.dtype), self.reduce_axis)
        else:
            both = jax.lax.psum(jnp.concatenate([y, s.astype(y.dtype)], axis=-1), self.reduce_axis)
            y = self.fc2_latent_proj(both[:, :y.shape[1]]) + both[:, y.shape[1]:]
        bias = shared.down_proj.bias
        if bias is not None:
            y = y + self._shared_gate(flat, jnp.broadcast_to(bias[...], y.shape).astype(y.dtype))
        return y
