"""Tensor and data parallelism (models.sharding) on simulated CPU devices.

The sharded tests need four devices, which XLA's CPU backend simulates with
``--xla_force_host_platform_device_count=4`` set before JAX starts. The rest
of the suite runs on one device, so in the ordinary run `test_sharded_suite`
runs this file again in a subprocess with that flag (and the suite's compile
cache), and the tests below are skipped in the parent process; in the
subprocess they run and `test_sharded_suite` is skipped. The subprocess runs
the tests of the parent's marker selection: the default cases by default,
the `slow` ones (`SLOW_CASES`) with `-m slow`.

What runs (the combinations cover the code paths rather than the full
product, which would compile about 50 generators):

- every fixture at tp = 2, dp = 2 with ReplaySSM (L = 4) on the "xla" backend
  (mamba2_tiny: the gated norm reduced over tp; nemotron_h_tiny: Mamba-2,
  attention, MLP, MoE; qwen3_5_tiny: the fused in_proj_qkv; qwen3_next_tiny,
  by speculative decoding below: the packed projections and the MoE with a
  gated shared expert);
- the Pallas kernels per shard ("interpret"): nemotron_h_tiny (Mamba-2) with
  ReplaySSM and qwen3_5_tiny (GDN) with the standard state, tp = 2, dp = 2;
- the standard state on "xla": mamba2_tiny at tp = 1, dp = 2 (a mesh
  without tensor parallelism: no collective in the program);
- tp = 4 on random weights (init_model) of nemotron_h_tiny's config with
  n_groups and num_key_value_heads raised to 4 and one block of each kind
  (the fixtures' own 2 groups and 2 KV heads stop at tp = 2:
  `test_errors_name_the_config_key`);
- speculative decoding (n-gram drafts, the verify window and commit) on
  qwen3_next_tiny with ReplaySSM, tp = 2, dp = 2.

On a machine with several GPUs, ``-m gpu`` runs `test_gpu_mesh_matches_one_gpu`:
the compiled Pallas kernels per shard, tp = 2 and 4 (as many GPUs as there
are), against the same model on one GPU.

The unsharded tokens are the fixtures' reference.npz greedy tokens, which
the unsharded Generator decodes on the same prompts (test_generation.py::
test_greedy_tokens_match_transformers, standard state and L = 4); the random
model is compared with its own unsharded run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hlo_checks import per_step_copies
from models import load_model
from models.random_init import init_model
from models import sharding as models_sharding
from models.sharding import ShardedLM, check_config, make_mesh, shard_ranges
from replayssm_jax.generation import GenerationError, Generator, SpeculativeConfig
from replayssm_jax.layers import Attention

DATA = pathlib.Path(__file__).parent / "data"
DEVICES = 4
SIMULATED = jax.default_backend() == "cpu" and jax.device_count() >= DEVICES
NEW_TOKENS = 12
needs_devices = pytest.mark.skipif(not SIMULATED, reason=f"needs {DEVICES} devices: run by test_sharded_suite")


@pytest.mark.skipif(SIMULATED, reason="this process has the simulated devices: the tests run here")
@pytest.mark.parametrize("markers", [pytest.param("not gpu and not slow", id="default"),
                                     pytest.param("slow and not gpu", id="slow", marks=pytest.mark.slow)])
def test_sharded_suite(markers):
    """This file's tests of the run's markers, in a process with four simulated CPU devices: the default
    cases by default, the `slow` ones with `-m slow`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"  # the simulated devices also on a machine with GPUs
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-m", markers, __file__], env=env, capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parents[1])
    assert run.returncode == 0, f"the sharded tests failed:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert " passed" in run.stdout and "skipped" in run.stdout, run.stdout[-2000:]


def _reference(name):
    ref = np.load(DATA / name / "reference.npz")
    prompts = ref["prompt_ids"]
    return prompts, ref["generated_ids"][:, : prompts.shape[1] + NEW_TOKENS]


_LOADED = {}


def _sharded(name, tp, dp):
    key = (name, tp, dp)
    if key not in _LOADED:
        _LOADED[key] = load_model(DATA / name, mesh=make_mesh(tp, dp))
    return _LOADED[key]


CASES = [  # (fixture, tp, dp, state, backend)
    ("mamba2_tiny", 2, 2, "replay", "xla"),
    ("nemotron_h_tiny", 2, 2, "replay", "xla"),
    ("qwen3_5_tiny", 2, 2, "replay", "xla"),
    ("nemotron_h_tiny", 2, 2, "replay", "interpret"),
    ("qwen3_5_tiny", 2, 2, "standard", "interpret"),
    ("mamba2_tiny", 1, 2, "standard", "xla"),
]


# The kernels under the mesh by default with the replay state; the standard state's interpreted case `slow`
# (its xla case runs). nemotron_h_tiny on "xla" `slow`: its layers run on "xla" by default at tp = 4
# (test_tp4_random_weights_match_unsharded), the loaded fixture at tp = 2, dp = 2 on the kernels, the
# Mamba-2 replay checkpoints' in-place check on mamba2_tiny.
SLOW_CASES = {("qwen3_5_tiny", 2, 2, "standard", "interpret"), ("nemotron_h_tiny", 2, 2, "replay", "xla")}


@needs_devices
def test_a_sequence_moves_only_between_caches_of_one_tp():
    """A sharded cache keeps each conv window's channels in shard order: a row exported from it imports into
    a cache of the same tp (row 1 moved to row 0 exports as row 1 did), and a cache of another tp refuses
    it, both ways."""
    from replayssm_jax.sequence_state import SequenceStateError, export_sequence, import_sequence

    ids = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    caches = {tp: model.prefill(ids, 16, replay_buffer_len=4)[1]
              for tp, model in ((1, load_model(DATA / "nemotron_h_tiny")), (2, _sharded("nemotron_h_tiny", 2, 1)))}
    row = export_sequence(caches[2], 1)
    moved = export_sequence(import_sequence(caches[2], 0, row), 0)
    assert moved.structure == row.structure and moved.structure.endswith("on a mesh of tp = 2")
    for name, value in row.arrays.items():
        np.testing.assert_array_equal(moved.arrays[name], value, err_msg=name)
    for source, target in ((1, 2), (2, 1)):
        with pytest.raises(SequenceStateError, match="tensor parallelism"):
            import_sequence(caches[target], 0, export_sequence(caches[source], 0))


@needs_devices
def test_a_state_pool_refuses_a_sharded_model():
    """The pool and the engine decode by slots, which ShardedLM's entry points do not take: both refuse it at
    construction, naming the mesh, rather than failing at the first step."""
    from replayssm_jax.engine import Engine, EngineError
    from replayssm_jax.pool import PoolError, StatePool

    model = _sharded("nemotron_h_tiny", 2, 1)
    with pytest.raises(PoolError, match=r"`model` is sharded over a mesh \(ShardedLM, mesh \{'dp': 1, 'tp': 2\}\)"):
        StatePool(model, 2, max_len=16, buffer_len=4)
    with pytest.raises(EngineError, match="`model` is sharded over a mesh"):
        Engine(model, 2, state="replay", buffer_len=4, max_len=16)


@needs_devices
@pytest.mark.parametrize("name, tp, dp, state, backend", [
    pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.slow if c in SLOW_CASES else ()) for c in CASES])
def test_fixture_tokens_match_unsharded(name, tp, dp, state, backend):
    prompts, expected = _reference(name)
    gen = Generator(_sharded(name, tp, dp), state=state, buffer_len=4 if state == "replay" else None,
                    backend=backend, block_size=16)
    out = gen.generate(prompts, NEW_TOKENS)
    np.testing.assert_array_equal(np.array(out.sequences), expected)
    (hlo,) = gen.decode_hlo()
    if tp == 1:  # a mesh without tensor parallelism: the program has no collective
        assert "all-reduce" not in hlo and "all-gather" not in hlo
    else:
        assert "all-reduce" in hlo and "all-gather" in hlo
    if state == "replay" and backend == "xla":  # (the Pallas interpreter stages the kernels' operands)
        _check_checkpoints_in_place(gen, hlo, prompts, tp, dp)


def _check_checkpoints_in_place(gen, hlo, prompts, tp, dp):
    """No per-step copy of a device's block of a replay checkpoint in the decode loop's HLO."""
    model = nnx.merge(gen.graphdef, gen.params)
    _, cache = jax.eval_shape(lambda ids: model.prefill(ids, 32, replay_buffer_len=gen.buffer_len),
                              jnp.asarray(prompts))
    local = [jax.ShapeDtypeStruct(_local_shape(s.replay.checkpoint.shape, tp, dp), s.replay.checkpoint.dtype)
             for s in cache.layers if hasattr(s, "replay")]
    assert local and not per_step_copies(hlo, local)


def _local_shape(shape, tp, dp):
    """One device's block of a [batch, heads, ...] state array on a dp x tp mesh."""
    return (shape[0] // dp, shape[1] // tp, *shape[2:])


def test_sharded_model_keeps_the_attention_decode_backend():
    """`shard_model` carries each attention layer's decode_backend (a static setting, not in the state) to
    the shards' model, and `ShardedLM.set_attention_decode_backend` sets it there (a one-device mesh)."""
    model = load_model(DATA / "qwen3_5_tiny")
    model.set_attention_decode_backend("interpret")
    sharded = models_sharding.shard_model(model, make_mesh(1, 1))

    def backends(m):
        return {layer.decode_backend for _, layer in nnx.iter_modules(m) if isinstance(layer, Attention)}

    assert backends(sharded.inner) == {"interpret"}
    sharded.set_attention_decode_backend("xla")
    assert backends(sharded.inner) == {"xla"} and backends(model) == {"interpret"}


@needs_devices
def test_state_stays_on_its_shards():
    """The prefill's cache is split as state_specs says (heads over tp, rows over dp), each device holding
    its block."""
    name = "nemotron_h_tiny"
    prompts, _ = _reference(name)
    model = _sharded(name, 2, 2)
    _, cache = jax.jit(lambda ids: model.prefill(ids, 32, replay_buffer_len=4))(jnp.asarray(prompts))
    replay = cache.layers[0].replay
    assert replay.checkpoint.sharding.spec == P("dp", "tp")
    assert replay.B.sharding.spec == P("dp", "tp")  # the B records with their groups
    assert cache.layers[0].conv_state.columns.sharding.spec == P("dp", None, "tp")
    assert cache.layers[2].k.sharding.spec == P("dp", None, "tp")  # the KV cache over KV heads
    assert cache.position.sharding.spec == P("dp")
    assert {s.data.shape for s in replay.checkpoint.addressable_shards} == {_local_shape(replay.checkpoint.shape,
                                                                                       2, 2)}
    assert len(replay.checkpoint.addressable_shards) == DEVICES


@needs_devices
def test_load_places_the_shard_layout():
    """Each device holds its block of the shard layout: for the fused Mamba-2 in_proj, its heads' rows of
    z, x, B, C and dt (shard_ranges), read from the checkpoint's slices."""
    name = "nemotron_h_tiny"
    model = _sharded(name, 2, 2)
    stored = load_model(DATA / name).backbone.layers[0].mixer.in_proj.weight[...]
    weight = model.inner.backbone.layers[0].mixer.in_proj.weight[...]
    c = model.config
    d_inner, gn = c.mamba_num_heads * c.mamba_head_dim, c.n_groups * c.ssm_state_size
    parts = (d_inner, d_inner, gn, gn, c.mamba_num_heads)
    for shard in weight.addressable_shards:
        s = shard.index[0].start // (weight.shape[0] // 2)
        rows = np.concatenate([np.arange(a, b) for a, b in shard_ranges(weight.shape[0], parts, 2, s)])
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(stored)[rows])
    assert model.inner.backbone.embeddings.weight[...].sharding.spec == P("tp")  # the vocabulary rows
    out_proj = model.inner.backbone.layers[0].mixer.out_proj.weight[...]
    assert out_proj.sharding.spec == P(None, "tp")  # row-parallel: its input columns


@needs_devices
def test_tp4_random_weights_match_unsharded(tmp_path):
    cfg = json.loads((DATA / "nemotron_h_tiny" / "config.json").read_text())
    cfg.update(n_groups=4, num_key_value_heads=4,  # one block of each kind
               layers_block_type=["linear_attention", "full_attention", "mlp", "moe"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts, _ = _reference("nemotron_h_tiny")
    options = dict(state="replay", buffer_len=4, backend="xla", block_size=16)
    unsharded = Generator(init_model(tmp_path, jnp.float32, seed=1), **options).generate(prompts, NEW_TOKENS)
    sharded = init_model(tmp_path, jnp.float32, seed=1, mesh=make_mesh(tp=4))
    assert isinstance(sharded, ShardedLM)
    assert Generator(sharded, **options).generate(prompts, NEW_TOKENS).sequences == unsharded.sequences


@needs_devices
def test_speculative_tokens_match_unsharded():
    name = "qwen3_next_tiny"
    prompts, expected = _reference(name)
    model = _sharded(name, 2, 2)
    gen = Generator(model, state="replay", buffer_len=4, backend="xla", block_size=16,
                    speculative=SpeculativeConfig("ngram", num_draft=3))
    out = gen.generate(prompts, NEW_TOKENS)
    np.testing.assert_array_equal(np.array(out.sequences), expected)
    tree = Generator(model, state="replay", buffer_len=8, backend="xla", block_size=16,
                     speculative=SpeculativeConfig("ngram", num_draft=2, tree=(2, 2)))  # 5 nodes a round
    np.testing.assert_array_equal(np.array(tree.generate(prompts, NEW_TOKENS).sequences), expected)


@needs_devices
def test_errors_name_the_config_key():
    """Sizes that tp does not divide and batches that dp does not divide are refused before anything is
    placed, naming the config key (or argument), the value and tp / dp."""
    with pytest.raises(ValueError, match=r"config key `n_groups` = 2 is not divisible by tp = 4"):
        load_model(DATA / "nemotron_h_tiny", mesh=make_mesh(tp=4))
    with pytest.raises(ValueError, match=r"config key `linear_num_key_heads` = 2 is not divisible by tp = 4"):
        init_model(DATA / "qwen3_5_tiny", mesh=make_mesh(tp=4))
    with pytest.raises(ValueError, match=r"config key `num_key_value_heads` = 2 is not divisible by tp = 4"):
        check_config(dataclasses.replace(load_model(DATA / "qwen3_next_tiny").config, linear_num_key_heads=4,
                                         linear_num_value_heads=4), 4)
    tiny = load_model(DATA / "mamba2_tiny")
    with pytest.raises(ValueError, match=r"config key `mamba_num_heads` = 4 is not divisible by tp = 3"):
        check_config(tiny.config, 3)
    with pytest.raises(GenerationError, match=r"config key `n_groups` = 2 is not divisible by tp = 4"):
        Generator(tiny, mesh=make_mesh(tp=4))
    model = _sharded("nemotron_h_tiny", 2, 2)
    with pytest.raises(ValueError, match=r"`input_ids` has batch 3, which is not divisible by the mesh's dp = 2"):
        model.prefill(np.ones((3, 4), np.int32), 16)
    with pytest.raises(GenerationError, match=r"`prefill_rows` must be a multiple of the mesh's dp = 2; got 3"):
        Generator(model, prefill_rows=3)
    with pytest.raises(GenerationError, match=r"'mtp' is not supported with a `mesh`"):
        Generator(tiny, mesh=make_mesh(dp=2), speculative=SpeculativeConfig("mtp", num_draft=2))
    with pytest.raises(ValueError, match=r"a mesh of dp x tp = 4 x 2 devices needs 8 devices; 4 available"):
        make_mesh(tp=2, dp=4)


GPU_MODELS = [("nemotron_h_tiny", 2), ("qwen3_5_tiny", 2), ("qwen3_next_tiny", 2), ("mamba2_tiny", 2),
              ("tp4:nemotron_h_tiny", 4), ("bench:nemotron3_nano_4b_like", 2), ("bench:nemotron3_nano_4b_like", 4),
              ("bench:qwen3_5_4b_like", 2), ("bench:qwen3_5_4b_like", 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("state", ["standard", "replay"])
@pytest.mark.parametrize("name, tp", GPU_MODELS, ids=[f"{n}-tp{t}" for n, t in GPU_MODELS])
def test_gpu_mesh_matches_one_gpu(name, tp, state, tmp_path):
    """Greedy tokens of the model on a mesh of tp GPUs (the Pallas kernels per shard) equal those on one
    GPU: the fixtures, a tp = 4 variant of nemotron_h_tiny's config, and random float32 weights of real
    shapes (bench/configs)."""
    if jax.default_backend() != "gpu" or jax.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    kind, _, folder = name.rpartition(":")
    if kind == "bench":
        path = pathlib.Path(__file__).parents[1] / "bench" / "configs" / folder
    elif kind == "tp4":
        cfg = json.loads((DATA / folder / "config.json").read_text())
        cfg.update(n_groups=4, num_key_value_heads=4)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        path = tmp_path
    else:
        path = DATA / folder
    prompts = np.random.default_rng(0).integers(3, 200, size=(8, 16)).tolist()
    options = dict(state=state, buffer_len=16 if state == "replay" else None, backend="pallas", block_size=8)
    one = init_model(path, jnp.float32, seed=1) if kind else load_model(path)
    expected = Generator(one, **options).generate(prompts, 8).sequences
    del one
    mesh = make_mesh(tp=tp)
    sharded = init_model(path, jnp.float32, seed=1, mesh=mesh) if kind else load_model(path, mesh=mesh)
    gen = Generator(sharded, **options)
    assert gen.generate(prompts, 8).sequences == expected
    if state == "replay":
        _check_checkpoints_in_place(gen, gen.decode_hlo()[0], prompts, tp, 1)
