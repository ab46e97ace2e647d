"""8-bit replay checkpoints (int8, float8_e4m3fn): the quantization itself, the reference, the kernels.

- The quantization (`replayssm_jax.state.quantize_rows`) against a NumPy
  float64 oracle; stochastic rounding unbiased over many keys and
  reproducible for one key.
- The reference: a replay step, verify and flush on an 8-bit checkpoint is
  the same op on the checkpoint read as f32, its written rows quantized once.
- The kernels (interpret mode, the CPU shapes): against the reference on
  every route, the flush launch and the fused flush, the verify window;
  against the float64 NumPy loops through `kernel_checks.check_replay`; the
  Triton lowering of every 8-bit kernel.
- Bad input: an 8-bit standard state, an unknown checkpoint dtype or
  rounding, a scale of the wrong shape, before any kernel runs.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import CPU_SHAPES, GDN, GPU_SHAPES, Mamba2, check_replay, lower_for_cuda, mixed_cursors, replay_config
from replayssm_jax import kernels, ops
from replayssm_jax import state as st
from replayssm_jax.testing import CHECKPOINT_8BIT_DTYPES, assert_close

f32, int8, fp8 = jnp.float32, jnp.int8, jnp.float8_e4m3fn
QDTYPES = [pytest.param(int8, id="int8"), pytest.param(fp8, id="fp8")]
ROUNDINGS = ["nearest", "stochastic"]

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
              # The warnings of the combinations the drift study finds unsafe (tested below).
              pytest.mark.filterwarnings("ignore:a replay checkpoint of:UserWarning"),
              pytest.mark.filterwarnings("ignore:the direct route rounds:UserWarning")]


def _f64(a):
    return np.asarray(jnp.asarray(a, f32), np.float64)


def oracle_quantize(S, dtype, noise):
    """float64 NumPy quantization of rows S [..., K]: (values as float64 grid points, scale)."""
    S = np.asarray(S, np.float64)
    qmax = 127.0 if dtype == int8 else 448.0
    amax = np.abs(S).max(-1)
    scale = np.where(amax == 0, 1.0, amax / qmax)
    x = S / scale[..., None]
    if dtype == int8:
        return np.clip(np.floor(x + noise), -qmax, qmax), scale
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(x))), -6.0)
    step = 2.0 ** (exponent - 3)
    return np.clip(np.floor(x / step + noise) * step, -qmax, qmax), scale


def random_rows(rng, shape=(3, 2, 8, 40)):
    """f32 rows of several magnitudes, one of them all zeros."""
    S = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape[:-1]))[..., None]
    S[0, 0, 0] = 0.0
    return S.astype(np.float32)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_rows_matches_float64_oracle(dtype, rounding, rng):
    S = random_rows(rng)
    noise = 0.5 if rounding == "nearest" else rng.integers(0, 2 ** 24, S.shape).astype(np.float32) * 2.0 ** -24
    values, scale = st.quantize_rows(jnp.asarray(S), dtype, jnp.asarray(noise))
    want, want_scale = oracle_quantize(S, dtype, noise)
    assert values.dtype == dtype and scale.dtype == f32 and scale.shape == S.shape[:-1]
    np.testing.assert_allclose(_f64(scale), want_scale, rtol=1e-6)
    assert _f64(scale)[0, 0, 0] == 1.0 and not _f64(values)[0, 0, 0].any()  # a zero row: scale 1, no NaN
    # f32 and float64 may round S / scale to opposite sides of a grid boundary in rare elements.
    mismatch = _f64(values) != want
    assert mismatch.mean() < 1e-3, f"{mismatch.sum()} of {mismatch.size} values differ from the oracle"
    deq = _f64(st.dequantize(values, scale))
    step = 1.0 if dtype == int8 else 2.0 ** (  # the grid step at S / scale
        np.maximum(np.floor(np.log2(np.maximum(np.abs(S / want_scale[..., None]), 1e-30))), -6) - 3)
    bound = np.broadcast_to((0.5 if rounding == "nearest" else 1.0) * step * want_scale[..., None] * (1 + 1e-5),
                            S.shape)
    assert np.all(np.abs(deq - S)[~mismatch] <= bound[~mismatch]), "an element off its grid neighbours"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantize_rows_non_finite_rows_stay_non_finite(dtype):
    S = jnp.asarray([[1.0, 2.0, np.nan], [1.0, np.inf, 0.5], [0.0, 0.0, 0.0]], f32)
    values, scale = st.quantize_rows(S, dtype, 0.5)
    deq = _f64(st.dequantize(values, scale))
    assert not np.isfinite(deq[0]).all() and not np.isfinite(deq[1]).all()
    np.testing.assert_array_equal(deq[2], 0.0)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_stochastic_rounding_is_unbiased_over_keys(dtype, rng):
    """The mean over 4096 write counts of the dequantized rows is the row itself, within 6 standard errors;
    every draw is one of the value's two grid neighbours."""
    S = random_rows(rng, (1, 2, 4, 24))
    n = 4096
    shape = (n, *S.shape[1:])
    counters = jnp.arange(n, dtype=jnp.int32)
    noise = st.write_noise(shape, counters, "stochastic")
    values, scale = st.quantize_rows(jnp.broadcast_to(jnp.asarray(S), shape), dtype, noise)
    deq = _f64(st.dequantize(values, scale))
    grid = _f64(values)  # the draws in grid units (scale 1)
    _, row_scale = oracle_quantize(S[0], dtype, 0.5)
    x = np.abs(S[0] / row_scale[..., None])
    step = np.ones_like(x) if dtype == int8 else 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(x, 1e-30))), -6) - 3)
    # Each element takes at most its two neighbouring grid points (one step apart; a boundary of binades
    # included, where the upper neighbour is one step of the lower binade away).
    assert np.all(grid.max(0) - grid.min(0) <= step * (1 + 1e-6)), "a draw off the value's two grid neighbours"
    standard_error = step * row_scale[..., None] / 2 / np.sqrt(n)
    bias = np.abs(deq.mean(0) - S[0])
    allowed = 6 * standard_error + 1e-6 * np.abs(S[0])  # grid points themselves: f32 rounding of value * scale
    assert np.all(bias <= allowed), f"max bias / allowed {np.max(bias / allowed)}"


def test_stochastic_rounding_is_reproducible_and_keyed_by_counter_row_and_head():
    counter = jnp.asarray([0, 0, 5], jnp.int32)
    shape = (3, 2, 4, 8)
    a = st.write_noise(shape, counter, "stochastic")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(st.write_noise(shape, counter, "stochastic")))
    assert np.all((np.asarray(a) >= 0) & (np.asarray(a) < 1))
    a = np.asarray(a)
    assert (a[0] != a[1]).mean() > 0.99  # rows 0 and 1 share the counter: the batch row keys them apart
    assert (a[:, 0] != a[:, 1]).mean() > 0.99  # heads
    b = np.asarray(st.write_noise(shape, counter + 1, "stochastic"))
    assert (a != b).mean() > 0.99  # the next write draws fresh numbers
    assert st.write_noise(shape, counter, "nearest") == 0.5


# ---------------------------------------------------------------------------
# The reference


def _as_f32(rs):
    return st.as_f32_checkpoint(rs)


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2])
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("route", ["output", "direct"])
def test_reference_step_is_the_f32_step_quantized_once(layer_cls, dtype, rounding, route, rng):
    layer = layer_cls(CPU_SHAPES[layer_cls][0], rng)
    L = 4
    rs = layer.replay_state(L, dtype, f32, mixed_cursors(layer.s.batch, L), rounding)
    inp = layer.draw()
    y, new = layer.replay_step(rs, inp, route)
    y32, new32 = layer.replay_step(_as_f32(rs), inp, route)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y32))
    written = np.ones(layer.s.batch, bool) if route == "direct" else np.asarray(rs.cursor) >= L - 1
    values, scale = st.quantize_rows(new32.checkpoint, dtype, st.write_noise(rs.checkpoint.shape, rs.counter,
                                                                            rounding))
    np.testing.assert_array_equal(_f64(new.checkpoint)[written], _f64(values)[written])
    np.testing.assert_array_equal(_f64(new.scale)[written], _f64(scale)[written])
    np.testing.assert_array_equal(_f64(new.checkpoint)[~written], _f64(rs.checkpoint)[~written])
    np.testing.assert_array_equal(np.asarray(new.counter), np.asarray(rs.counter) + written)
    np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(new32.cursor))
    assert new.rounding == rounding and new.checkpoint.dtype == dtype


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2])
def test_reference_flush_and_materialize_read_the_dequantized_checkpoint(layer_cls, rng):
    layer = layer_cls(CPU_SHAPES[layer_cls][0], rng)
    rs = layer.replay_state(4, int8, f32, mixed_cursors(layer.s.batch, 4), "stochastic")
    np.testing.assert_array_equal(np.asarray(layer.materialize(rs)), np.asarray(layer.materialize(_as_f32(rs))))
    flushed = layer.flush(rs)
    assert flushed.checkpoint.dtype == int8 and not np.asarray(flushed.cursor).any()
    np.testing.assert_array_equal(np.asarray(flushed.counter), np.asarray(rs.counter) + 1)
    assert_close(layer.materialize(flushed), layer.materialize(rs), int8, what="flushed state")


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_replay_init_quantizes_the_checkpoint(layer_cls, dtype, rng):
    layer = layer_cls(CPU_SHAPES[layer_cls][0], rng)
    S = layer.state(f32)
    init = getattr(ops, f"{layer.layer}_replay_init")
    rs = init(S, 4, layer._key_groups(), checkpoint_dtype=dtype, rounding="stochastic")
    assert rs.checkpoint.dtype == dtype and rs.scale.shape == S.shape[:3] and rs.rounding == "stochastic"
    np.testing.assert_array_equal(np.asarray(rs.counter), 0)
    assert_close(st.dequantize(rs.checkpoint, rs.scale), S, dtype, what="dequantized checkpoint")
    plain = init(S, 4, layer._key_groups(), checkpoint_dtype=jnp.bfloat16)
    assert plain.scale is None and plain.counter is None and plain.checkpoint.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# The kernels (interpret mode) against the reference


def _same_quantized(new, want, what):
    """The kernels' 8-bit checkpoint against the reference's: equal values (a kernel's f32 state may round
    to the neighbouring grid point in rare elements), scales within the kernels' rounding, equal write
    counts."""
    differ = _f64(new.checkpoint) != _f64(want.checkpoint)
    assert differ.mean() < 2e-3, f"{what}: {differ.sum()} of {differ.size} checkpoint values differ"
    # The kernels' flush forms S with two-part bf16 dots for an 8-bit checkpoint (replay_math.split_parts:
    # about 16 mantissa bits, far below the checkpoint's 8), so a row's max, hence its scale, may differ
    # from the reference's by a few 1e-4 (3.3e-4 in 1 of 32768 rows, fp8 on the H200, 2026-12-01), and
    # more where the row's max is left by cancelling terms (2.7e-3 in 1 of 32768 rows, fp8, fused flush,
    # on the H200, 2026-12-03): every scale within 1e-2, at most 1 row in 1000 beyond 1e-3.
    np.testing.assert_allclose(_f64(new.scale), _f64(want.scale), rtol=1e-2, err_msg=what)
    beyond = np.abs(_f64(new.scale) - _f64(want.scale)) > 1e-3 * np.abs(_f64(want.scale))
    assert beyond.mean() <= 1e-3, f"{what}: {beyond.sum()} of {beyond.size} scales differ by more than 1e-3"
    np.testing.assert_array_equal(np.asarray(new.counter), np.asarray(want.counter), err_msg=what)
    np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(want.cursor), err_msg=what)


# The 8-bit checkpoint is read and written by the same code in every kernel of both layers
# (`tiles.load_checkpoint`, `tiles.store_checkpoint`, `state.quantize_rows`: the dtype's and the rounding's
# branches): by default the kernel tests below run each dtype on one layer (`one_layer_dtype`; the replay
# steps on each route, with the layers' dtypes in turn over the routes, so that each layer's kernels run
# both dtypes); the other cases are `slow` on the CPU (on a GPU every case runs).


def one_layer_dtype(layer_cls, dtype) -> bool:
    """Whether an 8-bit kernel case runs by default on the CPU: GDN with fp8, Mamba-2 with int8."""
    return (layer_cls is GDN) == (dtype == fp8)


def on_one_layer(layer_cls, *values, dtype, id):
    """pytest.param(layer_cls, *values) of an 8-bit kernel test whose checkpoint is of `dtype`, `slow` but
    where `one_layer_dtype`."""
    marks = [] if one_layer_dtype(layer_cls, dtype) else [pytest.mark.slow]
    return pytest.param(layer_cls, *values, id=id, marks=marks)


def on_backends(*values, id, default=True):
    """pytest.param(*values, backend) on each backend: "interpret" on the CPU shapes (`slow` unless
    `default`), "pallas" (compiled, `gpu`) on the model shapes at batch 8."""
    return [pytest.param(*values, "interpret", id=f"{id}-interpret", marks=[] if default else [pytest.mark.slow]),
            pytest.param(*values, "pallas", id=f"{id}-pallas", marks=pytest.mark.gpu)]


# (layer, dtype, rounding, route, fused_flush): each route (the replay kernel with its flush launch, with
# its fused flush, the state route, the direct route, the deferred route's flush launch and append kernel)
# with both dtypes and both roundings, on both layers. On the CPU by default each route with one dtype per
# layer, the layers' dtypes in turn over the routes (`one_layer_dtype` on the flush launch and the state
# route, the other pairing on the others): every route runs both dtypes, both roundings and both layers,
# each layer both dtypes, both roundings and both CPU shapes.
KERNEL_CASES = [
    param
    for layer_cls in (GDN, Mamba2)
    for (dtype, name), roundings in (((int8, "int8"), ROUNDINGS), ((fp8, "fp8"), ROUNDINGS[::-1]))
    for (route, fused, tag), rounding in zip(
        [("output", False, "two-launch"), ("output", True, "fused"), ("state", False, "state"),
         ("direct", None, "direct"), ("deferred", False, "deferred")], roundings * 3)
    for param in on_backends(layer_cls, dtype, rounding, route, fused,
                             id=f"{name}-{rounding}-{tag}-{layer_cls.__name__}",
                             default=one_layer_dtype(layer_cls, dtype) == (tag in ("two-launch", "state")))
]


def _kernel_shape(layer_cls, backend, index):
    if backend == "pallas":
        return GPU_SHAPES[layer_cls][0].with_batch(8)
    return CPU_SHAPES[layer_cls][index]


@pytest.mark.parametrize(("layer_cls", "dtype", "rounding", "route", "fused", "backend"), KERNEL_CASES)
def test_kernel_replay_steps_match_the_reference(layer_cls, dtype, rounding, route, fused, backend, rng):
    """L // 2 + 2 replay steps from mixed cursors (every row flushes at least once; on the deferred route
    every row that is not empty at the start), bf16 inputs and buffers on the second CPU shape. On the
    deferred route, whose outputs read the checkpoint its flush launch just wrote, the outputs are compared
    with the reference's from the kernels' flushed checkpoint (the two flushes may round an element to
    neighbouring grid points: f32 inputs and an int8 checkpoint on the H200, 2026-12-03, 5.1e-5 (GDN) and
    7.3e-3 (Mamba-2, 7e-6 of the largest output) from the reference's own against 2.3e-5 and 4.7e-3
    allowed)."""
    shape = _kernel_shape(layer_cls, backend, 0 if dtype == int8 else 1)
    input_dtype = f32 if dtype == int8 else jnp.bfloat16
    layer = layer_cls(shape, rng, input_dtype)
    L = 4
    rs = layer.replay_state(L, dtype, input_dtype, mixed_cursors(shape.batch, L), rounding)
    config = None if fused is None else replay_config(layer, L, dtype, fused_flush=fused)
    want = rs
    with jax.default_matmul_precision("highest"):
        for t in range(L // 2 + 2):
            inp, entry = layer.draw(), rs
            y, rs = layer.replay_step(rs, inp, route, backend, config)
            y_want, want = layer.replay_step(want, inp, route, "xla")
            if route == "deferred":  # from the kernels' flushed checkpoint, the full rows emptied
                flushed = entry.replace(checkpoint=rs.checkpoint, scale=rs.scale, counter=rs.counter,
                                        cursor=jnp.where(entry.cursor == L, 0, entry.cursor))
                y_want, _ = layer.replay_step(flushed, inp, route, "xla")
            assert_close(y, y_want, input_dtype, what=f"output, step {t}")
            _same_quantized(rs, want, f"step {t}")
            want = rs  # continue from the kernels' state: the next step's comparison is exact again


@pytest.mark.parametrize(("layer_cls", "dtype", "rounding", "backend"), [
    param for layer_cls in (GDN, Mamba2)
    for dtype, rounding, name in ((int8, "stochastic", "int8"), (fp8, "nearest", "fp8"))
    for param in on_backends(layer_cls, dtype, rounding, id=f"{name}-{layer_cls.__name__}",
                             default=one_layer_dtype(layer_cls, dtype))])
def test_kernel_verify_matches_the_reference(layer_cls, dtype, rounding, backend, rng):
    """A window of 3 from mixed cursors (the rows that lack room flush first, quantized), then a commit.
    The outputs are compared with the reference's from the kernels' flushed checkpoint (the two flushes
    may round an element to neighbouring grid points)."""
    layer = layer_cls(_kernel_shape(layer_cls, backend, 0), rng)
    L, W = 4, 3
    rs = layer.replay_state(L, dtype, f32, mixed_cursors(layer.s.batch, L), rounding)
    window = layer.draw(W)
    with jax.default_matmul_precision("highest"):
        y, new = layer.verify(rs, window, backend)
        _, want = layer.verify(rs, window, "xla")
        flushed = rs.replace(checkpoint=new.checkpoint, scale=new.scale, counter=new.counter, cursor=new.cursor)
        y_want, _ = layer.verify(flushed, window, "xla")
    assert_close(y, y_want, f32, what="window outputs")
    _same_quantized(new, want, "verify")
    np.testing.assert_array_equal(np.asarray(new.counter), np.asarray(rs.counter) + (np.asarray(rs.cursor) + W > L))
    committed = ops.replay_commit(new, jnp.full((layer.s.batch,), 2, jnp.int32))
    assert committed.scale is new.scale and committed.counter is new.counter


@pytest.mark.parametrize(("layer_cls", "dtypes", "route"), [
    on_one_layer(layer_cls, dtypes, route, dtype=CHECKPOINT_8BIT_DTYPES[dtypes][1],
                 id=f"{dtypes}-{route}-{layer_cls.__name__}")
    for layer_cls in (GDN, Mamba2) for dtypes, route in (("f32in-int8ckpt", "output"), ("bf16in-fp8ckpt", "direct"))])
def test_kernel_replay_against_numpy_loops(layer_cls, dtypes, route, rng):
    """The shared replay check (outputs and materialized state against the float64 NumPy recurrence, cursor
    rule, kernel against reference, non-flushing rows' checkpoint bit for bit) with an 8-bit checkpoint, at
    the 8-bit tolerances."""
    input_dtype, state_dtype, buffer_dtype = CHECKPOINT_8BIT_DTYPES[dtypes]
    layer = layer_cls(CPU_SHAPES[layer_cls][0], rng, input_dtype)
    check_replay(layer, 4, route, input_dtype, state_dtype, buffer_dtype, "interpret", steps=3)


@pytest.mark.parametrize(("layer_cls", "dtype"), [on_one_layer(layer_cls, dtype, dtype=dtype,
                                                               id=f"{name}-{layer_cls.__name__}")
                                                  for layer_cls in (GDN, Mamba2)
                                                  for dtype, name in ((int8, "int8"), (fp8, "fp8"))])
def test_8bit_kernels_lower_for_cuda(layer_cls, dtype, rng):
    """The Triton lowering of the 8-bit kernels (stochastic rounding, L 16: the flush's dot), on the CPU:
    per route the replay kernel with its flush launch and with its fused flush; the direct route; the verify
    window with its early flush."""
    layer = layer_cls(GPU_SHAPES[layer_cls][-1], rng, jnp.bfloat16)
    rs = layer.replay_state(16, dtype, jnp.bfloat16, np.zeros(layer.s.batch), "stochastic")
    inp = layer.draw()
    launches = 0
    for route in ("output", "state"):
        for fused in (False, True):
            config = replay_config(layer, 16, dtype, fused_flush=fused)
            text = lower_for_cuda(lambda r, i: layer.kernel_replay_step(r, i, route, config), rs, inp)
            launches += text.count("__gpu$xla.gpu.triton")
    text = lower_for_cuda(lambda r, i: layer.kernel_replay_step(r, i, "direct", None), rs, inp)
    launches += text.count("__gpu$xla.gpu.triton")
    if layer.layer == "gdn":
        verify = lambda r, w: kernels.gdn_replay_verify(r, **w, scale=layer.s.K ** -0.5, use_qk_l2norm=True)  # noqa: E731
    else:
        verify = lambda r, w: kernels.mamba2_replay_verify(r, **layer._kernel_args(w))  # noqa: E731
    text = lower_for_cuda(verify, rs, layer.draw(4))
    launches += text.count("__gpu$xla.gpu.triton")
    assert launches == 2 + 1 + 2 + 1 + 1 + 2


# ---------------------------------------------------------------------------
# Bad input


def test_8bit_standard_state_is_refused(rng):
    for layer_cls in (GDN, Mamba2):
        layer = layer_cls(CPU_SHAPES[layer_cls][0], rng)
        state = jnp.zeros((layer.s.batch, *layer.heads_dims()), int8)
        for backend in ("xla", "interpret"):
            with pytest.raises(TypeError, match=r"`state` must have dtype float32 or bfloat16; got int8: 8-bit"):
                layer.step(state, layer.draw(), backend)


def test_bad_checkpoint_dtype_and_rounding_are_refused(rng):
    layer = GDN(CPU_SHAPES[GDN][0], rng)
    S = layer.state(f32)
    with pytest.raises(TypeError, match=r"`checkpoint_dtype` must be a checkpoint dtype \(float32, bfloat16, int8, "
                                        r"float8_e4m3fn\); got float16"):
        ops.gdn_replay_init(S, 4, layer.s.H, checkpoint_dtype=jnp.float16)
    with pytest.raises(TypeError, match="`checkpoint_dtype` must be a checkpoint dtype"):
        ops.gdn_replay_init(S, 4, layer.s.H, checkpoint_dtype="int4x")
    with pytest.raises(ValueError, match="`rounding` must be one of 'nearest', 'stochastic'; got 'up'"):
        ops.mamba2_replay_init(jnp.zeros((2, 4, 8, 16)), 4, 2, checkpoint_dtype=int8, rounding="up")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_malformed_8bit_states_are_refused_before_any_kernel(backend, rng):
    layer = GDN(CPU_SHAPES[GDN][0], rng)
    rs = layer.replay_state(4, int8, f32, np.zeros(layer.s.batch))
    inp = layer.draw()
    batch, HV, V, _ = rs.checkpoint.shape
    cases = [
        (rs.replace(scale=rs.scale[:, :, :-1]), ValueError,
         rf"`state.scale` must have shape \[batch, HV, V\] = \({batch}, {HV}, {V}\); got \({batch}, {HV}, {V - 1}\)"),
        (rs.replace(scale=None), ValueError, r"`state.scale` must be an f32 array of shape \[batch, HV, V\]"),
        (rs.replace(scale=rs.scale.astype(jnp.bfloat16)), TypeError, r"`state.scale` must have dtype in \(float32\)"),
        (rs.replace(counter=None), TypeError, r"`state.counter` must be an int32 array of shape \[batch\]"),
        (rs.replace(rounding="up"), ValueError, "`state.rounding` must be one of 'nearest', 'stochastic'"),
        (st.as_f32_checkpoint(rs).replace(scale=rs.scale), ValueError,
         "`state.scale` must be None for a float32 checkpoint"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            layer.replay_step(bad, inp, "output", backend)
    # The failed calls left the state usable.
    y, _ = layer.replay_step(rs, inp, "output", backend)
    assert np.isfinite(_f64(y)).all()


# ---------------------------------------------------------------------------
# Models, the cache and the Generator


DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize("name", ["qwen3_5_tiny"])
def test_model_decodes_verifies_and_commits_on_8bit_checkpoints(name):
    """A model's cache (GDN layers; the Mamba-2 fixture runs in the Generator test) with int8 checkpoints: 12 decode steps (L 4: three flushes) close to the f32
    checkpoints' logits, a verify window and its commit; fewer bytes per sequence than f32."""
    from flax import nnx

    from models import load_model
    from models.common import make_decode_step, make_verify_step

    model = load_model(DATA / name)
    graphdef, params = nnx.split(model)
    decode, verify = make_decode_step(graphdef), make_verify_step(graphdef, donate_cache=False)
    prompt = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    prefill = jax.jit(lambda p, ids, dtype: nnx.merge(graphdef, p).prefill(
        ids, 24, replay_buffer_len=4, max_window=3, last_logits_only=True, checkpoint_dtype=dtype,
        checkpoint_rounding="stochastic"), static_argnums=2)
    (logits32, cache32), (logits8, cache8) = prefill(params, prompt, None), prefill(params, prompt, int8)
    assert cache8.bytes_per_sequence < cache32.bytes_per_sequence
    replay = [s.replay for s in cache8.layers if hasattr(s, "replay")]
    assert replay and all(r.checkpoint.dtype == int8 and r.rounding == "stochastic" for r in replay)
    token = jnp.argmax(logits32, -1).astype(jnp.int32)
    for _ in range(12):
        logits32, cache32 = decode(params, cache32, token)
        logits8, cache8 = decode(params, cache8, token)
        token = jnp.argmax(logits32, -1).astype(jnp.int32)
    assert_close(logits8, logits32, int8, what="logits after 12 steps")
    window = jnp.asarray([[5, 7, 11]], jnp.int32)
    (w32, v32), (w8, v8) = verify(params, cache32, window), verify(params, cache8, window)
    assert_close(w8, w32, int8, what="verify logits")
    committed = model.commit(v8, jnp.asarray([2], jnp.int32))
    logits8, _ = decode(params, committed, token)
    assert np.isfinite(_f64(logits8)).all()


def test_generator_takes_the_checkpoint_dtype():
    from models import load_model
    from replayssm_jax.generation import GenerationError, Generator

    model = load_model(DATA / "nemotron_h_tiny")
    out = Generator(model, buffer_len=4, state_dtype="float8_e4m3fn", state_rounding="stochastic").generate(
        [[1, 2, 3]], 6)
    assert out.num_generated == [6]
    with pytest.raises(GenerationError, match="`state_dtype` must be a checkpoint dtype .*; got float16"):
        Generator(model, state_dtype=jnp.float16)
    with pytest.raises(GenerationError, match="`state_dtype` applies to state 'replay'"):
        Generator(model, state="standard", state_dtype=int8)
    with pytest.raises(GenerationError, match="`state_rounding` must be one of 'nearest', 'stochastic'; got 'up'"):
        Generator(model, state_dtype=int8, state_rounding="up")
    with pytest.warns(UserWarning, match="`state_rounding` 'stochastic' applies to 8-bit checkpoints .* bfloat16"):
        Generator(model, state_dtype=jnp.bfloat16, state_rounding="stochastic")


def test_command_reports_the_checkpoint_format(capsys):
    """replayssm-generate: --state-dtype and --state-rounding in the JSON with the bytes per sequence; the
    library's fp8 warning as one line of the command's own; --state-rounding without an 8-bit dtype warns."""
    import json

    from replayssm_jax.generate import main

    base = ["--checkpoint", str(DATA / "nemotron_h_tiny"), "--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "3",
            "--stop", "", "--json", "--buffer-len", "4"]
    assert main(base + ["--state-dtype", "float8_e4m3fn", "--state-rounding", "stochastic"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["state_dtype"], report["state_rounding"]) == ("float8_e4m3fn", "stochastic")
    assert captured.err.startswith("replayssm-generate: warning: a replay checkpoint of float8_e4m3fn with stochastic")
    assert "warnings.warn" not in captured.err and "UserWarning" not in captured.err
    assert main(base + ["--state-rounding", "stochastic"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["state_dtype"], report["state_rounding"]) == (None, None)
    assert "warning: --state-rounding applies to 8-bit checkpoints" in captured.err
    assert report["cache_bytes"] > 0 and report["cache_bytes_per_sequence"] * 2 == report["cache_bytes"]


def test_unsafe_combinations_warn_and_auto_avoids_the_direct_route(rng):
    """fp8 warns on both layer types, int8 on GDN layers (either rounding); int8 on Mamba-2 does not,
    and "auto" takes the output route on it; the direct route on an 8-bit checkpoint warns."""
    import warnings

    gdn = GDN(CPU_SHAPES[GDN][0], rng)
    S = gdn.state(f32)
    for rounding in ROUNDINGS:
        with pytest.warns(UserWarning, match=f"a replay checkpoint of float8_e4m3fn with {rounding} rounding on gdn "
                                             "layers drifts"):
            ops.gdn_replay_init(S, 4, gdn.s.H, checkpoint_dtype=fp8, rounding=rounding)
        with pytest.warns(UserWarning, match=f"a replay checkpoint of int8 with {rounding} rounding on gdn layers is "
                                             "reported to drop Qwen3.5-4B's GSM8K"):
            ops.gdn_replay_init(S, 4, gdn.s.H, checkpoint_dtype=int8, rounding=rounding)
    with pytest.warns(UserWarning, match="a replay checkpoint of float8_e4m3fn with nearest rounding on mamba2"):
        ops.mamba2_replay_init(jnp.zeros((2, 4, 8, 16)), 4, 2, checkpoint_dtype=fp8)
    layer = Mamba2(CPU_SHAPES[Mamba2][0], rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rounding in ROUNDINGS:
            rs = ops.mamba2_replay_init(layer.state(f32), 4, layer._key_groups(), checkpoint_dtype=int8,
                                        rounding=rounding)
        inp = layer.draw()
        layer.replay_step(rs, inp, "output")
        # auto takes the output route on an 8-bit checkpoint, where it would take the direct one otherwise
        assert ops.resolve_route("auto", "interpret", rs) == "output"
        assert ops.resolve_route("auto", "interpret", st.as_f32_checkpoint(rs)) == "direct"
    with pytest.warns(UserWarning, match="the direct route rounds a checkpoint of int8 at every step"):
        layer.replay_step(rs, inp, "direct")


def test_drift_study_measures_a_layer(monkeypatch):
    """bench/state_drift.py's layer measurement on a CPU shape: finite, small errors for an int8 checkpoint
    (the script's full runs: `python3 bench/state_drift.py --quick`)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    import state_drift

    config = next(c for c in state_drift.CONFIGS if c[0] == "int8")
    errors = state_drift.layer_drift("gdn", CPU_SHAPES[GDN][0], 4, config, 40, "xla")
    assert errors.shape == (40,) and np.isfinite(errors).all() and 0 < errors.max() < 0.05
    assert set(state_drift.at_steps(errors, (32, 64))) == {32}
