"""The decode step updates its state in place: no per-step copy of any leaf
of the decode loop's carry in the compiled HLO.

Each layer test jits a `lax.scan` of 32 decode steps with the carry donated,
compiles it (`jax.jit(f, donate_argnums=0).lower(...).compile().as_text()`)
and looks, in every computation reachable from a while-loop body, for a
`copy` / `copy-start` whose result has the shape and dtype of a protected
array (`hlo_checks.per_step_copies`), and in the loop body for a copy of any
element of the loop's state (`hlo_checks.carry_copies`: checkpoint, buffers
and cursor, or the standard state). The model tests check the decode loop
that `Generator` compiles (`Generator.decode_hlo`) the same way: every SSM
layer's checkpoint, buffers, cursor, conv window columns and start, the KV
cache and the token position. `test_detector_finds_a_copy` checks that both
detectors find the copy forced by a variant that keeps the previous state
alive.

On the CPU: the "xla" backend (the reference) and, for the models, the
"interpret" backend, where the Pallas interpreter runs each kernel's grid as
a loop that holds an aliased operand and its output as two elements of its
state: the kernels' operands are copied into that loop and back by design
(left out with `carry_copies(..., staged=False)`), every other leaf must
stay in place. The Pallas kernels' aliasing is checked structurally (the
lowered custom calls alias the checkpoint and every buffer, input to
output); the compiled check of the kernels needs a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hlo_checks import carry_copies, merged_weights, per_step_copies, slice_launches, work_besides_kernels
from kernel_checks import GDN, GDNShape, Mamba2, Mamba2Shape, lower_for_cuda, replay_config
from models import load_model
from replayssm_jax import compilation
from replayssm_jax.generation import Generator, SpeculativeConfig
from replayssm_jax.layers import GatedDeltaNet, Mamba2Mixer

STEPS = 32
L = 4
DATA = pathlib.Path(__file__).parent / "data"

# The Pallas Triton backend warns that it is deprecated when a kernel is lowered.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _layers(rng):
    return {
        "gdn": GDN(GDNShape(batch=2, H=2, HV=4, K=16, V=32), rng),
        "mamba2": Mamba2(Mamba2Shape(batch=2, H=4, P=32, N=16, G=2), rng),
    }


def _stack(layer, n):
    return jax.tree.map(lambda *a: jnp.stack(a), *[layer.draw() for _ in range(n)])


# ---------------------------------------------------------------------------
# HLO of a compiled decode loop (inspected by hlo_checks.per_step_copies)


def compiled_scan(step, carry, xs):
    def f(carry, xs):
        return jax.lax.scan(lambda c, inp: step(c, inp)[::-1], carry, xs)

    return jax.jit(f, donate_argnums=0).lower(carry, xs).compile().as_text()


def standard_step(layer, backend):
    return lambda state, inp: layer.step(state, inp, backend)


def replay_step(layer, backend, route="output", config=None):
    return lambda rs, inp: layer.replay_step(rs, inp, route, backend, config)


def _replay_arrays(rs):
    return [a for a in jax.tree.leaves(rs) if a.ndim >= 2]


def _check_no_copy(hlo, protected):
    found = per_step_copies(hlo, protected)
    assert not found, "per-step copies of the state:\n" + "\n".join(found)


def _check_carry_in_place(hlo, staged=True):
    found = carry_copies(hlo, staged)
    assert not found, "per-step copies of the loop's state:\n" + "\n".join(found)


# ---------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_detector_finds_a_copy(name, rng):
    layer = _layers(rng)[name]
    state = layer.state(jnp.float32)

    def keeps_previous(carry, inp):
        state, _ = carry
        y, new = layer.step(state, inp, "xla")
        return y, (new, state)  # the previous state stays alive: XLA must copy

    hlo = compiled_scan(keeps_previous, (state, state), _stack(layer, STEPS))
    assert per_step_copies(hlo, [state]), "the detector missed a forced copy"
    assert carry_copies(hlo), "carry_copies missed a forced copy"


def test_work_detector_finds_work():
    """`work_besides_kernels` passes plumbing (a donated argument reshaped: a bitcast) and
    finds any computation (here a multiply, compiled on the CPU) or copy (a returned argument not donated)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 6)), jnp.float32)
    plumbing = jax.jit(lambda x: x.reshape(6, 4), donate_argnums=0).lower(x).compile().as_text()
    assert work_besides_kernels(plumbing) == []
    for fn in (lambda x: x * 2.0, lambda x: x):
        work = jax.jit(fn).lower(x).compile().as_text()
        assert work_besides_kernels(work), work


def test_slice_detector_finds_a_slice_launch():
    """`slice_launches` finds a slice that runs as its own launch, not one that a fusion takes in."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 16)), jnp.float32)
    hlo = jax.jit(lambda x: (x[:, 2:5], jnp.sin(x)[:, 1:3], x[:, 4:12] * 2.0)).lower(x).compile().as_text()
    found = slice_launches(hlo)
    assert len(found) == 1 and "f32[4,3]" in found[0], found
    assert slice_launches(jax.jit(lambda x: jnp.sin(x)[:, 1:3]).lower(x).compile().as_text()) == []


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_xla_standard_step_in_place(name, rng):
    layer = _layers(rng)[name]
    state = layer.state(jnp.float32)
    hlo = compiled_scan(standard_step(layer, "xla"), state, _stack(layer, STEPS))
    _check_no_copy(hlo, [state])
    _check_carry_in_place(hlo)


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize("route", ["output", "state"])
def test_xla_replay_step_in_place(name, route, rng):
    """No per-step copy of the checkpoint, of any buffer or of the cursor."""
    layer = _layers(rng)[name]
    rs = layer.replay_state(L, jnp.float32, jnp.float32, np.array([0, L - 1]))
    hlo = compiled_scan(replay_step(layer, "xla", route), rs, _stack(layer, STEPS))
    _check_no_copy(hlo, [rs.checkpoint])
    _check_carry_in_place(hlo)


def _per_row_scalars(found):
    """`carry_copies` lines that copy more than one value per batch row (an i32[batch] or a scalar left out)."""
    return [line for line in found if not re.search(r"= \w+\[\d*\]\{?0?\}? copy", line)]


@pytest.mark.parametrize("backend", ["xla", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("state", ["standard", "replay"])
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "mamba2_tiny"])
def test_decode_loop_carry_in_place(name, state, backend):
    """Generator's compiled decode loop, one step an iteration (the replay
    state with lockstep off), copies no leaf of its carry (with "interpret":
    none but the kernels' operands, which the Pallas interpreter stages
    through its own loop; "pallas", on a GPU: none)."""
    replay = dict(buffer_len=L, route="output", lockstep=False) if state == "replay" else {}
    gen = Generator(load_model(DATA / name), state=state, backend=backend, block_size=4, **replay)
    gen.generate(np.load(DATA / name / "reference.npz")["prompt_ids"][:2], 5)  # one block of 4 steps
    (hlo,) = gen.decode_hlo()
    _check_carry_in_place(hlo, staged=backend != "interpret")


@pytest.mark.parametrize("backend", ["xla", "interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "mamba2_tiny"])
def test_lockstep_loop_carry_in_place(name, backend):
    """Generator's lockstep loop (a cycle of L steps an iteration: a loop of
    L - 1 buffered steps, then the direct step) copies none of the
    checkpoints, buffers, conv windows or KV caches of its carry; per-row
    scalars (cursors, the conv windows' starts, i32[batch]) may be copied
    once a cycle, into and out of the inner loop. Two cycles, so that the
    cycle's loop stays a loop."""
    gen = Generator(load_model(DATA / name), state="replay", backend=backend, block_size=2 * L, buffer_len=L,
                    route="output", lockstep=True)
    gen.generate(np.load(DATA / name / "reference.npz")["prompt_ids"][:2], 2 * L + 1)
    (hlo,) = gen.decode_hlo()
    assert hlo.count(" while(") >= 2, "the cycle's loop and its buffered steps' loop"
    found = _per_row_scalars(carry_copies(hlo, staged=backend != "interpret"))
    assert not found, "per-cycle copies of the lockstep loop's states:\n" + "\n".join(found)


@pytest.mark.parametrize("state, backend", [("standard", "xla"), ("replay", "xla"),
                                            pytest.param("replay", "pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "mamba2_tiny"])
def test_speculative_loop_carry_in_place(name, state, backend):
    """The compiled block of speculative rounds (verify, accept, commit) copies
    none of the states, buffers, conv windows or KV caches in its carry: no
    copy of a carry element with more than one value per row. (Per-row
    scalars, e.g. the cursors and the conv windows' starts, i32[batch], may be
    copied.) Not checked: the standard state's per-draft path on the kernels,
    which copies its SSM state once a round by design (its first step kernel
    updates the state in place, and the state before the window must survive
    for a row that accepts nothing; the GPU run of 2026-12-01 showed that copy)."""
    replay = dict(buffer_len=L + 4, route="output") if state == "replay" else {}
    gen = Generator(load_model(DATA / name), state=state, backend=backend, block_size=4,
                    speculative=SpeculativeConfig("ngram", 3), **replay)
    gen.generate(np.load(DATA / name / "reference.npz")["prompt_ids"][:2], 8)
    (hlo,) = gen.decode_hlo()
    found = [line for line in carry_copies(hlo) if not re.search(r"= \w+\[\d+\]\{0\} copy", line)]
    assert not found, "per-round copies of the speculative loop's states:\n" + "\n".join(found)


def _custom_calls(rs, layer, config, route="output"):
    """The replay step's Triton custom calls, lowered for CUDA (see kernel_checks.lower_for_cuda)."""
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, route, config), rs, layer.draw())
    return [line for line in text.splitlines() if "custom_call" in line and "triton" in line]


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize("mode", ["flush-launch", "fused-flush", "append"])
def test_kernel_aliases_checkpoint_and_buffers(name, mode, rng):
    """The replay step's launches alias checkpoint, buffers and cursor: one launch with the flush fused; one
    on the append route (no flush), whose cursor XLA moves; else the replay kernel and the flush launch."""
    layer = _layers(rng)[name]
    rs = layer.replay_state(L, jnp.float32, jnp.float32, np.array([0, L - 1]))
    fused = mode == "fused-flush"
    calls = _custom_calls(rs, layer, replay_config(layer, L, jnp.float32, fused_flush=fused),
                          "append" if mode == "append" else "output")
    one_launch = mode != "flush-launch"
    assert len(calls) == (1 if one_launch else 2), calls
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    # replay: outputs 1..4 (checkpoint, the three buffers) alias operands 0..3; output 5, the new cursor, aliases
    # operand 4 in one launch, and is a fresh array (the cursors at entry) when a flush launch follows
    expected = [(1, 0), (2, 1), (3, 2), (4, 3)] + ([(5, 4)] if fused else [])
    assert sorted((int(o), int(i)) for o, i in aliases) == expected, calls[0][:2000]
    if not one_launch:
        # the flush launch: the checkpoint (output 0) aliases operand 0, the cursor moved in place (output 1)
        # its last operand
        flush = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[1])
        last = re.search(r"custom_call @\S+\(([^)]*)\)", calls[1]).group(1).count(",")
        assert sorted((int(o), int(i)) for o, i in flush) == [(0, 0), (1, last)], calls[1][:2000]


# ---------------------------------------------------------------------------
# GPU: the compiled kernels


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_standard_step_in_place(name, state_dtype, rng):
    layer = _layers(rng)[name]
    state = layer.state(state_dtype)
    _check_no_copy(compiled_scan(standard_step(layer, "pallas"), state, _stack(layer, STEPS)), [state])


@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_direct_route_aliases_checkpoint_and_cursor(name, rng):
    layer = _layers(rng)[name]
    rs = layer.replay_state(L, jnp.float32, jnp.float32, np.array([0, L - 1]))
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "direct"), rs, layer.draw())
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1, calls
    # outputs: y, the checkpoint (operand 0), the cursor (the last operand, after the three buffers)
    last = re.search(r"custom_call @\S+\(([^)]*)\)", calls[0]).group(1).count(",")
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert sorted((int(o), int(i)) for o, i in aliases) == [(1, 0), (2, last)], calls[0][:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize(("route", "fused"), [("output", False), ("state", False), ("output", True), ("state", True),
                                              ("direct", None)])
def test_pallas_replay_step_in_place(name, route, fused, rng):
    """No per-step copy of the checkpoint, the buffers or the cursor, in one launch (fused, direct) or two."""
    layer = _layers(rng)[name]
    rs = layer.replay_state(L, jnp.float32, jnp.bfloat16, np.array([0, L - 1]))
    config = None if route == "direct" else replay_config(layer, L, jnp.float32, fused_flush=fused)
    hlo = compiled_scan(replay_step(layer, "pallas", route, config), rs, _stack(layer, STEPS))
    _check_no_copy(hlo, _replay_arrays(rs) + [rs.cursor])
    _check_carry_in_place(hlo)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
@pytest.mark.parametrize("step", ["standard", "output", "output-fused", "direct"])
def test_pallas_step_is_its_kernels(name, step, rng):
    """One step of a layer's op on backend "pallas" (the standard step; the replay step on the output route
    with a flush launch or the fused flush, and on the direct route), jitted alone with its state donated
    and compiled: its entry computation launches the Triton kernels and nothing else, no copy of the state,
    buffers or cursor and no XLA op between the kernels (`hlo_checks.work_besides_kernels`)."""
    layer = _layers(rng)[name]
    if step == "standard":
        carry, fn = layer.state(jnp.float32), standard_step(layer, "pallas")
    else:
        route, _, fused = step.partition("-")
        carry = layer.replay_state(L, jnp.float32, jnp.bfloat16, np.array([0, L - 1]))
        config = None if route == "direct" else replay_config(layer, L, jnp.float32, fused_flush=bool(fused))
        fn = replay_step(layer, "pallas", route, config)
    hlo = jax.jit(fn, donate_argnums=0).lower(carry, layer.draw()).compile().as_text()
    found = work_besides_kernels(hlo)
    assert not found, "work besides the kernels:\n" + "\n".join(found)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_compiled_decode_step_cuts_no_operand_of_its_kernels(name, rng):
    """A layer's decode step on "pallas" (bf16 weights and activations, the state donated), compiled: no
    slice of its projections runs as a launch of its own (Mamba-2's conv kernel reads xBC inside in_proj's
    output and writes x, B and C apart, its SSM kernels read dt there; GDN's conv writes q, k and v apart)."""
    rngs = nnx.Rngs(int(rng.integers(1 << 30)))
    layer = (Mamba2Mixer(256, num_heads=8, head_dim=64, state_size=128, n_groups=2, param_dtype=jnp.bfloat16,
                         rngs=rngs) if name == "mamba2" else
             GatedDeltaNet(256, num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128, packed=False,
                           param_dtype=jnp.bfloat16, rngs=rngs))
    u = jnp.asarray(rng.standard_normal((64, 2, 256)), jnp.bfloat16)
    _, state = layer.prefill(u[:, :1])
    # compiled as the models' programs are (replayssm_jax.compilation: XLA's dot merger off, which would
    # merge the projections that read u into one GEMM and slice its output)
    step = compilation.jit(lambda s, x: layer.decode(x, s, backend="pallas"), donate_argnums=0)
    found = slice_launches(step.lower(state, u[:, 1]).compile().as_text())
    assert found == [], found


@pytest.mark.gpu
@pytest.mark.parametrize("ssm_state", ["standard", "replay"])
def test_compiled_gdn_decode_step_forms_its_gates_in_its_kernels(ssm_state, rng):
    """A GDN layer's decode step on "pallas" (bf16 weights, batch 64, the state donated), compiled: besides its
    kernels no launch has the gates' result f32[batch, HV] (the kernels form g and beta from the raw a and
    b; on the replay state's default route the Triton prelude does)."""
    layer = GatedDeltaNet(256, num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128, packed=False,
                          param_dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    u = jnp.asarray(rng.standard_normal((64, 2, 256)), jnp.bfloat16)
    _, state = layer.prefill(u[:, :1])
    if ssm_state == "replay":
        state = layer.to_replay(state, buffer_len=16)
    step = compilation.jit(lambda s, x: layer.decode(x, s, backend="pallas"), donate_argnums=0)
    work = work_besides_kernels(step.lower(state, u[:, 1]).compile().as_text())
    assert not [line for line in work if re.search(r"= f32\[64,8\]", line)], work


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "mamba2"])
def test_pallas_detector_finds_a_copy(name, rng):
    layer = _layers(rng)[name]
    state = layer.state(jnp.float32)

    def keeps_previous(carry, inp):
        state, _ = carry
        y, new = layer.step(state, inp, "pallas")
        return y, (new, state)

    hlo = compiled_scan(keeps_previous, (state, state), _stack(layer, STEPS))
    assert per_step_copies(hlo, [state]), "the detector missed a forced copy"


# ---------------------------------------------------------------------------
# GPU: no per-step concatenation of weights (XLA's dot merger; replayssm_jax.compilation)


def _matrices(params):
    """The 2-D parameter arrays (the projections' weights) of `params`."""
    return [a for a in jax.tree.leaves(params) if a.ndim == 2]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "nemotron_h_tiny"])
def test_decode_loop_merges_no_weights(name):
    """The decode loop that Generator compiles concatenates no weights (its options turn XLA's dot merger
    off); a plain `jax.jit` of the same step does, which shows that the check can find them."""
    model = load_model(DATA / name)
    graphdef, params = nnx.split(model)
    weights = _matrices(params)
    gen = Generator(model, state="replay", backend="pallas", block_size=4, buffer_len=L)
    gen.generate(np.load(DATA / name / "reference.npz")["prompt_ids"][:2], 5)
    (hlo,) = gen.decode_hlo()
    assert not merged_weights(hlo, weights), "\n".join(merged_weights(hlo, weights))
    _, cache = model.prefill(jnp.ones((2, 4), jnp.int32), 16, replay_buffer_len=L)

    def plain(params, cache, tokens):
        def step(c, _):
            logits, c = nnx.merge(graphdef, params).decode(tokens, c, backend="pallas")
            return c, logits
        return jax.lax.scan(step, cache, None, length=4)

    text = jax.jit(plain).lower(params, cache, jnp.ones((2,), jnp.int32)).compile().as_text()
    assert merged_weights(text, weights), "a plain jax.jit merged no projections: the check is not exercised"
