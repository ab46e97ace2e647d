"""replayssm_jax.compilation.jit: the library's programs compiled with its XLA options at the top level,
and usable inside another traced function (where JAX refuses compiler options)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.compilation import COMPILER_OPTIONS, jit


def test_top_level_and_nested_calls_agree(rng):
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    f = jit(lambda a: jnp.tanh(a) @ a.T)
    expected = np.tanh(np.asarray(x)) @ np.asarray(x).T
    # float32 sums of 5 products of size ~1: an entry near 0 keeps an absolute error of ~1e-7
    np.testing.assert_allclose(f(x), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(lambda a: f(a) + 1.0)(x), np.asarray(f(x)) + 1.0, rtol=1e-6)
    assert jax.eval_shape(f, x).shape == (3, 3)
    np.testing.assert_allclose(jax.grad(lambda a: f(a).sum())(x), jax.grad(lambda a: (jnp.tanh(a) @ a.T).sum())(x),
                               rtol=1e-5)


def test_a_plain_jit_refuses_the_options_when_nested(rng):
    """Why `jit` falls back inside a trace: JAX takes compiler options on a top-level jit only."""
    plain = jax.jit(lambda a: a * 2.0, compiler_options=COMPILER_OPTIONS)
    with pytest.raises(ValueError, match="compiler_options"):
        jax.jit(lambda a: plain(a))(jnp.ones(2))
    assert jax.jit(lambda a: jit(lambda b: b * 2.0)(a))(jnp.ones(2)).tolist() == [2.0, 2.0]


def test_jit_keeps_the_jit_api_and_keywords():
    f = jit(lambda a, n: a * n, static_argnames=("n",), donate_argnums=(0,),
            compiler_options={"xla_cpu_enable_fast_math": False})
    assert float(f(jnp.ones(()), n=3)) == 3.0
    assert f.lower(jnp.ones(()), n=2).compile()(jnp.ones(())) == 2.0
    assert f._cache_size() == 1
    assert f.trace(jnp.ones(()), n=4).jaxpr is not None


def test_jit_decorates_a_method():
    class Scaled:
        def __init__(self, factor):
            self.factor = factor

        def __hash__(self):
            return hash(self.factor)

        def __eq__(self, other):
            return isinstance(other, Scaled) and other.factor == self.factor

        @functools.partial(jit, static_argnums=0)
        def apply(self, x):
            return x * self.factor

    assert Scaled(3.0).apply(jnp.ones(2)).tolist() == [3.0, 3.0]
    assert Scaled.apply(Scaled(2.0), jnp.ones(1)).tolist() == [2.0]
