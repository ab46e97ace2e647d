"""Models of real shape with random weights, built from a config.json alone
(benchmarks and smoke tests; the weights are N(0, 0.02) as each layer's init)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from models import registry
from models.loading import check_dtypes, read_config


def init_model(path: str | os.PathLike, dtype=jnp.bfloat16, *, seed: int = 0, ssm_state_dtype=jnp.float32,
               mesh=None):
    """A model with the architecture of `path`/config.json and random weights.

    The model family is the one registered for config.json's ``model_type``
    (`models.registry`), as in `models.load_model`.

    Args:
      path: a folder holding config.json (no weights needed).
      dtype: parameter dtype: float32 or bfloat16 (None: float32). float16 is refused.
      seed: PRNG seed of the weights.
      ssm_state_dtype: dtype of the SSM states between decode steps: float32 or bfloat16.
      mesh: None, or a ("dp", "tp") ``jax.sharding.Mesh`` (`models.sharding.make_mesh`): the
        model is returned as a `models.sharding.ShardedLM` with the same weights, drawn under
        ``jax.jit`` with the mesh's output shardings (each device computes its blocks; fused
        projections in the shard layout).

    Raises:
      CheckpointNotFoundError: no folder or no config.json.
      ConfigError: an unknown model_type, a missing required key, or a malformed config.
      TypeError: a `dtype` other than None, float32, bfloat16, or an `ssm_state_dtype`
        other than float32, bfloat16; a `mesh` that is not a Mesh.
      ValueError: with a mesh, axes other than ("dp", "tp") or a config size that tp does
        not divide (`models.sharding.check_config`), before anything is placed.
    """
    check_dtypes(dtype, ssm_state_dtype)
    family, config = registry.parse(read_config(path), source=os.path.join(os.fspath(path), "config.json"))
    options = dict(ssm_state_dtype=ssm_state_dtype, param_dtype=dtype or jnp.float32)
    if mesh is None:
        return family.model_class(config, rngs=nnx.Rngs(seed), **options)
    from models import sharding

    sharding.check_mesh(mesh)
    tp = mesh.shape[sharding.TP]
    sharding.check_config(config, tp)

    def weights():
        _, state = nnx.split(family.model_class(config, rngs=nnx.Rngs(seed), **options))
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: sharding.shard_layout(config, sharding.names_of(path), leaf, tp), state)

    abstract = jax.eval_shape(weights)
    state = jax.jit(weights, out_shardings=sharding.shardings(abstract, mesh))()
    return sharding.sharded_from_state(family.model_class, config, state, mesh, **options)
