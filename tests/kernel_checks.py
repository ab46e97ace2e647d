"""Shared checks of the Pallas kernels against the reference, for both layers.

A `Layer` adapter draws fresh random inputs of one shape (never zeros) and
calls an op through :mod:`replayssm_jax.ops` with a given backend. The checks
run the same inputs through the kernel backend ("interpret" on the CPU,
"pallas" on a GPU) and the "xla" reference, and compare outputs and states
with the per-dtype tolerance table of cases.py.

The shapes are also the benchmark's named shapes (bench/kernels.py keeps its
own copy of the two realistic ones).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cases import assert_close
from replayssm_jax import kernels, ops
from replayssm_jax import reference as ref

f32, bf16 = jnp.float32, jnp.bfloat16

# (input dtype, state dtype, buffer dtype), named.
DTYPES = {
    "f32": (f32, f32, f32),
    "bf16in-f32state": (bf16, f32, bf16),
    "bf16in-bf16state": (bf16, bf16, bf16),
}


def tol_dtype(input_dtype, state_dtype):
    return bf16 if bf16 in (jnp.dtype(input_dtype), jnp.dtype(state_dtype)) else f32


@dataclasses.dataclass(frozen=True)
class GDNShape:
    batch: int
    H: int
    HV: int
    K: int
    V: int

    def __str__(self):
        return f"gdn-b{self.batch}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"


@dataclasses.dataclass(frozen=True)
class Mamba2Shape:
    batch: int
    H: int
    P: int
    N: int
    G: int
    gated: bool = True
    dt_limit: tuple = (0.0, float("inf"))

    def __str__(self):
        gate = "" if self.gated else "-ungated"
        return f"mamba2-b{self.batch}-H{self.H}-P{self.P}-N{self.N}-G{self.G}{gate}"


class GDN:
    """Adapter for the Gated DeltaNet ops."""

    def __init__(self, shape: GDNShape, rng: np.random.Generator, input_dtype=f32):
        self.s, self.rng, self.dtype = shape, rng, input_dtype

    def _n(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def state(self, dtype):
        s = self.s
        return jnp.asarray(0.5 * self._n(s.batch, s.HV, s.V, s.K), dtype)

    def draw(self):
        s, r = self.s, self.rng
        cast = lambda a: jnp.asarray(a, self.dtype)  # noqa: E731
        return dict(
            q=cast(self._n(s.batch, s.H, s.K)),
            k=cast(self._n(s.batch, s.H, s.K)),
            v=cast(self._n(s.batch, s.HV, s.V)),
            g=jnp.asarray(-np.exp(r.normal(-1.5, 1.0, (s.batch, s.HV))), f32),
            beta=cast(1.0 / (1.0 + np.exp(-self._n(s.batch, s.HV)))),
        )

    def step(self, state, inp, backend):
        return ops.gdn_step(state, **inp, backend=backend)

    def wipe_decay(self, inp):
        """The inputs with head 0's decay at its extreme: g = -inf (allowed: g <= 0)."""
        return dict(inp, g=inp["g"].at[:, 0].set(-jnp.inf))

    def replay_state(self, L, state_dtype, buffer_dtype, cursor):
        """A replay state with random live and dead records and the given cursors."""
        s, r = self.s, self.rng
        k = self._n(s.batch, s.H, L, s.K)
        k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        return ref.GDNReplayState(
            checkpoint=self.state(state_dtype),
            d=jnp.asarray(0.5 * self._n(s.batch, s.HV, L, s.V), buffer_dtype),
            k=jnp.asarray(k, buffer_dtype),
            g=jnp.asarray(-np.exp(r.normal(-1.5, 1.0, (s.batch, s.HV, L))), f32),
            cursor=jnp.asarray(cursor, jnp.int32),
        )

    def replay_step(self, rs, inp, route, backend, config=None):
        kw = {} if config is None else {"config": config}
        return ops.gdn_replay_step(rs, **inp, route=route, backend=backend, **kw)

    def materialize(self, rs):
        return ref.gdn_replay_materialize(rs)

    def kernel_step(self, state, inp):
        """The standard step's kernel entry point (replayssm_jax.kernels), no dispatch: the
        reference's defaults (scale K ** -0.5, L2-normalized q and k) given explicitly."""
        return kernels.gdn_step(state, **inp, scale=self.s.K ** -0.5, use_qk_l2norm=True)

    def kernel_replay_step(self, rs, inp, route, config=None):
        return kernels.gdn_replay_step(rs, **inp, scale=self.s.K ** -0.5, use_qk_l2norm=True, route=route,
                                       config=config)


class Mamba2:
    """Adapter for the Mamba-2 ops."""

    def __init__(self, shape: Mamba2Shape, rng: np.random.Generator, input_dtype=f32):
        self.s, self.rng, self.dtype = shape, rng, input_dtype
        s = shape
        self.A = jnp.asarray(-np.exp(rng.uniform(-1.0, 0.5, s.H)), f32)
        self.params = dict(
            A=self.A,
            D=jnp.asarray(rng.standard_normal(s.H), f32),
            dt_bias=jnp.asarray(rng.normal(-1.0, 0.5, s.H), f32),
            dt_limit=s.dt_limit,
        )

    def _n(self, *shape):
        return self.rng.standard_normal(shape).astype(np.float32)

    def state(self, dtype):
        s = self.s
        return jnp.asarray(0.5 * self._n(s.batch, s.H, s.P, s.N), dtype)

    def draw(self):
        s = self.s
        cast = lambda a: jnp.asarray(a, self.dtype)  # noqa: E731
        inp = dict(
            x=cast(self._n(s.batch, s.H, s.P)),
            dt=cast(self._n(s.batch, s.H)),
            B=cast(self._n(s.batch, s.G, s.N)),
            C=cast(self._n(s.batch, s.G, s.N)),
        )
        if s.gated:
            inp["z"] = cast(self._n(s.batch, s.H, s.P))
        return inp

    def step(self, state, inp, backend):
        return ops.mamba2_step(state, **inp, **self.params, backend=backend)

    def wipe_decay(self, inp):
        """The inputs with a dt spike on head 0 (raw dt 1e4: exp(dt A) underflows to 0)."""
        return dict(inp, dt=inp["dt"].at[:, 0].set(1e4))

    def replay_state(self, L, state_dtype, buffer_dtype, cursor):
        s, r = self.s, self.rng
        return ref.Mamba2ReplayState(
            checkpoint=self.state(state_dtype),
            x=jnp.asarray(self._n(s.batch, s.H, L, s.P), buffer_dtype),
            dt=jnp.asarray(np.log1p(np.exp(r.normal(-1.0, 0.7, (s.batch, s.H, L)))), f32),
            B=jnp.asarray(self._n(s.batch, s.G, L, s.N), buffer_dtype),
            cursor=jnp.asarray(cursor, jnp.int32),
        )

    def replay_step(self, rs, inp, route, backend, config=None):
        kw = {} if config is None else {"config": config}
        return ops.mamba2_replay_step(rs, **inp, **self.params, route=route, backend=backend, **kw)

    def materialize(self, rs):
        return ref.mamba2_replay_materialize(rs, self.A)

    def _kernel_args(self, inp):
        """The keyword arguments of the kernels' entry points: every input named (z None without the gate)."""
        return dict(inp, z=inp.get("z"), **self.params, dt_softplus=True)

    def kernel_step(self, state, inp):
        """The standard step's kernel entry point (replayssm_jax.kernels), no dispatch."""
        return kernels.mamba2_step(state, **self._kernel_args(inp))

    def kernel_replay_step(self, rs, inp, route, config=None):
        return kernels.mamba2_replay_step(rs, **self._kernel_args(inp), route=route, config=config)


def replay_config(layer, L: int, state_dtype, **changes):
    """The kernels' default ReplayConfig at the layer's shape, with `changes` (e.g. fused_flush)."""
    s = layer.s
    heads, V, K = (s.HV, s.V, s.K) if isinstance(layer, GDN) else (s.H, s.P, s.N)
    base = kernels.default_replay_config(s.batch, heads, V, K, state_dtype, L)
    return dataclasses.replace(base, **changes)


def mixed_cursors(batch: int, L: int) -> np.ndarray:
    """Per-row cursors covering: empty (0), about to flush (L - 1), mid, and
    entering full (L, as after a speculative commit)."""
    pattern = [0, L - 1, L // 2, L]
    return np.array([pattern[i % len(pattern)] for i in range(batch)], np.int32)


def check_standard(layer, state_dtype, backend, steps=2):
    """`steps` standard steps on the kernel backend and the reference."""
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
        _check_standard(layer, state_dtype, backend, steps)


def _check_standard(layer, state_dtype, backend, steps):
    tol = tol_dtype(layer.dtype, state_dtype)
    state = layer.state(state_dtype)
    state_ref = state
    for t in range(steps):
        inp = layer.draw()
        y, state = layer.step(state, inp, backend)
        y_ref, state_ref = layer.step(state_ref, inp, "xla")
        assert y.dtype == y_ref.dtype and state.dtype == state_ref.dtype
        assert_close(y, y_ref, tol, what=f"output, step {t}")
        assert_close(state, state_ref, tol, what=f"state, step {t}")


def check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps=3, config=None,
                 poison=False, wipe_at=None):
    """Replay steps from a state with mixed cursors, kernel backend vs reference.

    Compared every step: outputs, the materialized state, the cursor rule
    (cursor + 1, or 0 for a row that flushes: cursor >= L - 1 at entry; 0
    for every row on the direct route), and that rows that do not flush keep
    their checkpoint bit for bit. `route`: one route, or a tuple of routes
    taken in turn, step by step (a decode loop may switch routes), and
    `config` then a config or a {route: config} (absent: the default). The
    reference runs with float32 matmuls (no TF32 on a GPU). `config` fixes
    the kernel tiling; `poison` fills the dead slots of the initial buffers
    with NaN and inf (as a rejected draft may leave them): they must not reach
    any output or state. `wipe_at`: the step whose inputs get an extreme
    decay on head 0 (`layer.wipe_decay`).
    """
    with jax.default_matmul_precision("highest"):
        _check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps, config, poison,
                      wipe_at)


def poison_dead_slots(rs):
    """`rs` with every buffer slot at or after its row's cursor set to NaN
    (and the first dead slot to inf)."""
    L = rs.buffer_len
    lane = np.arange(L)[None, None, :]
    cursor = np.asarray(rs.cursor)[:, None, None]
    changes = {}
    for name in ("d", "k", "g", "x", "dt", "B"):
        buf = getattr(rs, name, None)
        if buf is None:
            continue
        a = np.asarray(jnp.asarray(buf, f32)).copy()
        a = np.where((lane > cursor)[..., None] if a.ndim == 4 else lane > cursor, np.nan, a)
        a = np.where((lane == cursor)[..., None] if a.ndim == 4 else lane == cursor, np.inf, a)
        changes[name] = jnp.asarray(a, buf.dtype)
    return rs.replace(**changes)


def _check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps, config, poison, wipe_at):
    tol = tol_dtype(input_dtype, state_dtype)
    rs = layer.replay_state(L, state_dtype, buffer_dtype, mixed_cursors(layer.s.batch, L))
    if poison:
        rs = poison_dead_slots(rs)
    rs_ref = rs
    for t in range(steps):
        inp = layer.draw()
        if t == wipe_at:
            inp = layer.wipe_decay(inp)
        cursor = np.asarray(rs.cursor)
        step_route = route[t % len(route)] if isinstance(route, tuple) else route
        y, new = layer.replay_step(rs, inp, step_route, backend,
                                   config.get(step_route) if isinstance(config, dict) else config)
        assert np.isfinite(np.asarray(jnp.asarray(y, f32))).all(), f"non-finite output, step {t}"
        y_ref, rs_ref = layer.replay_step(rs_ref, inp, step_route, "xla")
        assert_close(y, y_ref, tol, what=f"output, step {t}")
        assert_close(layer.materialize(new), layer.materialize(rs_ref), tol, what=f"materialized state, step {t}")
        flush = np.ones_like(cursor, bool) if step_route == "direct" else cursor >= L - 1
        np.testing.assert_array_equal(np.asarray(new.cursor), np.where(flush, 0, cursor + 1), err_msg=f"cursor, step {t}")
        np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(rs_ref.cursor), err_msg=f"cursor vs reference, step {t}")
        kept = np.asarray(jnp.asarray(new.checkpoint, f32))[~flush]
        old = np.asarray(jnp.asarray(rs.checkpoint, f32))[~flush]
        np.testing.assert_array_equal(kept, old, err_msg=f"checkpoint of non-flushing rows changed, step {t}")
        rs = new


def with_dtype(x, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, x)


def lower_for_cuda(fn, *args):
    """Lower `fn(*args)` for CUDA on a machine without a GPU and return the
    StableHLO text: this runs the whole Pallas -> Triton lowering (power-of-two
    tensors, supported primitives, aliasing), short of compiling the PTX.
    Skips the test where this JAX has no hook for an abstract GPU."""
    import pytest
    from jax._src.pallas.triton import pallas_call_registration as registration

    gpu_info = getattr(registration, "gpu_info_lib", None)
    if gpu_info is None or not hasattr(gpu_info, "GpuInfo"):
        pytest.skip("this JAX has no hook to lower Pallas Triton kernels without a GPU")
    fake = gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
    real = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: fake
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        gpu_info.get_gpu_info = real
