"""Tensor and data parallelism of the hybrid models and their decode state over a device mesh.

A mesh (`make_mesh`) has two axes: ``dp`` (data parallelism: the batch rows
split over its devices) and ``tp`` (tensor parallelism: every layer's heads
or intermediate dimension split over its devices). The model runs Megatron
style: every call (`ShardedLM.prefill`, ``decode``, ``verify``, ``__call__``)
is one ``jax.shard_map`` over the whole model, inside which each device runs
the model of one shard: the same module classes built from the *local*
config (`local_config`: heads, groups, intermediate sizes and vocab_size
divided by tp) on its own slice of the weights and of the decode state. The
Pallas kernels therefore see only their shard's heads and batch rows, and no
state array crosses devices. The collectives are explicit, one ``psum`` over
``tp`` per block where the math sums over a split dimension:

    Mamba-2 / GDN mixer   heads (Mamba-2 with their B/C groups, GDN value heads
                          with their key heads): in_proj, conv1d, A_log, dt_bias,
                          D, the gated norm; psum after out_proj
    attention             KV heads (query heads and the output gate follow);
                          psum after o_proj
    MLP                   intermediate dimension; psum after down_proj
    MoE                   the experts' and the shared expert's intermediate
                          dimension (router replicated); one psum of both
    embedding, lm_head    vocab rows: the lookup is a psum of the shard that
                          holds the id; the logits an all_gather

(plus, for transformers' plain Mamba2, whose gated RMSNorm normalises over all
of d_inner, a psum of its mean square). Norms, the router, the residual stream
and the logits are replicated over tp. With tp = 1 no collective is emitted.

**Shard layout of the fused projections.** A weight whose sharded axis
concatenates several parts (the Mamba-2 ``in_proj`` rows [z | x | B | C | dt],
its ``conv1d`` channels [x | B | C]; Qwen3.5's ``in_proj_qkv`` rows and the
GDN ``conv1d`` channels [q | k | v]) cannot be cut into tp contiguous blocks
as stored. On the mesh such a weight is stored in the *shard layout*: its
rows reordered so that block s (of tp equal blocks) is [z_s | x_s | B_s | C_s
| dt_s], each part's s-th slice of heads (or groups), which is the layout of
that part in the shard's local model. `shard_ranges` gives the rows of the
checkpoint tensor that make block s; the loader reads exactly those slices
(safetensors' lazy slicing) for each device, so no device and no host buffer
holds the whole tensor. Qwen3-Next's packed ``in_proj_qkvz`` / ``in_proj_ba``
are laid out per key head already and are cut as stored; so are the q/k/v,
gate/up projections (rows of heads or of the intermediate dimension) and the
row-parallel out_proj / o_proj / down_proj (columns).

**Decode state.** Every state array has the batch on axis 0 (``dp``) and its
heads on the axis that the kernels index by head (``tp``): SSM states and
replay checkpoints, buffers and scales [batch, heads, ...]; KV caches and the
conv windows' columns [batch, positions, kv heads | channels, ...]; the
standard state's slotted states [batch, slots, heads, ...]. Cursors,
positions, lengths and ring starts [batch] follow ``dp`` only (`state_specs`).

8-bit checkpoints with stochastic rounding key their noise by the local row
and head index, so on a mesh with more than one device they draw other
(equally distributed) noise than on one device; nearest rounding is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.common import (
    _check_no_window,
    _check_room,
    check_cache,
    check_input_ids,
    check_tokens,
    commit_cache,
)
from models.config import NemotronHConfig, QwenHybridConfig
from replayssm_jax.layers import Attention, Embedding, Linear, Mamba2Mixer, MoE

__all__ = ["AXES", "make_mesh", "check_mesh", "check_config", "check_batch", "local_config", "param_axis",
           "fused_parts", "shard_ranges", "place", "shard_layout", "shardings", "state_specs", "names_of",
           "ShardedLM", "shard_model", "sharded_from_state"]

#: The mesh axes: data parallelism (batch rows), tensor parallelism (heads, intermediate, vocab).
AXES = ("dp", "tp")
DP, TP = AXES


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` of dp x tp devices with axes ("dp", "tp").

    Args:
      tp: devices per tensor-parallel group (>= 1).
      dp: data-parallel groups (>= 1).
      devices: the devices to use (default ``jax.devices()``); the first dp * tp are taken,
        consecutive devices in one tp group.

    Raises:
      ValueError: tp or dp not an int >= 1, or fewer than dp * tp devices.
    """
    for name, value in (("tp", tp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1; got {value!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < dp * tp:
        raise ValueError(f"a mesh of dp x tp = {dp} x {tp} devices needs {dp * tp} devices; {len(devices)} "
                         f"available ({devices[0].platform if devices else 'none'})")
    return Mesh(np.array(devices[: dp * tp], dtype=object).reshape(dp, tp), AXES)


def check_mesh(mesh) -> Mesh:
    """`mesh` if it is a ``jax.sharding.Mesh`` with axes ("dp", "tp") (`make_mesh`); else TypeError / ValueError."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh (models.sharding.make_mesh); got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"`mesh` must have the axes {AXES} (models.sharding.make_mesh); got {mesh.axis_names}")
    return mesh


def _mamba_norm_groups(config: NemotronHConfig) -> int:
    return config.mamba_num_heads * config.mamba_head_dim // config.mamba_norm_group_size


def _split_sizes(config) -> list[tuple[str, int]]:
    """The (config key, value) of every size that tensor parallelism divides, for the layers `config` has."""
    kinds = set(config.layer_types)
    if isinstance(config, NemotronHConfig):
        sizes = []
        if "mamba" in kinds:
            sizes += [("mamba_num_heads", config.mamba_num_heads), ("n_groups", config.n_groups)]
        if "attention" in kinds:
            sizes += [("num_key_value_heads", config.num_key_value_heads)]
        if "mlp" in kinds:
            sizes += [("intermediate_size", config.intermediate_size)]
        if "moe" in kinds:
            sizes += [("moe_intermediate_size", config.moe_intermediate_size)]
            if config.moe_shared_expert_intermediate_size:
                sizes += [("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size)]
    elif isinstance(config, QwenHybridConfig):
        sizes = []
        if "gdn" in kinds:
            sizes += [("linear_num_key_heads", config.linear_num_key_heads),
                      ("linear_num_value_heads", config.linear_num_value_heads)]
        if "attention" in kinds:
            sizes += [("num_key_value_heads", config.num_key_value_heads)]
        if "mlp" in config.mlp_types:
            sizes += [("intermediate_size", config.intermediate_size)]
        if "moe" in config.mlp_types:
            sizes += [("moe_intermediate_size", config.moe_intermediate_size)]
            if config.shared_expert_intermediate_size:
                sizes += [("shared_expert_intermediate_size", config.shared_expert_intermediate_size)]
    else:
        raise TypeError(f"tensor parallelism supports NemotronHConfig and QwenHybridConfig; got "
                        f"{type(config).__name__}")
    return sizes + [("vocab_size", config.vocab_size)]


def check_config(config, tp: int) -> None:
    """Raise ValueError unless tensor parallelism over `tp` devices can split `config`.

    Every size that a layer splits over tp must be divisible by it: Nemotron-H / Mamba2
    ``mamba_num_heads``, ``n_groups`` (the heads go with their groups), the gated norm's
    groups (one group, plain Mamba2, is allowed: it is reduced over tp),
    ``num_key_value_heads`` (the query heads follow), ``intermediate_size``,
    ``moe_intermediate_size``, ``moe_shared_expert_intermediate_size``; Qwen
    ``linear_num_key_heads``, ``linear_num_value_heads`` (a value head goes with its key
    head), ``num_key_value_heads``, ``intermediate_size``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``; and ``vocab_size``. The message names the
    config key, its value and tp.
    """
    for key, value in _split_sizes(config):
        if value % tp:
            raise ValueError(f"tensor parallelism: config key `{key}` = {value} is not divisible by tp = {tp} "
                             f"(choose a tp that divides it)")
    if isinstance(config, NemotronHConfig) and "mamba" in config.layer_types:
        groups = _mamba_norm_groups(config)
        if groups != 1 and groups % tp:
            raise ValueError(f"tensor parallelism: the Mamba-2 gated norm's {groups} groups (config "
                             f"`mamba_norm_group_size` = {config.mamba_norm_group_size}) are not divisible by tp = "
                             f"{tp}")


def check_batch(batch: int, dp: int, name: str) -> None:
    """Raise ValueError unless `batch` rows (of argument `name`) divide over the dp = `dp` axis."""
    if batch % dp:
        raise ValueError(f"`{name}` has batch {batch}, which is not divisible by the mesh's dp = {dp} "
                         f"(every data-parallel group takes batch / dp rows)")


def local_config(config, tp: int):
    """The config of one tensor-parallel shard: the split sizes of `check_config` divided by `tp`
    (the Mamba-2 gated norm keeps its group size, or for one group spans d_inner / tp per shard).

    Raises:
      ValueError: as `check_config`.
    """
    check_config(config, tp)
    if tp == 1:
        return config
    split = {key: value // tp for key, value in _split_sizes(config)}
    if isinstance(config, NemotronHConfig):
        if "mamba" in config.layer_types and _mamba_norm_groups(config) == 1:
            split["mamba_norm_group_size"] = config.mamba_norm_group_size // tp
    if "attention" in config.layer_types:  # the query heads follow their KV heads
        split["num_attention_heads"] = config.num_attention_heads // tp
    return dataclasses.replace(config, **split)


# -- weights ----------------------------------------------------------------------------------------


def fused_parts(config, names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The part sizes along axis 0 of a fused weight (`names`: its parameter path), or None."""
    parent = names[-2] if len(names) >= 2 else ""
    owner = names[-3] if len(names) >= 3 else ""
    if isinstance(config, NemotronHConfig):
        d_inner = config.mamba_num_heads * config.mamba_head_dim
        gn = config.n_groups * config.ssm_state_size
        if parent == "in_proj":
            return (d_inner, d_inner, gn, gn, config.mamba_num_heads)
        if parent == "conv1d":
            return (d_inner, gn, gn)
    elif parent == "in_proj_qkv" or (parent == "conv1d" and owner == "linear_attn"):
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        return (key_dim, key_dim, config.linear_num_value_heads * config.linear_value_head_dim)
    return None


_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj", "conv1d",
                              "in_proj_qkv", "in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a",
                              "embeddings", "embed_tokens", "lm_head"})
_ROW_PARALLEL = frozenset({"out_proj", "o_proj", "down_proj"})


def param_axis(names: tuple[str, ...]) -> int | None:
    """The axis of a parameter (path `names`, e.g. ("model", "layers", "0", "self_attn", "q_proj",
    "weight")) that tensor parallelism splits, or None where it is replicated (norms, router,
    gates, latent projections, row-parallel biases)."""
    leaf = names[-1]
    parent = names[-2] if len(names) >= 2 else ""
    owner = names[-3] if len(names) >= 3 else ""
    if parent == "experts":  # stacked experts: gate_proj / up_proj [E, I, D], down_proj [E, D, I]
        return 2 if leaf == "down_proj" else 1
    if leaf in ("A_log", "dt_bias", "D"):
        return 0
    if parent == "norm" and owner == "mixer":  # the Mamba-2 gated norm over d_inner
        return 0
    if parent in _COLUMN_PARALLEL:
        return 0
    if parent in _ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def _spec(axis: int | None) -> P:
    if axis is None:
        return P()
    return P(*([None] * axis), TP)


def shard_ranges(size: int, parts: tuple[int, ...] | None, tp: int, shard: int) -> list[tuple[int, int]]:
    """The (start, stop) ranges of the stored axis (`size` long) that make block `shard` of the shard
    layout: each part's slice number `shard` of tp (one range for an unfused axis, parts None)."""
    parts = parts or (size,)
    ranges, offset = [], 0
    for part in parts:
        step = part // tp
        ranges.append((offset + shard * step, offset + (shard + 1) * step))
        offset += part
    return ranges


def place(reader: Callable[[tuple], np.ndarray], shape: tuple[int, ...], mesh: Mesh, axis: int | None,
          parts: tuple[int, ...] | None = None) -> jax.Array:
    """A global array of `shape` on `mesh`, split over tp along `axis` in the shard layout, replicated
    over dp (and over tp where `axis` is None), each device's block read with ``reader(index)``.

    Args:
      reader: index (a tuple of slices of the stored tensor) -> np.ndarray of that slice.
      shape: the stored tensor's shape (the shard layout only reorders `axis`).
      mesh: the ("dp", "tp") mesh.
      axis: the split axis, or None.
      parts: the part sizes along `axis` of a fused weight (see the module docstring), or None.
    """
    tp = mesh.shape[TP]
    sharding = NamedSharding(mesh, _spec(axis))

    def block(index):
        if axis is None or tp == 1:
            return reader(index)
        start = index[axis].start or 0
        shard = start // (shape[axis] // tp)
        pieces = [reader(index[:axis] + (slice(a, b),) + index[axis + 1:])
                  for a, b in shard_ranges(shape[axis], parts, tp, shard)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)

    return jax.make_array_from_callback(shape, sharding, block)


def _shard_permutation(size: int, parts, tp: int) -> np.ndarray:
    """i32[size]: the stored rows in shard-layout order."""
    return np.concatenate([np.arange(a, b) for s in range(tp) for a, b in shard_ranges(size, parts, tp, s)])


def names_of(path) -> tuple[str, ...]:
    """The parameter path of a key path of an nnx.State leaf (the Variable's own ``value`` key dropped)."""
    out = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
            continue
        out.append(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))))
    return tuple(out)


def _param_specs(params):
    return jax.tree_util.tree_map_with_path(lambda path, leaf: _spec(param_axis(names_of(path))), params)


# -- decode state -----------------------------------------------------------------------------------


def state_specs(tree):
    """The PartitionSpec of every array of a call's arguments or results (token ids, logits,
    hidden states, a `HybridCache`): batch on axis 0 over dp; the cache's head-indexed arrays
    over tp on their heads' axis (axis 2 for KV caches, conv window columns and the slotted
    standard states [batch, slots, heads, ...]; else axis 1); [batch] arrays (cursors, lengths,
    positions, ring starts) over dp only."""

    def spec(path, leaf):
        names = names_of(path)
        if "layers" not in names or leaf.ndim == 1:
            return P(DP)
        field = names[-1]
        slotted = field == "ssm_state" and leaf.ndim == 5  # the standard state's [batch, slots, heads, ...]
        if field == "columns" or slotted or (field in ("k", "v") and "replay" not in names):
            return P(DP, None, TP)
        return P(DP, TP)

    return jax.tree_util.tree_map_with_path(spec, tree)


# -- the sharded model ------------------------------------------------------------------------------


def _set_collectives(model: nnx.Module, config, tp: int) -> None:
    """Mark the local model's collectives (module docstring): psum after the row-parallel projections
    and in the MoE, the vocab-parallel embedding and LM head, the plain Mamba2 norm; none for tp = 1."""
    if tp == 1:
        return
    for path, module in nnx.iter_modules(model):
        name = str(path[-1]) if path else ""
        if isinstance(module, Linear) and name in _ROW_PARALLEL:
            module.reduce_axis = TP
        elif isinstance(module, Linear) and name == "lm_head":
            module.gather_axis = TP
        elif isinstance(module, Embedding):
            module.vocab_axis = TP
        elif isinstance(module, MoE):
            module.reduce_axis = TP
        elif isinstance(module, Mamba2Mixer) and _mamba_norm_groups(config) == 1:
            module.norm.reduce_axis = TP


class ShardedLM(nnx.Module):
    """A hybrid causal LM (models.*) run over a ("dp", "tp") mesh, one ``jax.shard_map`` per call.

    Build it with `shard_model` (from a model on one device), ``models.load_model(path,
    mesh=...)`` or ``models.random_init.init_model(path, mesh=...)``. It has the model's
    entry points, with the same arguments and results (the logits and hidden states
    replicated over tp, the batch split over dp): `prefill`, `decode`, `verify`,
    `commit`, ``__call__``; ``config`` is the full model's config.

    Attributes:
      inner: the model of one shard (built from `local_config`), holding the global
        weight arrays in the shard layout (module docstring); inside the shard_map
        each device merges it with its blocks.
      config: the full model's config.
      mesh: the ("dp", "tp") mesh (static).

    Raises (every entry point, before anything runs): ValueError for a batch that dp
    does not divide, and the model's own errors for bad ids or a bad cache.
    """

    def __init__(self, inner: nnx.Module, config, mesh: Mesh):
        self.inner = inner
        self.config = config
        self.mesh = mesh

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP]

    @property
    def dp(self) -> int:
        return self.mesh.shape[DP]

    def set_attention_decode_backend(self, backend: str | None) -> None:
        """`models.common.HybridCausalLM.set_attention_decode_backend` of the shards' model."""
        self.inner.set_attention_decode_backend(backend)

    def _run(self, method: str, args: tuple, **options):
        """``inner.<method>(*args, **options)`` on every device's shard, under one shard_map."""
        graphdef, params = nnx.split(self.inner)

        def body(params, args):
            return getattr(nnx.merge(graphdef, params), method)(*args, **options)

        kw = dict(mesh=self.mesh, in_specs=(_param_specs(params), state_specs(args)), check_vma=False)
        local = jax.eval_shape(jax.shard_map(body, out_specs=P(), **kw), params, args)
        return jax.shard_map(body, out_specs=state_specs(local), **kw)(params, args)

    def __call__(self, input_ids: jax.Array, *, backend: str | None = None) -> jax.Array:
        """Full causal forward (`models.common.HybridCausalLM.__call__`): logits f32[batch, T, vocab_size]."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        check_batch(ids.shape[0], self.dp, "input_ids")
        return self._run("__call__", (ids,), backend=backend)

    def prefill(self, input_ids: jax.Array, max_len: int, **options):
        """`models.common.HybridCausalLM.prefill` on the mesh (the same keyword options and results;
        the cache's arrays split as `state_specs` says)."""
        ids = check_input_ids(input_ids, self.config.vocab_size)
        check_batch(ids.shape[0], self.dp, "input_ids")
        return self._run("prefill", (ids,), max_len=max_len, **options)

    def decode(self, tokens: jax.Array, cache, *, route: str = "auto", backend: str | None = None,
               return_hidden: bool = False):
        """`models.common.HybridCausalLM.decode` on the mesh."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        check_cache(cache, self.config.layer_types, tokens.shape)
        check_batch(tokens.shape[0], self.dp, "tokens")
        _check_no_window(cache)
        return self._run("decode", (tokens, cache), route=route, backend=backend, return_hidden=return_hidden)

    def verify(self, tokens: jax.Array, cache, *, backend: str | None = None, return_hidden: bool = False,
               tree=None):
        """`models.common.HybridCausalLM.verify` on the mesh (a draft `tree` too: each device walks it
        on its own heads)."""
        tokens = check_input_ids(tokens, self.config.vocab_size, name="tokens")
        check_cache(cache, self.config.layer_types, tokens.shape)
        check_batch(tokens.shape[0], self.dp, "tokens")
        _check_no_window(cache)
        _check_room(cache, tokens.shape[1])
        return self._run("verify", (tokens, cache), backend=backend, return_hidden=return_hidden, tree=tree)

    def commit(self, cache, num_accepted: jax.Array, path=None):
        """`models.common.commit_cache` (per-row cursor, length and offset moves, and a draft tree's
        path gathered within each row: no collective)."""
        check_cache(cache, self.config.layer_types)
        return commit_cache(cache, num_accepted, path)


def sharded_from_state(family_class, config, state, mesh: Mesh, **model_options) -> ShardedLM:
    """The `ShardedLM` of a model class and config over `mesh`, its parameters `state` (an nnx.State of
    the full model's paths, arrays already placed in the shard layout)."""
    tp = mesh.shape[TP]
    inner = nnx.eval_shape(lambda: family_class(local_config(config, tp), **model_options))
    graphdef, _ = nnx.split(inner)
    inner = nnx.merge(graphdef, state)
    _set_collectives(inner, config, tp)
    return ShardedLM(inner, config, mesh)


def _placed_state(abstract_state, config, mesh: Mesh, reader_of: Callable):
    """`abstract_state` (paths and shapes of the full model) with every leaf placed by `place`,
    read through ``reader_of(names)`` -> reader."""

    def one(path, leaf):
        names = names_of(path)
        return place(reader_of(names), tuple(leaf.shape), mesh, param_axis(names), fused_parts(config, names))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def shard_model(model: nnx.Module, mesh: Mesh) -> ShardedLM:
    """`model` (a models.* causal LM on one device) as a `ShardedLM` over `mesh`: each weight's
    blocks copied to their devices (host slices of the weight; the model itself is not changed).

    Raises:
      TypeError: `mesh` not a Mesh; a config of another family than Nemotron-H / Qwen.
      ValueError: a mesh without the ("dp", "tp") axes; a config that tp does not split
        (`check_config`); a model with a multi-token prediction head (not sharded).
    """
    check_mesh(mesh)
    if getattr(model, "mtp", None) is not None:
        raise ValueError("a model with a multi-token prediction head (`mtp`) cannot be sharded; load it with "
                         "mtp=False")
    config = model.config
    check_config(config, mesh.shape[TP])
    _, state = nnx.split(model)
    arrays = {names_of(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}

    def reader_of(names):
        array = arrays[names]
        return lambda index: np.asarray(array[index])

    placed = _placed_state(state, config, mesh, reader_of)
    options = dict(ssm_state_dtype=_ssm_state_dtype(model))
    sharded = sharded_from_state(type(model), config, placed, mesh, **options)
    for layer, source in zip(_attention_layers(sharded.inner), _attention_layers(model), strict=True):
        layer.decode_backend = source.decode_backend  # a static setting, not in the state
    return sharded


def _attention_layers(model) -> list[Attention]:
    return [module for _, module in nnx.iter_modules(model) if isinstance(module, Attention)]


def _ssm_state_dtype(model) -> jnp.dtype:
    for _, module in nnx.iter_modules(model):
        dtype = getattr(module, "ssm_state_dtype", None)
        if dtype is not None:
            return dtype
    return jnp.float32


def shard_layout(config, names: tuple[str, ...], array: jax.Array, tp: int) -> jax.Array:
    """`array` (the parameter at path `names`, as stored) in the shard layout for `tp` shards
    (only fused weights change: the rows of each shard's parts made contiguous)."""
    parts = fused_parts(config, names)
    axis = param_axis(names)
    if parts is None or axis is None or tp == 1:
        return array
    return jnp.take(array, jnp.asarray(_shard_permutation(array.shape[axis], parts, tp)), axis=axis)


def shardings(tree, mesh: Mesh):
    """The NamedSharding of every parameter of an nnx.State `tree` on `mesh` (`param_axis`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, _spec(param_axis(names_of(path)))), tree)
