"""The layer adapters of the tests: replayssm_jax.testing's, with the NumPy float64 oracle.

A case holds the layer's shape and parameters, draws fresh random inputs,
and calls the ops under test and the NumPy float64 oracle with the same
inputs. The ops under test are `api`'s: "ops" (replayssm_jax.ops, every
argument validated, backend "xla" unless a call names another) or
"reference" (replayssm_jax.reference, the math alone). Per-step inputs are
dicts of arrays with a leading batch axis; sequences carry a seqlen axis
after batch (the ops' layout). The shapes, dtypes and tolerances are the
case tables of replayssm_jax.testing (re-exported here).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import numpy_loops
from replayssm_jax import reference as ref
from replayssm_jax import testing
from replayssm_jax.testing import (  # noqa: F401  (the tests import these from here)
    DTYPES,
    GDN_CASES,
    MAMBA2_CASES,
    TOLERANCES,
    GDNShape,
    Mamba2Shape,
    assert_close,
    tolerance_dtype,
)


def _resized(shape, **changes):
    """`shape` with the given (not None) fields changed, and then unnamed."""
    changes = {key: value for key, value in changes.items() if value is not None}
    return dataclasses.replace(shape, name="", **changes) if changes else shape


class _Case:
    """An adapter whose ops are `api`'s: "ops" or "reference"."""

    api = "ops"

    def _op(self, name, backend, config=None):
        if self.api == "reference":
            return getattr(ref, f"{self.layer}_{name}")
        return super()._op(name, backend, config)

    @property
    def batch(self):
        return self.s.batch

    @property
    def dims(self):
        return (self.s.batch, *self.heads_dims())

    def initial_state(self):
        """A random f32 state (numpy) of the case's shape."""
        return np.array(self.state(np.float32))

    def random_inputs(self, lead):
        """The adapter's inputs as writable numpy arrays (tests change entries in place)."""
        return {key: np.array(value) for key, value in super().random_inputs(lead).items()}


class Mamba2Case(_Case, testing.Mamba2):
    """Mamba-2 at `shape` (default: the first reference shape) or at the shape of the given dims."""

    def __init__(self, rng, api="ops", shape=None, *, batch=None, nheads=None, head_dim=None, d_state=None,
                 n_groups=None, gated=None, dt_limit=None):
        self.api = api
        super().__init__(_resized(shape or MAMBA2_CASES.reference[0], batch=batch, H=nheads, P=head_dim, N=d_state,
                                  G=n_groups, gated=gated, dt_limit=dt_limit), rng)

    def oracle_step(self, state, inp):
        return oracle_step(self, state, inp)


class GDNCase(_Case, testing.GDN):
    """Gated DeltaNet at `shape` (default: the first reference shape) or at the shape of the given dims."""

    def __init__(self, rng, api="ops", shape=None, *, batch=None, num_k_heads=None, num_v_heads=None,
                 head_k_dim=None, head_v_dim=None):
        self.api = api
        super().__init__(_resized(shape or GDN_CASES.reference[0], batch=batch, H=num_k_heads, HV=num_v_heads,
                                  K=head_k_dim, V=head_v_dim), rng)

    @property
    def num_k_heads(self):
        return self.s.H

    def oracle_step(self, state, inp):
        return oracle_step(self, state, inp)


def oracle_step(layer, state, inp):
    """(y, new state) of one step of the float64 NumPy loop (numpy_loops) of a replayssm_jax.testing adapter,
    from `state` [batch, heads, V or P, K or N] with the adapter's inputs and parameters."""
    if layer.layer == "gdn":
        return numpy_loops.gdn_step(state, **inp)
    return numpy_loops.mamba2_step(state, **layer._kw(inp))


def take_step(seq, t):
    """Step t of a sequence dict ([batch, T, ...] -> [batch, ...])."""
    return {key: value[:, t] for key, value in seq.items()}


def take_rows(inp, rows):
    return {key: value[rows] for key, value in inp.items()}
