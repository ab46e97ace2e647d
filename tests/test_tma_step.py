"""The Gated DeltaNet direct route on Mosaic GPU (replayssm_jax.kernels.tma_step).

On the CPU: the prelude's direct terms put through the kernel's formula in
jnp against the reference's direct step, the Triton prelude launch (route
"direct", interpreted) against its pure-JAX form, the limits and the
default, and the step lowered for CUDA (two custom calls, the checkpoint
and the cursor in place). On a GPU (`pytest -m gpu`): the compiled step
against the reference from staggered cursors with inf and NaN in the dead slots and
a full row, and the lockstep cycle's carry in a decode loop uncopied.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from hlo_checks import assert_step_alone_and_in_a_loop, carry_copies, per_step_copies, work_besides_kernels
from kernel_checks import GDN, GDNShape, lower_for_cuda
from test_tma_readout import _abstract, _Device, _state  # GDN replay states, abstract and drawn; a device
from replayssm_jax import kernels, reference
from replayssm_jax.kernels import gdn as gdn_kernels
from replayssm_jax.kernels import tma_step
from replayssm_jax.testing import tolerance_dtype

f32, bf16 = jnp.float32, jnp.bfloat16
L = 8
SHAPE = GDNShape(batch=5, H=2, HV=4, K=64, V=128)
MODEL = GDNShape(batch=256, H=16, HV=32, K=128, V=128)  # Qwen3.5-4B's layer


def _reference(rs, inp, scale):
    return jax.jit(lambda s, i: reference.gdn_replay_step(s, **i, scale=scale, use_qk_l2norm=True,
                                                          route="direct"))(rs, inp)


def _cursors(batch, buffer_len=L):
    """Staggered cursors 0 .. L with a full row (a speculative commit's) and an empty one."""
    cursor = (np.arange(batch) * 3 % (buffer_len + 1)).astype(np.int32)
    cursor[0], cursor[-1] = 0, buffer_len
    return cursor


# ---------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("buffer_dtype", [f32, bf16])
def test_direct_terms_give_the_reference_direct_step(buffer_dtype, rng):
    """The direct terms, put through the kernel's formula in jnp (the fold as a rank-L product, then the
    step), give the reference's direct step: outputs and checkpoint within the f32 tolerance."""
    layer = GDN(SHAPE, rng, f32)
    cursor = _cursors(SHAPE.batch)
    rs, inp = _state(layer, f32, buffer_dtype, cursor), layer.draw()
    scale = SHAPE.K ** -0.5
    o_ref, rs_ref = _reference(rs, inp, scale)
    qn, kn, terms = tma_step.direct_terms(rs, inp["q"], inp["k"], inp["g"], inp["beta"], scale=scale,
                                          use_qk_l2norm=True)
    group = SHAPE.HV // SHAPE.H
    live = (np.arange(L) < cursor[:, None])[:, None, :, None]
    U = jnp.where(live, rs.d.astype(f32), 0.0) * terms[:, :, 0, :, None]
    keys = jnp.repeat(jnp.where(live, rs.k.astype(f32), 0.0), group, 1)
    S = terms[:, :, 2, 0, None, None] * rs.checkpoint + jnp.einsum("bhlv,bhlk->bhvk", U, keys, precision="highest")
    kx, qx = jnp.repeat(kn, group, 1), jnp.repeat(qn, group, 1)
    decay, beta = terms[:, :, 2, 2, None], terms[:, :, 2, 3, None]
    d = beta * (inp["v"] - decay * jnp.einsum("bhvk,bhk->bhv", S, kx, precision="highest"))
    S = decay[..., None] * S + d[..., None] * kx[:, :, None, :]
    assert_close(jnp.einsum("bhvk,bhk->bhv", S, qx, precision="highest"), o_ref, f32, what="outputs")
    assert_close(S, rs_ref.checkpoint, f32, what="checkpoint")
    assert np.isfinite(np.asarray(terms)).all()


@pytest.mark.parametrize(("shape", "buffer_len", "buffer_dtype"), [
    (SHAPE, L, bf16),
    (GDNShape(batch=4, H=2, HV=6, K=96, V=64), 24, f32),
], ids=["bf16-records", "group3-K96-L24"])
def test_direct_prelude_matches_its_pure_jax_form(shape, buffer_len, buffer_dtype, rng):
    """The Triton prelude launch on route "direct" (interpreted) against `direct_terms`: q, k and the terms
    within the f32 tolerance, the dead slots' k records zeroed in the rows with live records and no other
    record written (`clear_dead_keys`; inf kept in an empty row's dead slots), the cursor at entry in the
    kernel's layout and 0 after the step."""
    layer = GDN(shape, rng, f32)
    cursor = _cursors(shape.batch, buffer_len)
    rs, inp = _state(layer, f32, buffer_dtype, cursor, buffer_len), layer.draw()
    want = tma_step.direct_terms(rs, inp["q"], inp["k"], inp["g"], inp["beta"], scale=0.3, use_qk_l2norm=True)
    qn, kn, terms, entry, shared, cursor_next = gdn_kernels._head_terms(
        gdn_kernels.Records(rs.d, rs.k, rs.g), rs.cursor, gdn_kernels._f32_decay(gdn_kernels.Inputs(**inp)),
        scale=0.3, use_qk_l2norm=True, interpret=True, route="direct")
    for name, a, b in zip(("qn", "kn", "terms"), (qn, kn, terms), want):
        assert_close(a, b, f32, what=f"the prelude's {name}")
    np.testing.assert_array_equal(np.asarray(shared.k, np.float32),
                                  np.asarray(tma_step.clear_dead_keys(rs).k, np.float32))
    np.testing.assert_array_equal(np.asarray(shared.g), np.asarray(rs.g))
    np.testing.assert_array_equal(np.asarray(entry)[:shape.batch], cursor)
    np.testing.assert_array_equal(np.asarray(cursor_next), 0)


def test_limits():
    """The direct step's own limit (its shared memory: the tile in and out, per stage; f32 records take 2
    stages) and the readout's limits, raised before any launch."""
    state, v = _abstract(256)
    with pytest.raises(ValueError, match=r"4 stages of 64 rows need \d+ bytes of shared memory"):
        tma_step.check_direct_tma(state, v, kernels.TMAReadoutConfig(stages=4, programs_per_sm=1),
                                  interpret=False, slots=None)
    with pytest.raises(NotImplementedError, match="compiled on a GPU only"):
        tma_step.check_direct_tma(state, v, tma_step.STEP_CONFIG, interpret=True, slots=None)
    tma_step.check_direct_tma(state, v, tma_step.STEP_CONFIG, interpret=False, slots=None)
    f32_records = _abstract(256, d=f32)
    with pytest.raises(ValueError, match="3 stages of 64 rows need"):
        tma_step.check_direct_tma(*f32_records, tma_step.STEP_CONFIG, interpret=False, slots=None)
    tma_step.check_direct_tma(*f32_records, kernels.TMAReadoutConfig(stages=2, programs_per_sm=1), interpret=False,
                              slots=None)


@pytest.mark.parametrize(("device", "case", "kw", "takes"), [
    (_Device(), dict(batch=256), {}, True),
    (_Device(), dict(batch=64), {}, True),
    (_Device(), dict(batch=64, checkpoint=bf16), {}, False),
    (_Device(), dict(batch=256, L=32, checkpoint=bf16), {}, False),
    (_Device(), dict(batch=256, L=32), {}, False),
    (_Device(), dict(batch=256, K=96), {}, False),
    (_Device(), dict(batch=63), {}, False),
    (_Device(), dict(batch=256, L=8), {}, False),
    (_Device(), dict(batch=256, d=f32), {}, False),
    (_Device(), dict(batch=256, checkpoint=jnp.int8), {}, False),
    (_Device(), dict(batch=256), dict(interpret=True), False),
    (_Device(), dict(batch=256), dict(slots=jnp.arange(256)), False),
    (_Device(compute_capability="8.0"), dict(batch=256), {}, False),
    (_Device(platform="cpu"), dict(batch=256), {}, False),
    (_Device(), dict(batch=256, V=320), {}, False),
    (_Device(), dict(batch=256, K=256), {}, False),
], ids=["b256", "b64", "bf16-b64", "bf16-L32", "f32-L32-smem", "K96", "b63", "L8", "f32-records", "int8",
       "interpret", "pool", "sm80", "cpu", "V320", "K256-smem"])
def test_default_tiling_of_the_direct_route(device, case, kw, takes, monkeypatch):
    """The direct route takes the Mosaic GPU step by default only where its fold runs on the tensor cores
    in the tile's buffer (an f32 checkpoint, bf16 keys, L a multiple of 16; not a bf16 checkpoint, which
    folds in registers) with K a multiple of 64 (not 96) and, as the append route, for a checkpoint of
    batch >= 64, compiled, on a Hopper-class GPU, where the step's limits take it with one program an SM
    (K = 256, or L = 32: 3 stages above an SM's shared memory), with V within the Triton kernels' bound."""
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    state, v = _abstract(**case)
    config = tma_step.default_direct_tma(state, v, interpret=kw.get("interpret", False), slots=kw.get("slots"))
    assert config == (tma_step.STEP_CONFIG if takes else None)


def _kernel_jaxprs(jaxpr):
    """The text of every Mosaic GPU kernel body in `jaxpr` (its `mpmd_map` equations), nested calls included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "mpmd_map":
            found += [str(body) for body in eqn.params["jaxprs"]]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                found += _kernel_jaxprs(inner)
    return found


@pytest.mark.parametrize(("checkpoint_dtype", "wgmma"), [(f32, True), (bf16, False)])
def test_the_fold_runs_on_the_tensor_cores_for_an_f32_tile_only(checkpoint_dtype, wgmma):
    """With bf16 keys and L = 16 the direct step's fold runs on the tensor cores (WGMMAs in its kernel) for
    an f32 checkpoint, whose tile the fold stores in its shared-memory buffer exactly; a bf16 tile, which
    that store would round before the step, folds in registers (`tma_step.folds_in_place`)."""
    state, v = _abstract(64, checkpoint=checkpoint_dtype)
    batch, H, K, HV = 64, 16, 128, 32
    head, heads = jax.ShapeDtypeStruct((batch, H, K), bf16), (batch, HV)
    inputs = gdn_kernels.Inputs(q=head, k=head, v=v, g=jax.ShapeDtypeStruct(heads, f32),
                                beta=jax.ShapeDtypeStruct(heads, bf16))
    jaxpr = jax.make_jaxpr(lambda s, i: gdn_kernels._direct_tma(s, i, scale=0.1, use_qk_l2norm=True,
                                                                 config=tma_step.STEP_CONFIG))(state, inputs)
    kernels_text = _kernel_jaxprs(jaxpr.jaxpr)
    assert len(kernels_text) == 1, len(kernels_text)
    assert ("wgmma" in kernels_text[0]) == wgmma
    assert tma_step.folds_in_place(checkpoint_dtype) == wgmma


def test_step_lowers_for_cuda(rng):
    """The direct step's whole lowering on the CPU at the model's shape (abstract inputs): the prelude (its
    records and cursor aliased) and the Mosaic GPU step (the checkpoint aliased), nothing else."""
    layer = GDN(MODEL, rng, bf16)
    state, _ = _abstract(MODEL.batch)
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "direct", tma_step.STEP_CONFIG),
                          state, jax.eval_shape(layer.draw))
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", text)
    assert sorted(calls) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"], calls
    aliases = {name: sorted(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", found))
               for name, found in re.findall(r"custom_call @([\w$.]+)\([^\n]*?output_operand_aliases = \[(.*?)\]\}",
                                             text)}
    assert aliases == {"__gpu$xla.gpu.triton": [("4", "0"), ("5", "1"), ("6", "2")],
                       "mosaic_gpu_v2": [("1", "0")]}, aliases
    with pytest.raises(TypeError, match=r"'append', 'deferred', 'direct' routes only; got route 'output'"):
        layer.kernel_replay_step(state, jax.eval_shape(layer.draw), "output", tma_step.STEP_CONFIG)


def test_standard_prelude_matches_its_pure_jax_form_and_the_reference(rng):
    """The standard step's prelude (interpreted) against `step_terms`, and those terms through the kernel's
    formula in jnp against the reference's standard step (key group of 3, K = 96)."""
    shape = GDNShape(batch=4, H=2, HV=6, K=96, V=64)
    layer = GDN(shape, rng, f32)
    state, inp = layer.state(), layer.draw()
    want = tma_step.step_terms(inp["q"], inp["k"], inp["g"], inp["beta"], scale=0.3, use_qk_l2norm=True)
    got = gdn_kernels._step_terms(gdn_kernels._f32_decay(gdn_kernels.Inputs(**inp)), scale=0.3, use_qk_l2norm=True,
                                  interpret=True)
    for name, a, b in zip(("qn", "kn", "terms"), got, want):
        assert_close(a, b, f32, what=f"the prelude's {name}")
    qn, kn, terms = want
    kx, qx = (jnp.repeat(x, 3, 1) for x in (kn, qn))
    decay, beta = terms[:, :, 2, 2, None], terms[:, :, 2, 3, None]
    d = beta * (inp["v"] - decay * jnp.einsum("bhvk,bhk->bhv", state, kx, precision="highest"))
    S = decay[..., None] * state + d[..., None] * kx[:, :, None, :]
    o_ref, S_ref = reference.gdn_step(state, **inp, scale=0.3)
    assert_close(jnp.einsum("bhvk,bhk->bhv", S, qx, precision="highest"), o_ref, f32, what="outputs")
    assert_close(S, S_ref, f32, what="state")


def test_standard_step_lowers_for_cuda_and_its_limits(rng):
    """The standard step on Mosaic GPU lowered for CUDA at the model's shape: the prelude and the kernel
    (the state aliased in place), nothing else; its limits raised before a launch."""
    layer = GDN(MODEL, rng, bf16)
    state = jax.ShapeDtypeStruct((MODEL.batch, MODEL.HV, MODEL.V, MODEL.K), f32)
    inp = jax.eval_shape(layer.draw)
    text = lower_for_cuda(lambda s, i: kernels.gdn_step(s, **i, scale=0.1, use_qk_l2norm=True,
                                                        config=tma_step.STEP_CONFIG), state, inp)
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", text)
    assert sorted(calls) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"], calls
    assert re.search(r"@mosaic_gpu_v2\([^\n]*output_operand_aliases = \[#stablehlo\.output_operand_alias<"
                     r"output_tuple_indices = \[1\], operand_index = 0", text), "the state is not aliased"
    v = jax.ShapeDtypeStruct((MODEL.batch, MODEL.HV, MODEL.V), bf16)
    with pytest.raises(ValueError, match=r"V \(value dim\) a multiple of `config.block_v` = 128; got V = 64"):
        tma_step.check_step_tma(jax.ShapeDtypeStruct((4, 4, 64, 128), f32), v, kernels.TMAReadoutConfig(block_v=128),
                                interpret=False, slots=None)
    with pytest.raises(ValueError, match="f32 or bf16 state; got float16"):
        tma_step.check_step_tma(jax.ShapeDtypeStruct((4, 4, 64, 128), jnp.float16), v, tma_step.STEP_CONFIG,
                                interpret=False, slots=None)
    with pytest.raises(NotImplementedError, match="no state pool"):
        tma_step.check_step_tma(state, v, tma_step.STEP_CONFIG, interpret=False, slots=jnp.arange(4))


# ---------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape", "buffer_len"), [
    (f32, bf16, bf16, tma_step.STEP_CONFIG, SHAPE, L),
    (f32, f32, f32, kernels.TMAReadoutConfig(block_v=128, stages=1, programs_per_sm=1), SHAPE, L),
    (bf16, bf16, bf16, tma_step.STEP_CONFIG, SHAPE, L),
    (f32, bf16, bf16, tma_step.STEP_CONFIG, GDNShape(batch=67, H=16, HV=32, K=128, V=128), L),
    (f32, bf16, bf16, tma_step.STEP_CONFIG, GDNShape(batch=7, H=2, HV=6, K=96, V=64), L),
    (f32, bf16, bf16, tma_step.STEP_CONFIG, GDNShape(batch=300, H=2, HV=4, K=128, V=128), L),
    # the fold on the tensor cores (an f32 tile, bf16 keys, L a multiple of 16: `tma_step.folds_in_place`,
    # `tma_readout.keys_on_tensor_cores`)
    (f32, bf16, bf16, tma_step.STEP_CONFIG, SHAPE, 16),
    (bf16, bf16, bf16, tma_step.STEP_CONFIG, SHAPE, 32),  # a bf16 tile: the fold in registers
    (f32, bf16, bf16, kernels.TMAReadoutConfig(stages=2, programs_per_sm=1), GDNShape(batch=67, H=16, HV=32, K=128,
                                                                                      V=128), 16),
    (f32, bf16, bf16, tma_step.STEP_CONFIG, GDNShape(batch=300, H=2, HV=4, K=128, V=128), 16),
], ids=["f32-bf16", "f32-f32-f32act-128x1", "bf16", "model-b67", "group3-K96", "b300", "L16-wgmma", "bf16-L32",
        "model-b67-L16-st2-wgmma", "b300-L16-wgmma"])
def test_compiled_direct_step_matches_the_reference(checkpoint_dtype, buffer_dtype, act, config, shape, buffer_len,
                                                    rng):
    """From staggered cursors (an empty row, a full one) with inf and NaN in the dead slots: outputs and checkpoint
    within the tolerance of the case's dtypes, the records untouched but the dead keys of rows with live
    records (zeroed: `clear_dead_keys`), the cursor 0."""
    layer = GDN(shape, rng, act)
    cursor = _cursors(shape.batch, buffer_len)
    rs, inp = _state(layer, checkpoint_dtype, buffer_dtype, cursor, buffer_len), layer.draw()
    o_ref, rs_ref = _reference(rs, inp, shape.K ** -0.5)
    o, new = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "direct", config))(rs, inp)
    tol = tolerance_dtype(act, checkpoint_dtype, buffer_dtype)
    assert_close(o, o_ref, tol, what="outputs")
    assert_close(new.checkpoint, rs_ref.checkpoint, tol, what="checkpoint")
    want = tma_step.clear_dead_keys(rs)
    for name in ("d", "k", "g"):
        np.testing.assert_array_equal(np.asarray(getattr(new, name), np.float32),
                                      np.asarray(getattr(want, name), np.float32), err_msg=f"{name} records")
    np.testing.assert_array_equal(np.asarray(new.cursor), 0)


@pytest.mark.gpu
def test_default_direct_route_at_batch_64(rng):
    """config=None on the direct route at batch 64 with an f32 checkpoint and bf16 records, L = 16: the
    Mosaic GPU step on a Hopper-class GPU (`default_direct_tma`; the Triton kernel elsewhere), from
    staggered cursors with inf and NaN in the dead slots, within the tolerance of the reference."""
    shape = GDNShape(batch=64, H=4, HV=8, K=128, V=128)
    layer = GDN(shape, rng, bf16)
    rs, inp = _state(layer, f32, bf16, _cursors(shape.batch, 16), 16), layer.draw()
    step = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "direct", None))
    calls = re.findall(r"custom_call @(\w+)\(", step.trace(rs, inp).lower().as_text())
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
    assert ("mosaic_gpu_v2" in calls) == hopper, calls
    o, new = step(rs, inp)
    o_ref, rs_ref = _reference(rs, inp, shape.K ** -0.5)
    tol = tolerance_dtype(bf16, f32, bf16)
    assert_close(o, o_ref, tol, what="outputs")
    assert_close(new.checkpoint, rs_ref.checkpoint, tol, what="checkpoint")
    np.testing.assert_array_equal(np.asarray(new.cursor), 0)


@pytest.mark.gpu
def test_compiled_lockstep_cycle_is_its_kernels(rng):
    """The direct step on Mosaic GPU jitted alone with its state donated: its two kernels and nothing else;
    a decode loop of lockstep cycles (L - 1 append steps, one direct step, on Mosaic GPU) copies no
    checkpoint, record or cursor per step."""
    layer = GDN(SHAPE, rng, bf16)
    rs = layer.replay_state(L, f32, bf16, np.zeros(SHAPE.batch, np.int32))

    def direct(rs, inp):
        return layer.kernel_replay_step(rs, inp, "direct", tma_step.STEP_CONFIG)

    hlo = jax.jit(direct, donate_argnums=0).lower(rs, layer.draw()).compile().as_text()
    found = work_besides_kernels(hlo)
    assert not found, "work besides the kernels:\n" + "\n".join(found)

    def cycle(rs, xs):
        for t in range(L):
            route, config = ("direct", tma_step.STEP_CONFIG) if t == L - 1 else ("append", kernels.TMAReadoutConfig())
            _, rs = layer.kernel_replay_step(rs, jax.tree.map(lambda a: a[t], xs), route, config)
        return rs, None

    cycles = [jax.tree.map(lambda *a: jnp.stack(a), *[layer.draw() for _ in range(L)]) for _ in range(2)]
    xs = jax.tree.map(lambda *a: jnp.stack(a), *cycles)  # [2 cycles, L steps, ...]
    loop = jax.jit(lambda rs, xs: jax.lax.scan(cycle, rs, xs)[0], donate_argnums=0)
    hlo = loop.lower(rs, xs).compile().as_text()
    copies = per_step_copies(hlo, [rs.checkpoint, rs.d, rs.k, rs.g, rs.cursor]) + carry_copies(hlo)
    assert not copies, "per-step copies of the state:\n" + "\n".join(copies)


@pytest.mark.gpu
@pytest.mark.parametrize(("state_dtype", "act", "config", "shape"), [
    (f32, bf16, tma_step.STEP_CONFIG, SHAPE),
    (f32, f32, kernels.TMAReadoutConfig(block_v=128, stages=2, programs_per_sm=1), SHAPE),
    (bf16, bf16, tma_step.STEP_CONFIG, GDNShape(batch=67, H=16, HV=32, K=128, V=128)),
    (f32, bf16, tma_step.STEP_CONFIG, GDNShape(batch=7, H=2, HV=6, K=96, V=64)),
    (f32, bf16, tma_step.STEP_CONFIG, GDNShape(batch=300, H=2, HV=4, K=128, V=128)),
], ids=["f32", "f32-f32act-128x2", "bf16-b67", "group3-K96", "b300"])
def test_compiled_standard_step_matches_the_reference(state_dtype, act, config, shape, rng):
    """Two compiled standard steps on Mosaic GPU against the reference (batch 67 and 300: items that do not
    divide among the programs): outputs and state within the tolerance."""
    layer = GDN(shape, rng, act)
    state = layer.state().astype(state_dtype)
    step = jax.jit(lambda s, i: kernels.gdn_step(s, **i, scale=shape.K ** -0.5, use_qk_l2norm=True, config=config))
    s_k, s_r = state, state
    for _ in range(2):
        inp = layer.draw()
        o, s_k = step(s_k, inp)
        o_ref, s_r = reference.gdn_step(s_r, **inp)
        tol = tolerance_dtype(act, state_dtype)
        assert_close(o, o_ref, tol, what="outputs")
        assert_close(s_k, s_r, tol, what="state")


@pytest.mark.gpu
def test_compiled_standard_step_is_its_two_kernels(rng):
    """The standard step on Mosaic GPU jitted alone with its state donated is its two kernels, and a decode
    loop (`lax.scan` of 4 steps, the state carried and donated) copies no state per step."""
    layer = GDN(SHAPE, rng, bf16)

    def step(s, inp):
        return kernels.gdn_step(s, **inp, scale=0.1, use_qk_l2norm=True, config=tma_step.STEP_CONFIG)

    state = layer.state()
    assert_step_alone_and_in_a_loop(step, state, [layer.draw() for _ in range(4)], [state])
