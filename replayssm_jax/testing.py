"""Case tables of both layer types, shared by the tests and the benchmarks.

Per layer one table of named shapes (`GDN_CASES`, `MAMBA2_CASES`): the
model's layer, the awkward CPU shapes of the kernel tests (interpret mode)
and of the reference tests, and the GPU test shapes; the named dtype
combinations `DTYPES` (input, state, buffer) and the one per-dtype tolerance
table `TOLERANCES`. The layer adapters `GDN` and `Mamba2` draw fresh random
inputs, states and replay states of a shape (never zeros) and call the ops of
:mod:`replayssm_jax.ops` on a given backend, so that a test, a benchmark's
correctness check and its timing run the same shapes and the same calls.

Dimension letters (ARCHITECTURE.md): GDN B (batch), H key heads, HV value
heads, K key dim, V value dim; Mamba-2 B (batch), H heads, P head_dim,
N d_state, G n_groups; L buffer length.

Plain array code: no test framework is imported here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import kernels, ops
from replayssm_jax import reference as ref
from replayssm_jax.state import is_quantized, quantized_checkpoint

f32, bf16, int8, fp8 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn


class Dtypes(NamedTuple):
    """The dtypes of one case: activations (inputs and outputs), recurrent state (checkpoint), buffer records."""

    input: jnp.dtype
    state: jnp.dtype
    buffer: jnp.dtype


DTYPES = {
    "f32": Dtypes(f32, f32, f32),
    "bf16in-f32state": Dtypes(bf16, f32, bf16),
    "bf16in-bf16state": Dtypes(bf16, bf16, bf16),
}

# The 8-bit replay checkpoints (a replay state's only: no standard step takes them).
CHECKPOINT_8BIT_DTYPES = {
    "f32in-int8ckpt": Dtypes(f32, int8, f32),
    "bf16in-int8ckpt": Dtypes(bf16, int8, bf16),
    "f32in-fp8ckpt": Dtypes(f32, fp8, f32),
    "bf16in-fp8ckpt": Dtypes(bf16, fp8, bf16),
}

# (atol, rtol) per dtype of the compared arrays: |a - e| <= atol + rtol * max|e|. The 8-bit rows allow a
# few quanta of a checkpoint row (int8: max|row| / 127; e4m3: 1/16 of a value, half its grid step at
# nearest rounding), as two computations of the same f32 state may round it to neighbouring grid points.
TOLERANCES = {
    jnp.dtype(f32): (2e-5, 2e-5),
    jnp.dtype(bf16): (2e-2, 2e-2),
    jnp.dtype(int8): (4e-2, 4e-2),
    jnp.dtype(fp8): (2e-1, 2e-1),
}

# The TOLERANCES rows from the finest to the coarsest (float16 counts as bfloat16).
_COARSENESS = (jnp.dtype(f32), jnp.dtype(bf16), jnp.dtype(int8), jnp.dtype(fp8))


def tolerance_dtype(*dtypes):
    """The row of TOLERANCES for a case of these dtypes (e.g. input and state): the coarsest of them
    (float32 < bfloat16 = float16 < int8 < float8_e4m3fn)."""
    ranks = [_COARSENESS.index(jnp.dtype(bf16) if jnp.dtype(d) == jnp.dtype(jnp.float16) else jnp.dtype(d))
             for d in dtypes]
    return _COARSENESS[max(ranks, default=0)]


@dataclasses.dataclass(frozen=True)
class Closeness:
    """How far `actual` is from `expected`: max-abs error, its allowance and relative L2 error."""

    max_abs: float
    allowed: float
    rel: float
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.max_abs <= self.allowed

    def as_dict(self) -> dict:
        return dict(max_abs=self.max_abs, allowed=self.allowed, rel=self.rel, ok=self.ok)


def closeness(actual, expected, dtype=f32) -> Closeness:
    """Compare `actual` to `expected` (both cast to float64) with the TOLERANCES row of `dtype`.

    Raises ValueError when the shapes differ and KeyError for a dtype without a row.
    """
    actual = np.asarray(jnp.asarray(actual, f32), np.float64)
    expected = np.asarray(jnp.asarray(expected, f32), np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != expected {expected.shape}")
    atol, rtol = TOLERANCES[jnp.dtype(dtype)]
    err = np.abs(actual - expected)
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    rel = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    return Closeness(float(err.max(initial=0.0)), float(atol + rtol * scale), float(rel),
                     bool(np.all(np.isfinite(actual))))


@jax.jit
def _device_errors(actual, expected):
    a, e = actual.astype(f32), expected.astype(f32)
    diff = a - e
    return (jnp.max(jnp.abs(diff), initial=0.0), jnp.max(jnp.abs(e), initial=0.0), jnp.sqrt(jnp.sum(diff * diff)),
            jnp.sqrt(jnp.sum(e * e)), jnp.all(jnp.isfinite(a)))


def closeness_on_device(actual, expected, dtype=f32) -> Closeness:
    """:func:`closeness` computed where the arrays are (a GPU), in float32: five numbers come to the
    host instead of both arrays as float64 (a full Mamba-2 state at batch 512 is 2 GB, whose float64
    comparison on the host takes tens of seconds). The max-abs error is that of the float32
    difference (within half an ulp of the exact one); the norms of the relative error are float32 sums.

    Raises ValueError when the shapes differ and KeyError for a dtype without a row.
    """
    actual, expected = jnp.asarray(actual), jnp.asarray(expected)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != expected {expected.shape}")
    atol, rtol = TOLERANCES[jnp.dtype(dtype)]
    err, scale, diff_norm, norm, finite = jax.device_get(_device_errors(actual, expected))
    return Closeness(float(err), float(atol + rtol * scale), float(diff_norm) / max(float(norm), 1e-30), bool(finite))


def assert_close(actual, expected, dtype=f32, what="value"):
    """Raise AssertionError unless `actual` is within the tolerance of `dtype` of `expected` and finite;
    the message gives the max-abs and relative error."""
    try:
        c = closeness(actual, expected, dtype)
    except ValueError as e:
        raise AssertionError(f"{what}: {e}") from None
    if not c.finite:
        raise AssertionError(f"{what}: non-finite values")
    if not c.ok:
        raise AssertionError(f"{what}: max abs err {c.max_abs:.3e} (allowed {c.allowed:.3e}), rel err {c.rel:.3e}")


# ---------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True, kw_only=True)
class GDNShape:
    """A Gated DeltaNet layer: H key heads, HV value heads (a multiple of H), key dim K, value dim V; `batch`
    rows; `name` (if given) is its str. Keyword arguments only."""

    H: int
    HV: int
    K: int
    V: int
    batch: int = 1
    name: str = ""

    def with_batch(self, batch: int) -> GDNShape:
        return dataclasses.replace(self, batch=batch)

    def __str__(self):
        return self.name or f"gdn-b{self.batch}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Shape:
    """A Mamba-2 layer: H heads, head_dim P, d_state N, G groups (H a multiple of G), the z gate, dt's clamp;
    `batch` rows; `name` (if given) is its str. Keyword arguments only."""

    H: int
    P: int
    N: int
    G: int
    batch: int = 1
    gated: bool = True
    dt_limit: tuple = (0.0, float("inf"))
    name: str = ""

    def with_batch(self, batch: int) -> Mamba2Shape:
        return dataclasses.replace(self, batch=batch)

    def __str__(self):
        gate = "" if self.gated else "-ungated"
        return self.name or f"mamba2-b{self.batch}-H{self.H}-P{self.P}-N{self.N}-G{self.G}{gate}"


@dataclasses.dataclass(frozen=True)
class CaseTable:
    """The named shapes of one layer type.

    model: the benchmarked model's layer (batch set by the benchmark).
    cpu: the kernel tests' shapes in interpret mode (awkward sizes).
    reference: the reference tests' shapes (awkward sizes, three batch rows).
    gpu: the kernel tests' shapes compiled on a GPU (the model's layer first).
    """

    layer: str
    model: GDNShape | Mamba2Shape
    cpu: tuple
    reference: tuple
    gpu: tuple


_QWEN35_4B_GDN = GDNShape(name="qwen3.5-4b-gdn", H=16, HV=32, K=128, V=128)
_NEMOTRON3_NANO_4B_MAMBA2 = Mamba2Shape(name="nemotron3-nano-4b-mamba2", H=96, P=80, N=128, G=8)

GDN_CASES = CaseTable(
    layer="gdn",
    model=_QWEN35_4B_GDN,
    cpu=(GDNShape(batch=4, H=2, HV=4, K=20, V=24), GDNShape(batch=4, H=1, HV=1, K=100, V=16)),
    reference=(
        GDNShape(name="gdn-HV2H", batch=3, H=2, HV=4, K=16, V=24),
        GDNShape(name="gdn-HV3H-K100", batch=3, H=2, HV=6, K=100, V=24),
    ),
    gpu=(
        _QWEN35_4B_GDN.with_batch(8),  # heads split over programs
        _QWEN35_4B_GDN.with_batch(20),  # one program per head (batch * HV >= 4 * 132)
        GDNShape(batch=5, H=2, HV=6, K=100, V=80),
    ),
)
MAMBA2_CASES = CaseTable(
    layer="mamba2",
    model=_NEMOTRON3_NANO_4B_MAMBA2,
    cpu=(
        Mamba2Shape(batch=4, H=4, P=24, N=20, G=2),
        Mamba2Shape(batch=4, H=3, P=100, N=16, G=1, gated=False, dt_limit=(0.05, 0.8)),
    ),
    reference=(
        Mamba2Shape(name="mamba2", batch=3, H=4, P=24, N=16, G=2),
        Mamba2Shape(name="mamba2-P100-G1-ungated-dtlimit", batch=3, H=3, P=100, N=16, G=1, gated=False,
                    dt_limit=(0.05, 0.8)),
    ),
    gpu=(_NEMOTRON3_NANO_4B_MAMBA2.with_batch(8), Mamba2Shape(batch=5, H=6, P=100, N=64, G=2, gated=False)),
)
CASE_TABLES = {"gdn": GDN_CASES, "mamba2": MAMBA2_CASES}


# ---------------------------------------------------------------------------
# Random inputs


class _Normal:
    """Fresh float32 N(mean, scale^2) draws: from a numpy Generator (numpy arrays), or from a jax.random key
    (jax arrays on the default device, fast for states of a gigabyte)."""

    def __init__(self, rng):
        if isinstance(rng, np.random.Generator):
            self._rng, self._key = rng, None
        else:
            self._rng, self._key = None, rng if rng is not None else jax.random.key(0)

    def __call__(self, shape, mean=0.0, scale=1.0):
        if self._rng is not None:
            return (mean + scale * self._rng.standard_normal(shape)).astype(np.float32)
        self._key, key = jax.random.split(self._key)
        return mean + scale * jax.random.normal(key, shape, f32)

    @property
    def xp(self):
        """The array module of the draws: numpy or jax.numpy."""
        return np if self._rng is not None else jnp


def _cast(a, dtype):
    return jnp.asarray(a, dtype)


class _Layer:
    """What both adapters share: the draws and the calls of the ops on a backend. A subclass defines
    `layer` ("gdn" or "mamba2"), `heads_dims()` ((heads, rows, columns) of the state), `_key_groups()` (the
    heads of the buffered keys) and `random_inputs(lead)`."""

    layer: str
    _prefix: str

    def __init__(self, shape, rng, input_dtype=f32):
        """shape: a GDNShape / Mamba2Shape; rng: a numpy Generator or a jax.random key (None: key 0);
        input_dtype: the dtype of the drawn activations."""
        self.s, self.rng, self.dtype = shape, rng, jnp.dtype(input_dtype)
        self._normal = _Normal(rng)

    def _n(self, *shape, mean=0.0, scale=1.0):
        return self._normal(shape, mean, scale)

    def state(self, dtype=f32):
        """A random recurrent state f32/bf16[batch, heads, V or P, K or N], N(0, 0.25), a jax array."""
        return _cast(self._n(self.s.batch, *self.heads_dims(), scale=0.5), dtype)

    def _checkpoint(self, dtype, rounding):
        """The checkpoint fields of a random replay state: a random state in `dtype`, or (8-bit) quantized."""
        if not is_quantized(dtype):
            return dict(checkpoint=jnp.asarray(self.state(dtype)))
        values, scale, counter = quantized_checkpoint(jnp.asarray(self.state(f32)), dtype, rounding)
        return dict(checkpoint=values, scale=scale, counter=counter, rounding=rounding)

    def draw(self, *lead):
        """Inputs of one step (no `lead`) or of a sequence [batch, *lead, ...] (the ops' layout), jax arrays."""
        return self.random_inputs((self.s.batch, *lead))

    def _op(self, name, backend, config=None):
        kw = {} if config is None else {"config": config}
        return functools.partial(getattr(ops, f"{self.layer}_{name}"), backend=backend, **kw)

    def _kw(self, inp):
        return inp

    def step(self, state, inp, backend="xla", config=None):
        """(y, new state) of the standard step on `backend`."""
        return self._op("step", backend, config)(state, **self._kw(inp))

    def replay_step(self, rs, inp, route="output", backend="xla", config=None):
        """(y, new replay state) of the ReplaySSM step on `backend` and `route`."""
        return self._op("replay_step", backend, config)(rs, **self._kw(inp), route=route)

    def chunked(self, state, seq, chunk_size, backend="xla"):
        return self._op("chunked", backend)(state, **self._kw(seq), chunk_size=chunk_size)

    def verify(self, rs, window, backend="xla", config=None):
        """(y, replay state with the window pending) of the verify op on `backend` (kernels: `config`)."""
        return self._op("replay_verify", backend, config)(rs, **self._kw(window))

    def replay_init(self, checkpoint, L, buffer_dtype=f32, cursor=None):
        """An empty replay state on `checkpoint` (ops.*_replay_init), with `cursor` [batch] if given."""
        init = getattr(ops, f"{self.layer}_replay_init")
        rs = init(checkpoint, L, self._key_groups(), buffer_dtype)
        return rs if cursor is None else rs.replace(cursor=jnp.asarray(cursor, jnp.int32))


class GDN(_Layer):
    """Adapter of the Gated DeltaNet ops at one GDNShape."""

    layer = "gdn"

    def heads_dims(self):
        """(HV, V, K): the state's heads, rows and columns."""
        return self.s.HV, self.s.V, self.s.K

    def _key_groups(self):
        return self.s.H

    def random_inputs(self, lead):
        """One step's (or a sequence's) inputs with leading axes `lead`: q, k [*lead, H, K] and v [*lead, HV, V]
        N(0, 1); beta [*lead, HV] = sigmoid(N(0, 1)) in (0, 1), all in the input dtype; g f32[*lead, HV] =
        -exp(N(-1.5, 1)) < 0."""
        s, xp = self.s, self._normal.xp
        return dict(
            q=_cast(self._n(*lead, s.H, s.K), self.dtype),
            k=_cast(self._n(*lead, s.H, s.K), self.dtype),
            v=_cast(self._n(*lead, s.HV, s.V), self.dtype),
            g=_cast(-xp.exp(self._n(*lead, s.HV, mean=-1.5)), f32),
            beta=_cast(1.0 / (1.0 + xp.exp(-self._n(*lead, s.HV))), self.dtype),
        )

    def wipe_decay(self, inp):
        """The inputs with head 0's decay at its extreme: g = -inf (allowed: g <= 0)."""
        return dict(inp, g=jnp.asarray(inp["g"]).at[:, 0].set(-jnp.inf))

    def replay_state(self, L, state_dtype, buffer_dtype, cursor, rounding="nearest"):
        """A replay state with random live and dead records (normalised keys) and the given cursors [batch];
        an 8-bit `state_dtype` quantizes the checkpoint with `rounding`."""
        s = self.s
        k = np.asarray(self._n(s.batch, s.H, L, s.K))
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)  # not in place: a jax draw is read-only
        return ref.GDNReplayState(
            **self._checkpoint(state_dtype, rounding),
            d=jnp.asarray(self._n(s.batch, s.HV, L, s.V, scale=0.5), buffer_dtype),
            k=jnp.asarray(k, buffer_dtype),
            g=jnp.asarray(-np.exp(np.asarray(self._n(s.batch, s.HV, L, mean=-1.5))), f32),
            cursor=jnp.asarray(cursor, jnp.int32),
        )

    def materialize(self, rs, backend="xla"):
        return self._op("replay_materialize", backend)(rs)

    def flush(self, rs, backend="xla"):
        return self._op("replay_flush", backend)(rs)

    def kernel_step(self, state, inp):
        """The standard step's kernel entry point (replayssm_jax.kernels), no dispatch: the
        reference's defaults (scale K ** -0.5, L2-normalized q and k) given explicitly."""
        return kernels.gdn_step(state, **self._kw(inp), scale=self.s.K ** -0.5, use_qk_l2norm=True)

    def kernel_replay_step(self, rs, inp, route, config=None):
        return kernels.gdn_replay_step(rs, **self._kw(inp), scale=self.s.K ** -0.5, use_qk_l2norm=True,
                                       route=route, config=config)


class Mamba2(_Layer):
    """Adapter of the Mamba-2 ops at one Mamba2Shape, with random layer parameters: A f32[H] = -exp(N(-0.25,
    0.45)) < 0, D f32[H] N(0, 1), dt_bias f32[H] N(-1, 0.25)."""

    layer = "mamba2"

    def __init__(self, shape, rng, input_dtype=f32):
        super().__init__(shape, rng, input_dtype)
        H, xp = shape.H, self._normal.xp
        self.A = -xp.exp(self._n(H, mean=-0.25, scale=0.45))
        self.D = self._n(H)
        self.dt_bias = self._n(H, mean=-1.0, scale=0.5)

    @property
    def params(self) -> dict:
        """The layer parameters of every op call, from the attributes (a test may replace `A`)."""
        return dict(A=self.A, D=self.D, dt_bias=self.dt_bias, dt_limit=self.s.dt_limit)

    def heads_dims(self):
        """(H, P, N): the state's heads, rows and columns."""
        return self.s.H, self.s.P, self.s.N

    def _key_groups(self):
        return self.s.G

    def _kw(self, inp):
        return dict(inp, **self.params)

    def random_inputs(self, lead):
        """One step's (or a sequence's) inputs with leading axes `lead`, N(0, 1) in the input dtype:
        x [*lead, H, P], dt [*lead, H] (raw, before softplus), B, C [*lead, G, N], z [*lead, H, P] if gated."""
        s = self.s
        inp = dict(x=self._n(*lead, s.H, s.P), dt=self._n(*lead, s.H), B=self._n(*lead, s.G, s.N),
                   C=self._n(*lead, s.G, s.N))
        if s.gated:
            inp["z"] = self._n(*lead, s.H, s.P)
        return {key: _cast(value, self.dtype) for key, value in inp.items()}

    def wipe_decay(self, inp):
        """The inputs with a dt spike on head 0 (raw dt 1e4: exp(dt A) underflows to 0)."""
        return dict(inp, dt=jnp.asarray(inp["dt"]).at[:, 0].set(1e4))

    def replay_state(self, L, state_dtype, buffer_dtype, cursor, rounding="nearest"):
        """A replay state with random live and dead records (dt after softplus) and the given cursors [batch];
        an 8-bit `state_dtype` quantizes the checkpoint with `rounding`."""
        s = self.s
        return ref.Mamba2ReplayState(
            **self._checkpoint(state_dtype, rounding),
            x=jnp.asarray(self._n(s.batch, s.H, L, s.P), buffer_dtype),
            dt=jnp.asarray(np.log1p(np.exp(np.asarray(self._n(s.batch, s.H, L, mean=-1.0, scale=0.7)))), f32),
            B=jnp.asarray(self._n(s.batch, s.G, L, s.N), buffer_dtype),
            cursor=jnp.asarray(cursor, jnp.int32),
        )

    def materialize(self, rs, backend="xla"):
        return self._op("replay_materialize", backend)(rs, self.A)

    def flush(self, rs, backend="xla"):
        return self._op("replay_flush", backend)(rs, self.A)

    def _kernel_args(self, inp):
        """The keyword arguments of the kernels' entry points: every input named (z None without the gate)."""
        return dict(inp, z=inp.get("z"), **self.params, dt_softplus=True)

    def kernel_step(self, state, inp):
        """The standard step's kernel entry point (replayssm_jax.kernels), no dispatch."""
        return kernels.mamba2_step(state, **self._kernel_args(inp))

    def kernel_replay_step(self, rs, inp, route, config=None):
        return kernels.mamba2_replay_step(rs, **self._kernel_args(inp), route=route, config=config)


ADAPTERS = {"gdn": GDN, "mamba2": Mamba2}
