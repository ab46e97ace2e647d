"""The Gated DeltaNet append route on Mosaic GPU (replayssm_jax.kernels.tma_readout).

On the CPU: the config's and the limits' errors (raised before any launch),
the default's choice, the pure-JAX form of the prelude (terms and shared
records) against the reference's append step (the readout formula of the
module docstring evaluated on the terms in jnp), the Triton prelude launch
(interpreted) against that form, and the step lowered for CUDA (the
prelude's and the readout's layouts, their records and cursor aliased in
place). On a GPU (`pytest -m gpu`): the compiled step against the
reference's append step, from staggered cursors with dead slots holding
inf, a full row under a trace, both checkpoint dtypes, tilings and key
groups; the compiled step is its two kernels and a decode loop copies no
state.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from cases import assert_close
from hlo_checks import assert_step_alone_and_in_a_loop
from kernel_checks import (GDN, GDNShape, check_auto_is_deferred, check_deferred_step_kernels, check_deferred_steps,
                           jaxpr_equations, lower_for_cuda, poison_dead_slots)
from replayssm_jax import kernels, ops, reference
from replayssm_jax.kernels import gdn as gdn_kernels
from replayssm_jax.kernels import tma_readout
from replayssm_jax.kernels.config import next_pow2
from replayssm_jax.testing import tolerance_dtype

f32, bf16 = jnp.float32, jnp.bfloat16
L = 8
SHAPE = GDNShape(batch=5, H=2, HV=4, K=64, V=128)


def _layer(rng, shape=SHAPE, dtype=bf16):
    return GDN(shape, rng, dtype)


def _state(layer, checkpoint_dtype, buffer_dtype, cursor, buffer_len=L):
    """A replay state whose dead slots (slot >= cursor) hold inf and NaN in every record (a rejected
    draft's; `kernel_checks.poison_dead_slots`)."""
    return poison_dead_slots(layer.replay_state(buffer_len, checkpoint_dtype, buffer_dtype, cursor))


def _check_records(new, want, cursor, dtype, what):
    """Records [batch, heads, L, n]: the slot at each row's cursor within the tolerance of `dtype`, every other
    slot (dead slots' inf included) bit for bit."""
    new, want = np.asarray(new, np.float32), np.asarray(want, np.float32)
    slot = np.broadcast_to((np.arange(L) == np.asarray(cursor)[:, None])[:, None, :, None], new.shape)
    assert_close(new[slot], want[slot], dtype, what=f"the new {what} records")
    np.testing.assert_array_equal(new[~slot], want[~slot], err_msg=f"{what} records at other slots")


def _reference(rs, inp, scale, use_qk_l2norm=True):
    return jax.jit(lambda s, i: reference.gdn_replay_step(s, **i, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                                          route="append"))(rs, inp)


# ---------------------------------------------------------------------------
# CPU: config, limits, prelude, lowering


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(block_v=32), ValueError, r"`config.block_v` must be 64 or 128.*got 32"),
    (dict(stages=0), ValueError, r"`config.stages` must be >= 1; got 0"),
    (dict(programs_per_sm=0), ValueError, r"`config.programs_per_sm` must be >= 1; got 0"),
    (dict(stages=2.0), TypeError, r"`config.stages` must be an int; got float"),
    (dict(block_v=True), TypeError, r"`config.block_v` must be an int; got bool"),
    (dict(record_slots=-1), ValueError, r"`config.record_slots` must be >= 0 \(0: all L slots in one copy\); got -1"),
    (dict(flush_keys_ahead=1), TypeError, r"`config.flush_keys_ahead` must be a bool or None; got int 1"),
])
def test_config_errors(changes, error, match):
    with pytest.raises(error, match=match):
        kernels.TMAReadoutConfig(**changes)
    assert kernels.TMAReadoutConfig(block_v=np.int64(128)).block_v == 128
    ahead = kernels.TMAReadoutConfig(flush_keys_ahead=np.True_).flush_keys_ahead
    assert ahead is True  # a numpy bool, stored as a bool


def test_flush_keys_default_by_checkpoint_dtype():
    """flush_keys_ahead None (the default): a step ahead with an f32 checkpoint, at the flush with a bf16 one;
    the deferred readout's shared memory counts the buffers of the mode it resolves to."""
    default = kernels.TMAReadoutConfig()
    assert default.keys_ahead(f32) is True and default.keys_ahead(bf16) is False
    for checkpoint in (f32, bf16):
        state, v = _abstract(256, checkpoint=checkpoint)
        explicit = kernels.TMAReadoutConfig(flush_keys_ahead=checkpoint == f32)
        assert (tma_readout.smem_bytes(state, v, default, deferred=True)
                == tma_readout.smem_bytes(state, v, explicit, deferred=True))


def test_limits_raise_before_any_launch(rng):
    """Each limit of the Mosaic GPU kernel is an error naming it, raised before a launch (on the CPU too)."""
    layer = _layer(rng)
    rs, inp = layer.replay_state(L, f32, bf16, np.zeros(SHAPE.batch, np.int32)), layer.draw()
    config = kernels.TMAReadoutConfig()

    def step(rs, route="append", config=config, **kw):
        return kernels.gdn_replay_step(rs, **inp, scale=0.1, use_qk_l2norm=True, route=route, config=config, **kw)

    with pytest.raises(NotImplementedError, match="compiled on a GPU only"):
        step(rs, interpret=True)
    with pytest.raises(NotImplementedError, match="no state pool"):
        step(rs, slots=jnp.arange(SHAPE.batch, dtype=jnp.int32))
    with pytest.raises(TypeError,
                       match=r"'append', 'deferred', 'direct' routes only; got route 'output' \(use a ReplayConfig\)"):
        step(rs, route="output")
    with pytest.raises(TypeError, match=r"got route 'state' \(use a ReplayConfig\)"):
        step(rs, route="state")
    with pytest.raises(ValueError, match=r"L \(buffer length\) a multiple of 8.*L = 4"):
        step(layer.replay_state(4, f32, bf16, np.zeros(SHAPE.batch, np.int32)))
    with pytest.raises(ValueError, match=r"V \(value dim\) a multiple of `config.block_v` = 128; got V = 64"):
        narrow = _layer(rng, GDNShape(batch=2, H=2, HV=4, K=64, V=64))
        kernels.gdn_replay_step(narrow.replay_state(L, f32, bf16, np.zeros(2, np.int32)), **narrow.draw(), scale=0.1,
                                use_qk_l2norm=True, route="append", config=kernels.TMAReadoutConfig(block_v=128))
    with pytest.raises(ValueError, match=r"K \(key dim\) a multiple of 64 for a bfloat16 checkpoint.*K = 32"):
        thin = _layer(rng, GDNShape(batch=2, H=2, HV=4, K=32, V=64))
        kernels.gdn_replay_step(thin.replay_state(L, bf16, bf16, np.zeros(2, np.int32)), **thin.draw(), scale=0.1,
                                use_qk_l2norm=True, route="append", config=config)
    with pytest.raises(TypeError, match="'xla' backend"):
        ops.gdn_replay_step(rs, **inp, route="append", backend="xla", config=config)
    with pytest.raises(TypeError, match="tiles a named route, not route='auto'"):
        ops.gdn_replay_step(rs, **inp, route="auto", backend="interpret", config=config)


def _abstract(batch, K=128, V=128, L=16, checkpoint=f32, d=bf16, act=bf16, H=16, HV=32):
    """(abstract replay state, abstract v) of a GDN layer: shapes only, nothing allocated. An 8-bit
    `checkpoint` dtype: the f32 state quantized to it."""
    wide = checkpoint in (f32, bf16)
    state = jax.eval_shape(lambda: ops.gdn_replay_init(jnp.zeros((batch, HV, V, K), checkpoint if wide else f32), L,
                                                       H, d, **({} if wide else dict(checkpoint_dtype=checkpoint))))
    return state, jax.ShapeDtypeStruct((batch, HV, V), act)


@pytest.mark.parametrize(("case", "config", "match"), [
    (dict(K=512), None, r"K \(key dim\) a multiple of 32 for a float32 checkpoint.*at most 256; got K = 512"),
    (dict(L=72), None, r"L \(buffer length\) a multiple of 8.*at most 64; got L = 72"),
    (dict(d=jnp.float8_e4m3fn), None, "f32 or bf16 d records; got float8_e4m3fn"),
    (dict(act=jnp.float16), None, "f32 or bf16 v; got float16"),
    (dict(H=32768, HV=32768), None, r"at most 32767 key heads .*; got H = 32768"),
    (dict(batch=200, d=f32), dict(block_v=128, stages=3, record_slots=0),
     r"3 stages of 128 rows need 234696 bytes of shared memory, above a program's 232448"),
    (dict(L=16), dict(record_slots=3),
     r"`config.record_slots` dividing L \(buffer length\) = 16; got record_slots = 3"),
], ids=["K-512", "L-72", "fp8-records", "f16-v", "H-32768", "smem", "record-slots"])
def test_limits_on_shapes(case, config, match):
    """The shape limits, on abstract states (the shared-memory bound at a batch where the pipeline keeps every
    stage; batch 200, a multiple of 4, also holds the cursors after the step. Before those cursors the
    bound was 233672 bytes, Mosaic GPU's lowering allocated 233504 there and refused)."""
    state, v = _abstract(**{"batch": 4, **case})
    with pytest.raises(ValueError, match=match):
        tma_readout.check_tma_readout(state, v, kernels.TMAReadoutConfig(**(config or {})), interpret=False,
                                      slots=None)


def test_deferred_readout_needs_whole_rows_of_keys_in_shared_memory():
    """The deferred route's readout copies a flushing item's slot-0 key into one of its shared buffers, one
    record of K entries each: K times the records' item size must be a multiple of TMA_ALIGN (128 bytes).
    K = 96 of bf16 (192 bytes) is refused there and taken on the append route; of f32 (384 bytes) taken on
    both."""
    config = kernels.TMAReadoutConfig()
    state, v = _abstract(64, K=96, d=bf16)
    tma_readout.check_tma_readout(state, v, config, interpret=False, slots=None)
    with pytest.raises(ValueError, match=r"deferred route's TMA readout takes K \(key dim\) \* the k records' item "
                                         r"size a multiple of 128 bytes .*; got K = 96 of bfloat16"):
        tma_readout.check_tma_readout(state, v, config, interpret=False, slots=None, deferred=True)
    state, v = _abstract(64, K=96, d=f32)
    tma_readout.check_tma_readout(state, v, config, interpret=False, slots=None, deferred=True)


@pytest.mark.parametrize(("k_dtype", "L", "takes"), [(bf16, 16, True), (bf16, 32, True), (bf16, 8, False),
                                                 (bf16, 24, False), (f32, 16, False)])
def test_flush_products_on_tensor_cores_need_bf16_keys_and_whole_instructions(k_dtype, L, takes):
    """The deferred readout's flush forms its products on the tensor cores (a WGMMA, its keys the swizzled B
    operand) with bf16 k records and L a multiple of WGMMA_K (16 slots of 2-byte records at a 32-byte
    swizzle); else in f32 outer products on keys read row by row, unswizzled."""
    assert tma_readout.keys_on_tensor_cores(k_dtype, L) is takes
    transforms = tma_readout._key_transforms(k_dtype, L)
    swizzled = (plgpu.TilingTransform((8, tma_readout.WGMMA_K)), plgpu.SwizzleTransform(tma_readout.KEY_SWIZZLE))
    assert transforms == (swizzled if takes else ())
    assert tma_readout.WGMMA_K * 2 == tma_readout.KEY_SWIZZLE  # a swizzle row holds one instruction's slots


def test_bf16_parts_sum_to_their_float32(rng):
    """The flush's A operand in three bf16 parts: their sum is the f32 value exactly (in float64), over
    a wide range of exponents and both signs, and each part is a bf16 value; one part alone is not exact."""
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-60, 60, 4096))).astype(np.float32)
    parts = tma_readout.bf16_parts(jnp.asarray(x))
    assert [p.dtype for p in parts] == [bf16] * 3
    total = sum(np.asarray(p, np.float64) for p in parts)
    np.testing.assert_array_equal(total, x.astype(np.float64))
    assert np.any(np.asarray(parts[0], np.float64) != x)


def test_shared_memory_counts_the_stages_a_program_keeps():
    """The pipeline keeps at most a program's steps: 4 stages of 128 rows fit at batch 2 (one step a
    program), not at batch 256. The deferred readout's k records a step ahead hold a second key buffer."""
    config = kernels.TMAReadoutConfig(block_v=128, stages=4)
    small, big = (tma_readout.smem_bytes(*_abstract(b, d=f32), config) for b in (2, 256))
    assert small < tma_readout.SMEM_BYTES < big
    state, v = _abstract(256, d=f32)
    ahead, at_flush = (tma_readout.smem_bytes(state, v, kernels.TMAReadoutConfig(flush_keys_ahead=a), deferred=True)
                       for a in (True, False))
    L, K, size = state.buffer_len, state.checkpoint.shape[-1], state.k.dtype.itemsize
    align = lambda n: -(-n // tma_readout.SMEM_ALIGN) * tma_readout.SMEM_ALIGN  # noqa: E731
    assert ahead - at_flush == L * K * size + align(2 * K * size) - align(K * size)  # keys: a multiple of 1 KiB


class _Device:
    """A stand-in for jax.devices()[0]: its platform, compute capability and SM count."""

    def __init__(self, platform="gpu", compute_capability="9.0", core_count=132):
        self.platform, self.compute_capability, self.core_count = platform, compute_capability, core_count


def test_a_gpu_before_hopper_is_refused(monkeypatch):
    """On a GPU of compute capability below 9 an explicit TMAReadoutConfig is refused before any launch."""
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(compute_capability="8.0")])
    state, v = _abstract(256)
    with pytest.raises(NotImplementedError, match=r"Hopper-class GPU \(compute capability 9.x\); this GPU's is "
                                                  r"'8.0'; use a StepConfig or ReplayConfig"):
        tma_readout.check_tma_readout(state, v, kernels.TMAReadoutConfig(), interpret=False, slots=None)


@pytest.mark.parametrize(("device", "case", "kw", "takes"), [
    (_Device(), dict(batch=256), {}, True),
    (_Device(), dict(batch=512), {}, True),
    (_Device(), dict(batch=64), {}, True),
    (_Device(), dict(batch=63), {}, False),
    (_Device(), dict(batch=64, checkpoint=bf16), {}, 128),
    (_Device(), dict(batch=63, checkpoint=bf16), {}, False),
    (_Device(), dict(batch=256, checkpoint=jnp.int8), {}, False),
    (_Device(), dict(batch=256, L=4), {}, False),
    (_Device(), dict(batch=256), dict(interpret=True), False),
    (_Device(), dict(batch=256), dict(slots=jnp.arange(256)), False),
    (_Device(compute_capability="8.0"), dict(batch=256), {}, False),
    (_Device(compute_capability="10.0"), dict(batch=256), {}, False),
    (_Device(platform="cpu"), dict(batch=256), {}, False),
    (_Device(), dict(batch=256, V=320), {}, False),
    (_Device(), dict(batch=256, K=256), {}, False),
    (_Device(), dict(batch=256, checkpoint=bf16, V=64), {}, True),
    (_Device(), dict(batch=256, checkpoint=bf16), dict(deferred=True), 128),
    (_Device(), dict(batch=256, checkpoint=bf16, V=64), dict(deferred=True), True),
    (_Device(), dict(batch=256), dict(deferred=True), True),
], ids=["b256", "b512", "b64", "b63", "bf16-b64", "bf16-b63", "int8", "L4", "interpret", "pool", "sm80", "sm100",
       "cpu", "V320", "K256-smem", "bf16-V64", "bf16-deferred", "bf16-deferred-V64", "f32-deferred"])
def test_default_tiling_of_the_append_route(device, case, kw, takes, monkeypatch):
    """The append route takes the Mosaic GPU kernel by default only where it was measured to pay (an f32
    or bf16 checkpoint of batch >= 64, compiled, on a Hopper-class GPU; not an 8-bit one), where the
    kernel takes the step and its programs fit the SMs at once (K = 256 in f32: one program's shared
    memory above half an SM's), and with V within the Triton kernels' bound. The readout of a bf16
    checkpoint takes tiles of 128 rows on either route (`takes` 128), or 64 (True) where V is not a
    multiple of 128."""
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    state, v = _abstract(**case)
    config = tma_readout.default_tma_readout(state, v, interpret=kw.get("interpret", False), slots=kw.get("slots"),
                                             deferred=kw.get("deferred", False))
    expected = {False: None, True: kernels.TMAReadoutConfig(), 128: kernels.TMAReadoutConfig(block_v=128)}[takes]
    assert config == expected


@pytest.mark.parametrize(("buffer_dtype", "use_qk_l2norm", "scale"), [(f32, True, None), (bf16, True, None),
                                                                    (f32, False, 0.3)])
def test_prelude_terms_give_the_reference_append_step(buffer_dtype, use_qk_l2norm, scale, rng):
    """The prelude's terms, put through the kernel's readout formula in jnp, give the reference's append
    outputs; its shared records are the reference's k and g records bit for bit (a full row's untouched);
    dead slots hold inf and change nothing. f32 activations: the f32 tolerance."""
    layer = _layer(rng, dtype=f32)
    cursor = np.array([0, 3, 7, 8, 5], np.int32)  # row 3 entered full
    rs, inp = _state(layer, f32, buffer_dtype, cursor), layer.draw()
    scale = SHAPE.K ** -0.5 if scale is None else scale
    o_ref, rs_ref = _reference(rs, inp, scale, use_qk_l2norm)
    qn, kn, terms = tma_readout.head_terms(rs, inp["q"], inp["k"], inp["g"], inp["beta"], scale=scale,
                                           use_qk_l2norm=use_qk_l2norm)
    group = SHAPE.HV // SHAPE.H
    live = (np.arange(L) < cursor[:, None])[:, None, :, None]
    U = jnp.where(live, rs.d.astype(f32), 0.0)
    S = rs.checkpoint.astype(f32)
    carried, kq, decay, beta = (terms[:, :, 2, i][..., None] for i in range(4))

    def read(x, a):
        return carried * jnp.einsum("bhvk,bhk->bhv", S, jnp.repeat(x, group, 1), precision="highest") + \
            jnp.einsum("bhl,bhlv->bhv", a, U, precision="highest")

    d = beta * (inp["v"].astype(f32) - decay * read(kn, terms[:, :, 0]))
    o = decay * read(qn, terms[:, :, 1]) + kq * d
    rows = cursor < L
    assert_close(o[rows], o_ref[rows], f32, what="outputs of the rows with a free slot")
    new = tma_readout.append_shared_records(rs, kn, inp["g"])
    _check_records(new.k, rs_ref.k, cursor, tolerance_dtype(buffer_dtype), "k")
    np.testing.assert_array_equal(np.asarray(new.g), np.asarray(rs_ref.g))
    assert np.isfinite(np.asarray(terms)).all()


@pytest.mark.parametrize("buffer_dtype", [f32, bf16])
def test_deferred_terms_give_the_reference_deferred_step(buffer_dtype, rng):
    """The deferred readout's formula in jnp from the prelude's pure-JAX outputs (`head_terms` with
    deferred=True, the records after `append_shared_records`, each full row's slot-0 key kept aside): a
    full row's checkpoint flushed with the flush terms (terms row 3, the scalars' lane 4) and the keys
    as the readout reads them, then read as an empty row's, gives the reference's deferred step, outputs
    and checkpoint; the other rows' checkpoints are untouched. f32 activations: the f32 tolerance."""
    layer = _layer(rng, dtype=f32)
    cursor = np.array([0, 3, L, 7, L], np.int32)  # rows 2 and 4 entered full
    rs, inp = _state(layer, f32, buffer_dtype, cursor), layer.draw()
    scale = SHAPE.K ** -0.5
    o_ref, rs_ref = jax.jit(lambda s, i: reference.gdn_replay_step(s, **i, scale=scale, use_qk_l2norm=True,
                                                                   route="deferred"))(rs, inp)
    qn, kn, terms = tma_readout.head_terms(rs, inp["q"], inp["k"], inp["g"], inp["beta"], scale=scale,
                                           use_qk_l2norm=True, deferred=True)
    after = tma_readout.append_shared_records(rs, kn, inp["g"], deferred=True)
    group, full = SHAPE.HV // SHAPE.H, cursor >= L
    keys = after.k.astype(f32).at[:, :, 0].set(rs.k[:, :, 0].astype(f32))  # slot 0 from the key kept aside
    keys = jnp.repeat(jnp.where(full[:, None, None, None], keys, 0.0), group, 1)
    U = jnp.where(full[:, None, None, None], rs.d.astype(f32), 0.0)  # a full row's d records are all live
    S = rs.checkpoint.astype(f32)
    flushed = terms[:, :, 2, 4][..., None, None] * S + jnp.einsum("bhl,bhlv,bhlk->bhvk", terms[:, :, 3], U, keys,
                                                                  precision="highest")
    S = jnp.where(full[:, None, None, None], flushed, S)
    assert_close(S[full], rs_ref.checkpoint[full], f32, what="the full rows' flushed checkpoints")
    np.testing.assert_array_equal(np.asarray(S[~full]), np.asarray(rs.checkpoint[~full]))
    live = (np.arange(L) < np.where(full, 0, cursor)[:, None])[:, None, :, None]
    U = jnp.where(live, rs.d.astype(f32), 0.0)
    carried, kq, decay, beta = (terms[:, :, 2, i][..., None] for i in range(4))

    def read(x, a):
        return carried * jnp.einsum("bhvk,bhk->bhv", S, jnp.repeat(x, group, 1), precision="highest") + \
            jnp.einsum("bhl,bhlv->bhv", a, U, precision="highest")

    d = beta * (inp["v"].astype(f32) - decay * read(kn, terms[:, :, 0]))
    assert_close(decay * read(qn, terms[:, :, 1]) + kq * d, o_ref, f32, what="outputs")


PRELUDE_SHAPES = {"bf16-records": (SHAPE, L, bf16, True), "f32-records-no-norm": (SHAPE, L, f32, False),
                  "group3-K96-L24": (GDNShape(batch=4, H=2, HV=6, K=96, V=64), 24, bf16, True)}
# Every shape on both routes with the prelude moving the cursor; the cursor left to the readout
# (move_cursor False, which decides only the prelude's last store, `advance_cursor`) on both routes at the
# first shape, at the others `slow`.
PRELUDE_CASES = [pytest.param(*case, route, move_cursor,
                              marks=[pytest.mark.slow] if not move_cursor and i else [],
                              id=f"{'moves-cursor' if move_cursor else 'cursor-to-the-readout'}-{route}-{name}")
                 for move_cursor in (True, False) for route in ("append", "deferred")
                 for i, (name, case) in enumerate(PRELUDE_SHAPES.items())]


@pytest.mark.parametrize(("shape", "buffer_len", "buffer_dtype", "use_qk_l2norm", "route", "move_cursor"),
                         PRELUDE_CASES)
def test_prelude_launch_matches_its_pure_jax_form(shape, buffer_len, buffer_dtype, use_qk_l2norm, route, move_cursor,
                                                  rng):
    """The Triton prelude launch (interpreted) against `head_terms` and `append_shared_records`: q, k and the
    terms within the f32 tolerance, the k records (the launch's own kn in the buffer's dtype, at each row's
    cursor) and the g records bit for bit (a full row's untouched, dead slots' inf kept), the cursor at entry
    in the readout's layout and after the step, with a key dim, a buffer length and a value heads' group
    that are not powers of two. On the deferred route a full row is read as
    empty (its records to slot 0, its cursor to 1), with its flush terms, and its slot-0 key before the
    step is kept aside. With move_cursor False (`readout_moves_cursor`) the cursor is left as it entered,
    for the readout to move. (The interpreter runs the programs one at a time and drops writes past an
    array's end: lanes past the end of a row's heads, and the cursor's arrival count, are the GPU
    tests' to check.)"""
    layer = _layer(rng, shape, f32)
    cursor = (np.arange(shape.batch) * 7 % (buffer_len + 1)).astype(np.int32)
    cursor[-1] = buffer_len  # a row that entered full
    rs, inp = _state(layer, f32, buffer_dtype, cursor, buffer_len), layer.draw()
    scale, deferred = 0.3, route == "deferred"
    qn, kn, terms = tma_readout.head_terms(rs, inp["q"], inp["k"], inp["g"], inp["beta"], scale=scale,
                                           use_qk_l2norm=use_qk_l2norm, deferred=deferred)
    records = gdn_kernels.Records(rs.d, rs.k, rs.g)
    got = gdn_kernels._head_terms(records, rs.cursor, gdn_kernels._f32_decay(gdn_kernels.Inputs(**inp)), scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, interpret=True, route=route, move_cursor=move_cursor)
    qn_k, kn_k, terms_k, entry, shared, cursor_next, *stash = got
    for name, a, b in (("qn", qn_k, qn), ("kn", kn_k, kn), ("terms", terms_k, terms)):
        assert_close(a, b, f32, what=f"the prelude's {name}")
    # the launch's own kn as written: kn within f32 tolerance of head_terms' can round to the other bf16
    want = tma_readout.append_shared_records(rs, kn_k, inp["g"], deferred)
    np.testing.assert_array_equal(np.asarray(shared.k, np.float32), np.asarray(want.k, np.float32))
    np.testing.assert_array_equal(np.asarray(shared.g), np.asarray(want.g))
    assert entry.shape == (tma_readout.cursor_rows(shape.batch) * tma_readout.TMA_MAX,)
    np.testing.assert_array_equal(np.asarray(entry)[:shape.batch], cursor)
    live = np.where(cursor >= buffer_len, 0, cursor) if deferred else cursor
    np.testing.assert_array_equal(np.asarray(cursor_next), np.minimum(live + 1, buffer_len) if move_cursor else cursor)
    assert len(stash) == deferred
    if deferred:  # the full rows' flush terms are nonzero (compared above); their slot-0 keys kept aside
        full = cursor >= buffer_len
        for name, t in (("kernel", terms_k), ("pure JAX", terms)):
            t = np.asarray(t)
            assert (t[full, :, 2, 4] > 0).all() and (t[~full][:, :, 2:, 4:] == 0).all(), name
        assert stash[0].dtype == rs.k.dtype
        np.testing.assert_array_equal(np.asarray(stash[0], np.float32)[full], np.asarray(rs.k[:, :, 0], np.float32)[full])


def test_prelude_keeps_the_cursor_on_the_readout_routes_only(rng):
    """move_cursor=False on the direct route (whose step sets the cursor to 0 and has no readout to move
    it) is refused before any launch."""
    layer = _layer(rng)
    rs, inp = _state(layer, f32, bf16, np.zeros(SHAPE.batch, np.int32)), layer.draw()
    with pytest.raises(ValueError, match=r"move_cursor=False on route 'direct'"):
        gdn_kernels._head_terms(gdn_kernels.Records(rs.d, rs.k, rs.g), rs.cursor,
                                gdn_kernels._f32_decay(gdn_kernels.Inputs(**inp)), scale=0.3, use_qk_l2norm=True,
                                interpret=True, route="direct", move_cursor=False)


@pytest.mark.parametrize("route", ["append", "deferred", "direct"])
@pytest.mark.parametrize("raw", [True, False], ids=["raw-gates", "given-gates"])
def test_prelude_reads_nothing_after_its_first_terms_store(route, raw):
    """The prelude's kernel loads all it reads (the value heads' gates and g records among them) before
    its loop over a key head's value heads stores the first terms tile: a load placed after a store that
    may alias it waits for it, a global round trip for each value head in every program (Qwen3.5-4B's
    layer on the H200 at batch 64: 4.0-4.9 us a step against 5.6-6.4 with the loads in the loop,
    bench/RESULTS.md, 2026-12-05). Checked on the kernel's jaxpr, in program order, with three value
    heads a key head."""
    B, H, HV, K, V = 3, 2, 6, 96, 64
    S = jax.ShapeDtypeStruct
    records = gdn_kernels.Records(d=S((B, HV, 24, V), bf16), k=S((B, H, 24, K), bf16), g=S((B, HV, 24), f32))
    per_head = S((HV,), f32) if raw else None
    inputs = gdn_kernels.Inputs(q=S((B, H, K), bf16), k=S((B, H, K), bf16), v=S((B, HV, V), bf16),
                                g=S((B, HV), bf16 if raw else f32), beta=S((B, HV), bf16), A_log=per_head,
                                dt_bias=per_head)
    jaxpr = jax.make_jaxpr(lambda r, c, i: gdn_kernels._head_terms(r, c, i, scale=0.3, use_qk_l2norm=True,
                                                                   interpret=True, route=route))(
        records, S((B,), jnp.int32), inputs)
    call = next(e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call")
    kernel = call.params["jaxpr"]
    terms_ref = kernel.invars[len(call.invars) + 2]  # outputs after the operands: qn, kn, terms, ...
    assert terms_ref.aval.shape == (next_pow2(HV), tma_readout.TERMS, 32)
    order = [(e.primitive.name, e.invars[0] if e.invars else None) for e in jaxpr_equations(kernel)]
    first_store = order.index(("masked_swap", terms_ref))
    reads = [name for name, _ in order if name in ("masked_load", "get", "load")]
    assert reads, "no load found: the primitives' names changed"
    late = [name for name, _ in order[first_store:] if name in ("masked_load", "get", "load")]
    assert not late, f"loads after the first store of the terms tile: {late}"


MODEL = GDNShape(batch=200, H=16, HV=32, K=128, V=128)  # Qwen3.5-4B's layer
MODEL_B67 = MODEL.with_batch(67)  # 4288 items over 264 programs


@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape", "buffer_len"), [
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), SHAPE, L),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128, stages=3), SHAPE, L),
    (f32, f32, f32, kernels.TMAReadoutConfig(programs_per_sm=1, stages=1), SHAPE, L),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(stages=3), MODEL, 16),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128, stages=2), MODEL.with_batch(300), 16),
    (f32, f32, f32, kernels.TMAReadoutConfig(record_slots=0), MODEL, 16),
], ids=["f32-bf16-default", "bf16-bf16-128x3", "f32-f32-f32act-64x1", "model-b200-3stages", "model-b300-bf16",
        "model-f32-records-one-copy"])
def test_kernel_lowers_for_cuda(checkpoint_dtype, buffer_dtype, act, config, shape, buffer_len, rng):
    """The step's whole lowering on the CPU (the prelude's Triton lowering; Mosaic GPU's layout inference,
    the swizzled tile's transforms, the pipeline's copies and, at the model's shape, its stages rotating
    over many items a program and a cursor of more than 256 rows), short of compiling: two custom calls,
    the prelude (its k and g records and cursor aliased in place) and the readout (its d records aliased
    in place; the cursor too at batch 200 and 300, `readout_moves_cursor`), and no other. The model cases on
    abstract inputs (nothing allocated)."""
    layer = _layer(rng, shape, act)
    if shape is SHAPE:
        args = (layer.replay_state(buffer_len, checkpoint_dtype, buffer_dtype,
                                   np.arange(shape.batch, dtype=np.int32) % buffer_len), layer.draw())
    else:
        state, _ = _abstract(shape.batch, L=buffer_len, checkpoint=checkpoint_dtype, d=buffer_dtype)
        args = (state, jax.eval_shape(layer.draw))
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "append", config), *args)
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", text)
    assert sorted(calls) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"], calls  # the prelude, the readout: no other
    assert re.search(r"@__gpu\$xla\.gpu\.triton\([^\n]*output_operand_aliases = \[#stablehlo\.output_operand_alias<"
                     r"output_tuple_indices = \[4\], operand_index = 0[^\n]*output_tuple_indices = \[5\], "
                     r"operand_index = 1[^\n]*output_tuple_indices = \[6\], operand_index = 2", text), \
        "the prelude's k and g records and cursor are not aliased"
    readout = re.search(r"@mosaic_gpu_v2\(([^\n]*)", text).group(1)
    pairs = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", readout)
    moves = shape is not SHAPE  # batch 200 and 300 (multiples of 4): the readout moves the cursor; 5: the prelude
    assert tma_readout.readout_moves_cursor(shape.batch) == moves
    assert sorted(pairs) == [("1", "6")] + [("2", "7")] * moves, pairs  # the d records (and cursor) in place


@pytest.mark.parametrize("checkpoint_dtype", [f32, bf16])
def test_deferred_step_lowers_for_cuda(checkpoint_dtype, rng):
    """The deferred route's lowering on the CPU at the model's shape (abstract inputs): the prelude and the
    readout, which flushes the full rows itself (no flush launch), its checkpoint and d records aliased in
    place, and the cursor too (batch 200: `readout_moves_cursor`), and no other custom call; f32 takes the
    flush's k records a step ahead, bf16 at the flush."""
    layer = _layer(rng, MODEL)
    state, _ = _abstract(MODEL.batch, L=16, checkpoint=checkpoint_dtype)
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "deferred", kernels.TMAReadoutConfig()),
                          state, jax.eval_shape(layer.draw))
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(([^\n]*)", text)
    assert sorted(c for c, _ in calls) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"], calls
    assert "gdn_deferred_terms_L16" in text and "deferred_flush" not in text
    readout = next(line for c, line in calls if c == "mosaic_gpu_v2")
    pairs = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", readout)
    assert sorted(pairs) == [("1", "0"), ("2", "6"), ("3", "9")], pairs  # checkpoint, d records, cursor in place
    assert ("_r4_kf" in text) == (checkpoint_dtype == bf16)  # the kernel's name: the flush's keys at the flush


# ---------------------------------------------------------------------------
# GPU: the compiled kernel against the reference


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape"), [
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), SHAPE),
    (f32, f32, f32, kernels.TMAReadoutConfig(block_v=128, programs_per_sm=1), SHAPE),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(stages=3), SHAPE),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), MODEL_B67),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), GDNShape(batch=7, H=2, HV=6, K=96, V=64)),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), GDNShape(batch=300, H=2, HV=4, K=128, V=128)),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(record_slots=0), SHAPE),
    (f32, f32, f32, kernels.TMAReadoutConfig(record_slots=1, block_v=128), SHAPE),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(record_slots=2, stages=3), MODEL_B67),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128), MODEL_B67),
], ids=["f32-bf16", "f32-f32-f32act-128", "bf16-bf16-3stages", "model-b67", "group3-K96", "b300", "one-copy",
        "1-slot-copies-f32", "2-slot-copies-b67", "bf16-128"])
def test_compiled_append_step_matches_the_reference(checkpoint_dtype, buffer_dtype, act, config, shape, rng):
    """From staggered cursors with inf and NaN in the dead slots: outputs and new records within the tolerance of
    the case's dtypes (f32 throughout: the f32 tolerance), every other slot, the checkpoint and the k and g
    records at other slots bit for bit, the cursor moved."""
    layer = _layer(rng, shape, act)
    cursor = (np.arange(shape.batch) * 3 % L).astype(np.int32)
    rs, inp = _state(layer, checkpoint_dtype, buffer_dtype, cursor), layer.draw()
    scale = shape.K ** -0.5
    o_ref, rs_ref = _reference(rs, inp, scale)
    o, new = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "append", config))(rs, inp)
    tol = tolerance_dtype(act, checkpoint_dtype, buffer_dtype)
    assert_close(o, o_ref, tol, what="outputs")
    np.testing.assert_array_equal(np.asarray(new.checkpoint), np.asarray(rs.checkpoint))
    np.testing.assert_array_equal(np.asarray(new.cursor), np.minimum(cursor + 1, L))
    _check_records(new.d, rs_ref.d, cursor, tol, "d")
    _check_records(new.k, rs_ref.k, cursor, tolerance_dtype(buffer_dtype), "k")
    np.testing.assert_array_equal(np.asarray(new.g), np.asarray(rs_ref.g))


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape", "buffer_len"), [
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), SHAPE, L),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128, stages=3), SHAPE, L),
    (f32, f32, f32, kernels.TMAReadoutConfig(record_slots=2), MODEL_B67, L),
    # 4288 items over 264 programs: the first 64 take a 17th step (a traced step count), 3 stages
    (f32, bf16, bf16, kernels.TMAReadoutConfig(stages=3), MODEL_B67, L),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(flush_keys_ahead=False), SHAPE, L),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(flush_keys_ahead=True), SHAPE, L),
    # L = 16 and 32, bf16 records: the flush's products on the tensor cores (`keys_on_tensor_cores`)
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), SHAPE, 16),
    (f32, bf16, f32, kernels.TMAReadoutConfig(record_slots=2, flush_keys_ahead=False), SHAPE, 16),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128), MODEL_B67, 16),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(record_slots=0), SHAPE, 32),
    # batch a multiple of 4: the readout moves the cursor (`readout_moves_cursor`)
    (f32, f32, f32, kernels.TMAReadoutConfig(), SHAPE.with_batch(8), L),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(block_v=128), MODEL.with_batch(68), 16),
], ids=["f32-bf16", "bf16-bf16-128x3", "model-b67-f32-2-slot-copies", "model-b67-3stages", "f32-keys-at-flush",
        "bf16-keys-ahead", "L16-f32-wgmma", "L16-f32act-2-slot-copies-wgmma", "L16-model-bf16-128-wgmma",
        "L32-one-copy-wgmma", "b8-f32-readout-moves-cursor", "L16-model-b68-bf16-readout-moves-cursor"])
def test_compiled_deferred_steps_match_the_reference(checkpoint_dtype, buffer_dtype, act, config, shape, buffer_len,
                                                     rng):
    """The deferred route on Mosaic GPU (the prelude, then the readout, which flushes the full rows itself):
    L + 2 steps from staggered cursors (3 b mod (L + 1): rows full at the start at L = 16 from batch 12 on;
    every row fills and enters a later step full), inf and NaN in the dead slots, against the reference's
    deferred route (`kernel_checks.check_deferred_steps`). At L = 16 and 32 with bf16 records the
    readout's flush forms its products on the tensor cores; at L = 8 in f32 outer products. The cursor
    is moved by the readout at batch 8 and 68, by the prelude at 5 and 67."""
    layer = _layer(rng, shape, act)
    cursor = (np.arange(shape.batch) * 3 % (buffer_len + 1)).astype(np.int32)
    check_deferred_steps(layer, _state(layer, checkpoint_dtype, buffer_dtype, cursor, buffer_len), config,
                         buffer_len + 2, tolerance_dtype(act, checkpoint_dtype, buffer_dtype))


@pytest.mark.gpu
def test_auto_route_at_batch_256_is_deferred(rng):
    """route="auto" at batch 256 with an f32 checkpoint: the deferred route, on the Mosaic GPU kernel on a
    Hopper-class GPU, within the tolerance of the reference (`kernel_checks.check_auto_is_deferred`)."""
    check_auto_is_deferred(_layer(rng, GDNShape(batch=256, H=4, HV=8, K=128, V=128)), "gdn", L)


@pytest.mark.gpu
def test_default_append_route_at_batch_256(rng):
    """config=None on the append route at batch 256 with an f32 checkpoint: the Mosaic GPU kernel on a
    Hopper-class GPU (the Triton kernel elsewhere), within the tolerance of the reference."""
    shape = GDNShape(batch=256, H=4, HV=8, K=128, V=128)
    layer = _layer(rng, shape)
    cursor = (np.arange(shape.batch) * 5 % 16).astype(np.int32)
    rs, inp = layer.replay_state(16, f32, bf16, cursor), layer.draw()
    step = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "append", None))
    calls = re.findall(r"custom_call @(\w+)\(", step.trace(rs, inp).lower().as_text())
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
    assert ("mosaic_gpu_v2" in calls) == hopper, calls  # an H100 or H200: the Mosaic GPU kernel
    o, new = step(rs, inp)
    o_ref, rs_ref = _reference(rs, inp, shape.K ** -0.5)
    assert_close(o, o_ref, tolerance_dtype(bf16, f32), what="outputs")
    np.testing.assert_array_equal(np.asarray(new.cursor), np.minimum(cursor + 1, 16))


@pytest.mark.gpu
@pytest.mark.parametrize(("config", "cursor"), [
    (kernels.TMAReadoutConfig(), [L, 2, L, 0, 5]),
    (kernels.TMAReadoutConfig(record_slots=0), [L, 2, L, 0, 5]),
    (kernels.TMAReadoutConfig(), [L, 2, L, 0, 5, L, 1, 3]),
], ids=["4-slot-copies", "one-copy", "b8-readout-moves-cursor"])
def test_compiled_full_row_keeps_its_state(config, cursor, rng):
    """A row that entered full, under a trace: NaN outputs, its state kept bit for bit, its cursor L; the
    others step. At batch 8 the readout moves the cursors (`readout_moves_cursor`), at 5 the prelude."""
    cursor = np.array(cursor, np.int32)
    layer = _layer(rng, SHAPE.with_batch(len(cursor)))
    rs, inp = _state(layer, f32, bf16, cursor), layer.draw()
    o, new = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "append", config))(rs, inp)
    o_ref, _ = _reference(rs, inp, SHAPE.K ** -0.5)
    full = cursor == L
    assert np.isnan(np.asarray(o, np.float32)[full]).all()
    assert_close(o[~full], o_ref[~full], tolerance_dtype(bf16), what="outputs of the other rows")
    for name in ("checkpoint", "d", "k", "g"):
        np.testing.assert_array_equal(np.asarray(getattr(new, name))[full], np.asarray(getattr(rs, name))[full],
                                      err_msg=f"{name} of a full row changed")
    np.testing.assert_array_equal(np.asarray(new.cursor), np.minimum(cursor + 1, L))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [SHAPE.batch, 8], ids=["prelude-moves-cursor", "readout-moves-cursor"])
def test_compiled_step_is_its_two_kernels(batch, rng):
    """The append step on Mosaic GPU, jitted alone with its state donated and compiled: its entry computation
    is the prelude launch and the readout and nothing else (no copy, fusion or memcpy); in a decode loop
    (`lax.scan` of 2 L steps) no step copies the checkpoint, the records or the cursor, which the prelude
    moves at batch 5 and the readout at batch 8 (`readout_moves_cursor`)."""
    layer = _layer(rng, SHAPE.with_batch(batch))
    rs = layer.replay_state(L, f32, bf16, np.zeros(batch, np.int32))
    config = kernels.TMAReadoutConfig()

    def step(rs, inp):
        return layer.kernel_replay_step(rs, inp, "append", config)

    assert_step_alone_and_in_a_loop(step, rs, [layer.draw() for _ in range(2 * L)], jax.tree.leaves(rs))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [SHAPE.batch, 8], ids=["prelude-moves-cursor", "readout-moves-cursor"])
def test_compiled_deferred_step_is_its_two_kernels(batch, rng):
    """The deferred step on Mosaic GPU: the prelude and the readout (which flushes) and nothing else, and
    no copy of the state in a decode loop (`kernel_checks.check_deferred_step_kernels`), the cursor moved
    by the prelude (batch 5) or the readout (batch 8)."""
    check_deferred_step_kernels(_layer(rng, SHAPE.with_batch(batch)), L, triton_launches=1)
