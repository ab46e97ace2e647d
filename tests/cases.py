"""One adapter per layer type, so that a single test suite covers both.

A case holds the layer's shapes and parameters, draws fresh random inputs,
and calls the ops under test and the NumPy float64 oracle with the same
inputs. The ops under test are `api`'s: "ops" (replayssm_jax.ops, every
argument validated, backend "xla") or "reference" (replayssm_jax.reference,
the math alone). Per-step inputs are dicts of arrays with a leading batch
axis; sequences carry a seqlen axis after batch (the ops' layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

import numpy_loops
from replayssm_jax import ops
from replayssm_jax import reference as ref

# (atol, rtol) per dtype of the compared arrays: |a - e| <= atol + rtol * max|e|.
TOLERANCES = {
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
}


def assert_close(actual, expected, dtype=jnp.float32, what="value"):
    """Compare to the oracle with the tolerance of `dtype`; report max-abs and relative error."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    atol, rtol = TOLERANCES[jnp.dtype(dtype)]
    err = np.abs(actual - expected)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    rel = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    assert err.max(initial=0.0) <= atol + rtol * scale, (
        f"{what}: max abs err {err.max():.3e} (allowed {atol + rtol * scale:.3e}), rel err {rel:.3e}"
    )


@dataclasses.dataclass
class Case:
    rng: np.random.Generator
    api: str = "ops"  # "ops" or "reference"

    def op(self, name):
        """The function `name` of the api under test."""
        if self.api == "reference":
            return getattr(ref, name)
        if name.endswith("_init"):
            return getattr(ops, name)
        return functools.partial(getattr(ops, name), backend="xla")


@dataclasses.dataclass
class Mamba2Case(Case):
    batch: int = 3
    nheads: int = 4
    head_dim: int = 24
    d_state: int = 16
    n_groups: int = 2
    gated: bool = True
    dt_limit: tuple = (0.0, float("inf"))
    name = "mamba2"

    def __post_init__(self):
        r = self.rng
        self.A = -np.exp(r.uniform(-1.0, 0.5, self.nheads)).astype(np.float32)
        self.D = r.normal(size=self.nheads).astype(np.float32)
        self.dt_bias = r.normal(-1.0, 0.5, self.nheads).astype(np.float32)

    @property
    def dims(self):
        return (self.batch, self.nheads, self.head_dim, self.d_state)

    def initial_state(self):
        return (0.5 * self.rng.normal(size=self.dims)).astype(np.float32)

    def draw(self, *lead):
        """Inputs of len(lead) leading axes beyond batch (none: one step; (W,): a window)."""
        r, b, H, P, G, N = self.rng, self.batch, self.nheads, self.head_dim, self.n_groups, self.d_state
        f = lambda *s: r.normal(size=(b, *lead, *s)).astype(np.float32)  # noqa: E731
        inp = dict(x=f(H, P), dt=f(H), B=f(G, N), C=f(G, N))
        if self.gated:
            inp["z"] = f(H, P)
        return inp

    def _kw(self, inp):
        return dict(inp, A=self.A, D=self.D, dt_bias=self.dt_bias, dt_limit=self.dt_limit)

    def step(self, state, inp):
        return self.op("mamba2_step")(state, **self._kw(inp))

    def chunked(self, state, seq, chunk_size):
        return self.op("mamba2_chunked")(state, **self._kw(seq), chunk_size=chunk_size)

    def replay_init(self, checkpoint, L, buffer_dtype=jnp.float32):
        return self.op("mamba2_replay_init")(checkpoint, L, self.n_groups, buffer_dtype)

    def replay_step(self, rs, inp, route="output"):
        return self.op("mamba2_replay_step")(rs, **self._kw(inp), route=route)

    def verify(self, rs, window):
        return self.op("mamba2_replay_verify")(rs, **self._kw(window))

    def materialize(self, rs):
        return self.op("mamba2_replay_materialize")(rs, self.A)

    def flush(self, rs):
        return self.op("mamba2_replay_flush")(rs, self.A)

    def oracle_step(self, state, inp):
        return numpy_loops.mamba2_step(state, **self._kw(inp))


@dataclasses.dataclass
class GDNCase(Case):
    batch: int = 3
    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 16
    head_v_dim: int = 24
    name = "gdn"

    @property
    def dims(self):
        return (self.batch, self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def initial_state(self):
        return (0.5 * self.rng.normal(size=self.dims)).astype(np.float32)

    def draw(self, *lead):
        r, b, H, HV, K, V = self.rng, self.batch, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        f = lambda *s: r.normal(size=(b, *lead, *s)).astype(np.float32)  # noqa: E731
        return dict(
            q=f(H, K),
            k=f(H, K),
            v=f(HV, V),
            g=(-np.exp(r.normal(-1.0, 1.0, (b, *lead, HV)))).astype(np.float32),
            beta=(1.0 / (1.0 + np.exp(-f(HV)))).astype(np.float32),
        )

    def step(self, state, inp):
        return self.op("gdn_step")(state, **inp)

    def chunked(self, state, seq, chunk_size):
        return self.op("gdn_chunked")(state, **seq, chunk_size=chunk_size)

    def replay_init(self, checkpoint, L, buffer_dtype=jnp.float32):
        return self.op("gdn_replay_init")(checkpoint, L, self.num_k_heads, buffer_dtype)

    def replay_step(self, rs, inp, route="output"):
        return self.op("gdn_replay_step")(rs, **inp, route=route)

    def verify(self, rs, window):
        return self.op("gdn_replay_verify")(rs, **window)

    def materialize(self, rs):
        return self.op("gdn_replay_materialize")(rs)

    def flush(self, rs):
        return self.op("gdn_replay_flush")(rs)

    def oracle_step(self, state, inp):
        return numpy_loops.gdn_step(state, **inp)


def take_step(seq, t):
    """Step t of a sequence dict ([batch, T, ...] -> [batch, ...])."""
    return {key: value[:, t] for key, value in seq.items()}


def take_rows(inp, rows):
    return {key: value[rows] for key, value in inp.items()}
