"""Hybrid models against transformers 5.17 on the four tiny fixtures, and checkpoint / config errors.

Fixtures (tests/data/*, see /work/shared/fixtures/README.md): a real checkpoint
per family plus reference.npz from transformers' pure-PyTorch path (float32, CPU).
Parity: prefill_logits and full_logits within 1e-4; decode with the standard
state and with ReplaySSM at several buffer lengths reproduces step_logits within
1e-4 and the greedy generated_ids exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    HybridCache,
    NemotronHConfig,
    NemotronHForCausalLM,
    QwenHybridConfig,
    QwenHybridForCausalLM,
    load_model,
    make_decode_step,
    make_prefill,
    split_params,
)
from models.random_init import init_model
from replayssm_jax.layers import KVCache, ReplayLayerState, SSMLayerState

DATA = os.path.join(os.path.dirname(__file__), "data")
FIXTURES = ["mamba2_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_next_tiny"]
TOL = 1e-4
# None: standard SSM state; ints: ReplaySSM buffer lengths (1: flush every step; 16: flushes
# after 16 and 32 of the 40 steps, ends with a partly filled buffer).
DECODE_MODES = [None, 1, 16]
# The standard state on every fixture by default, and L = 1 and 16 on one fixture of each layer type
# (mamba2_tiny: Mamba-2, qwen3_5_tiny: GDN); the buffer lengths on the other two fixtures are `slow`, whose
# ReplaySSM decode matches the reference by default elsewhere: nemotron_h_tiny's logits in
# test_replay_state_route_matches (L = 5), qwen3_next_tiny's in test_functional_prefill_and_decode_step
# (L = 3) and its greedy tokens in tests/test_model_verify.py (L = 4).
_DEFAULT_DECODE = {None: tuple(FIXTURES), 1: ("mamba2_tiny", "qwen3_5_tiny"), 16: ("mamba2_tiny", "qwen3_5_tiny")}
DECODE_CASES = [pytest.param(name, L, id=f"{name}-{L}", marks=() if name in _DEFAULT_DECODE[L] else pytest.mark.slow)
                for L in DECODE_MODES for name in FIXTURES]

_MODELS: dict = {}


def fixture_dir(name):
    return os.path.join(DATA, name)


def get_model(name):
    if name not in _MODELS:
        _MODELS[name] = load_model(fixture_dir(name))
    return _MODELS[name]


def reference(name):
    return dict(np.load(os.path.join(fixture_dir(name), "reference.npz")))


def max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


_forward = jax.jit(lambda graphdef, params, ids: nnx.merge(graphdef, params)(ids), static_argnums=0)


def forward(model, ids):
    graphdef, params = split_params(model)
    return _forward(graphdef, params, jnp.asarray(ids))


def greedy(model, prompt, new_tokens, replay_buffer_len, route="output"):
    """Prefill + greedy decode in one jitted lax.scan. Returns (step logits [N, B, V], generated ids [B, T+N])."""
    graphdef, params = split_params(model)
    max_len = prompt.shape[1] + new_tokens

    @jax.jit
    def run(params, prompt):
        m = nnx.merge(graphdef, params)
        logits, cache = m.prefill(prompt, max_len, replay_buffer_len=replay_buffer_len)
        first = logits[:, -1]

        def body(carry, _):
            cache, lg = carry
            tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)
            lg2, cache = nnx.merge(graphdef, params).decode(tok, cache, route=route)
            return (cache, lg2), (lg, tok)

        _, (lgs, toks) = jax.lax.scan(body, (cache, first), None, length=new_tokens)
        return lgs, jnp.concatenate([prompt, toks.T], axis=1)

    return run(params, jnp.asarray(prompt))


# ------------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("name", FIXTURES)
def test_loaded_model_class(name):
    model = get_model(name)
    expected = NemotronHForCausalLM if name in ("mamba2_tiny", "nemotron_h_tiny") else QwenHybridForCausalLM
    assert isinstance(model, expected)


@pytest.mark.parametrize("name", FIXTURES)
def test_prefill_and_full_logits_match_transformers(name):
    model, ref = get_model(name), reference(name)
    err_prefill = max_err(forward(model, ref["prompt_ids"]), ref["prefill_logits"])
    err_full = max_err(forward(model, ref["generated_ids"]), ref["full_logits"])
    assert err_prefill < TOL, f"{name}: prefill_logits max abs err {err_prefill:.3g}"
    assert err_full < TOL, f"{name}: full_logits max abs err {err_full:.3g}"


@pytest.mark.parametrize("name, replay_buffer_len", DECODE_CASES)
def test_decode_matches_transformers(name, replay_buffer_len):
    model, ref = get_model(name), reference(name)
    n_new = ref["step_logits"].shape[0]
    step_logits, ids = greedy(model, ref["prompt_ids"], n_new, replay_buffer_len)
    err = max_err(step_logits, ref["step_logits"])
    assert err < TOL, f"{name} (replay L={replay_buffer_len}): step_logits max abs err {err:.3g}"
    np.testing.assert_array_equal(np.asarray(ids), ref["generated_ids"])


# The state route is the layers' code, which tests/test_layers.py::test_ssm_layer_continuity runs on both layer
# types: through a model by default on nemotron_h_tiny (its ReplaySSM logits, see DECODE_CASES), qwen3_5_tiny
# `slow` (its output route runs by default at L = 1 and 16).
@pytest.mark.parametrize("name", ["nemotron_h_tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)])
def test_replay_state_route_matches(name):
    model, ref = get_model(name), reference(name)
    step_logits, ids = greedy(model, ref["prompt_ids"], 12, 5, route="state")
    assert max_err(step_logits, ref["step_logits"][:12]) < TOL
    np.testing.assert_array_equal(np.asarray(ids), ref["generated_ids"][:, :ref["prompt_ids"].shape[1] + 12])


# qwen3_5_tiny `slow`: the last position's logits are the shared prefill's code, which
# test_functional_prefill_and_decode_step checks on a Qwen fixture (qwen3_next_tiny) by default.
@pytest.mark.parametrize("name", ["nemotron_h_tiny", pytest.param("qwen3_5_tiny", marks=pytest.mark.slow)])
def test_prefill_last_logits_only(name):
    """The last position alone (what generation uses; full prompt logits of a large batch do not fit)."""
    model, ref = get_model(name), reference(name)
    prompt = jnp.asarray(ref["prompt_ids"])
    logits, _ = jax.jit(lambda ids: model.prefill(ids, ids.shape[1] + 1, last_logits_only=True))(prompt)
    assert logits.shape == ref["step_logits"][0].shape
    assert max_err(logits, ref["step_logits"][0]) < TOL


def test_functional_prefill_and_decode_step():
    """make_prefill / make_decode_step: pure jitted functions of (params, ...), and the cache types."""
    name = "qwen3_next_tiny"
    model, ref = get_model(name), reference(name)
    graphdef, params = split_params(model)
    T = ref["prompt_ids"].shape[1]
    prefill = make_prefill(graphdef, max_len=T + 4, replay_buffer_len=3, last_logits_only=True)
    step = make_decode_step(graphdef)
    logits, cache = prefill(params, jnp.asarray(ref["prompt_ids"]))
    assert isinstance(cache, HybridCache) and cache.uses_replay
    kinds = [type(s) for s in cache.layers]
    assert kinds == [ReplayLayerState, ReplayLayerState, KVCache, ReplayLayerState]
    assert max_err(logits, ref["step_logits"][0]) < TOL
    for j in range(3):
        logits, cache = step(params, cache, jnp.asarray(ref["generated_ids"][:, T + j]))
        assert max_err(logits, ref["step_logits"][j + 1]) < TOL
    np.testing.assert_array_equal(np.asarray(cache.position), [T + 3] * 2)
    np.testing.assert_array_equal(np.asarray(cache.layers[2].length), [T + 3] * 2)


def test_params_of_another_model_are_named():
    """The jitted functions of one model's graphdef given another model's params raise, naming `params`."""
    graphdef, _ = split_params(get_model("qwen3_5_tiny"))
    _, other = split_params(get_model("qwen3_next_tiny"))
    ids = jnp.asarray(reference("qwen3_5_tiny")["prompt_ids"])
    with pytest.raises(ValueError, match="`params` do not match the model's graphdef"):
        make_prefill(graphdef, max_len=ids.shape[1] + 1)(other, ids)


def test_decode_rejects_mismatched_cache():
    model = get_model("nemotron_h_tiny")
    ids = jnp.asarray(reference("nemotron_h_tiny")["prompt_ids"])
    _, cache = jax.jit(model.prefill, static_argnums=1)(ids, 16)
    assert isinstance(cache.layers[0], SSMLayerState) and cache.layers[1] is None
    with pytest.raises(ValueError, match="layer states"):
        model.decode(ids[:, 0], HybridCache(layers=cache.layers[:-1], position=cache.position))
    swapped = (cache.layers[2],) + cache.layers[1:]
    with pytest.raises(ValueError, match=r"cache.layers\[0\]"):
        model.decode(ids[:, 0], HybridCache(layers=swapped, position=cache.position))
    with pytest.raises(ValueError, match=r"\[batch\]"):
        model.decode(ids, cache)
    batch = ids.shape[0]
    with pytest.raises(ValueError, match=rf"`tokens` must have {batch} rows, the cache's batch; got shape \(1,\)"):
        model.decode(ids[:1, 0], cache)
    with pytest.raises(TypeError, match="`cache` must be a HybridCache .*; got NoneType"):
        model.decode(ids[:, 0], None)
    T = ids.shape[1]
    for bad in (T - 1, float(T + 4), True):
        with pytest.raises(ValueError, match=rf"`max_len` must be an int >= the prompt length T = {T}; got "):
            model.prefill(ids, bad)
    with pytest.raises(ValueError, match=rf"`max_len` must be an int >= the prompt length T = {T}; got 0"):
        get_model("mamba2_tiny").prefill(ids, 0)  # no attention layer reads it
    # Backends that cannot run fail at prefill, not at the first decode step.
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="`backend='pallas'` needs a CUDA GPU"):
            model.prefill(ids, 16, backend="pallas")
    with pytest.raises(ValueError, match=r"`replay_buffer_len` must be <= 64 with backend 'interpret' .*; got 100"):
        model.prefill(ids, 16, replay_buffer_len=100, backend="interpret")


# ------------------------------------------------------------------------------------------------
# loading


def copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fixture_dir(name), dst)
    os.chmod(dst, 0o755)
    for f in dst.iterdir():
        os.chmod(f, 0o644)
    return dst


def test_sharded_checkpoint_and_dtype_cast(tmp_path):
    name = "qwen3_next_tiny"
    dst = copy_fixture(name, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, dst / fname)
        weight_map.update({k: fname for k in ks})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.remove(dst / "model.safetensors")
    ref = reference(name)
    model = load_model(dst)
    assert max_err(forward(model, ref["prompt_ids"]), ref["prefill_logits"]) < TOL

    model16 = load_model(dst, dtype=jnp.bfloat16)
    gdn = model16.model.layers[0].linear_attn
    assert gdn.in_proj_qkvz.weight[...].dtype == jnp.bfloat16
    assert gdn.A_log[...].dtype == jnp.float32 and gdn.dt_bias[...].dtype == jnp.float32
    logits = forward(model16, ref["prompt_ids"])
    assert logits.dtype == jnp.float32
    assert max_err(logits, ref["prefill_logits"]) < 0.05  # bf16 weights (seen: 7e-3)
    T = ref["prompt_ids"].shape[1]
    graphdef, params = split_params(model16)
    prefill = make_prefill(graphdef, max_len=T + 2, replay_buffer_len=2, buffer_dtype=jnp.bfloat16)
    _, cache = prefill(params, jnp.asarray(ref["prompt_ids"]))
    assert cache.layers[0].replay.d.dtype == jnp.bfloat16
    assert cache.layers[0].replay.checkpoint.dtype == jnp.float32
    logits, _ = make_decode_step(graphdef)(params, cache, jnp.asarray(ref["generated_ids"][:, T]))
    assert max_err(logits, ref["step_logits"][1]) < 0.05


def test_nemotron_model_prefix_and_mtp_are_accepted(tmp_path):
    name = "nemotron_h_tiny"
    dst = copy_fixture(name, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    renamed = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in tensors.items()}
    renamed["mtp.layers.0.norm.weight"] = np.ones(4, np.float32)
    save_file(renamed, dst / "model.safetensors")
    ref = reference(name)
    assert max_err(forward(load_model(dst), ref["prompt_ids"]), ref["prefill_logits"]) < TOL


def _rewrite(dst, fn):
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    dst = copy_fixture("nemotron_h_tiny", tmp_path)
    _rewrite(dst, lambda t: t.pop("backbone.layers.4.mixer.dt_bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'backbone.layers.4.mixer.dt_bias'.*\(4,\)"):
        load_model(dst)


def test_missing_expert_is_named(tmp_path):
    dst = copy_fixture("qwen3_next_tiny", tmp_path)
    _rewrite(dst, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.2.up_proj.weight"):
        load_model(dst)


def test_unexpected_tensor_is_named(tmp_path):
    dst = copy_fixture("qwen3_5_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("model.layers.0.linear_attn.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*'model.layers.0.linear_attn.extra.weight'"):
        load_model(dst)


def test_shape_mismatch_names_file_key_and_shapes(tmp_path):
    dst = copy_fixture("mamba2_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("backbone.layers.1.mixer.D", np.ones(5, np.float32)))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'backbone.layers.1.mixer.D' has shape "
                                              r"\(5,\); Mamba2ForCausalLM expects \(4,\)"):
        load_model(dst)


def test_integer_tensor_is_rejected(tmp_path):
    dst = copy_fixture("mamba2_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("backbone.layers.0.mixer.A_log", np.arange(4, dtype=np.int32)))
    with pytest.raises(CheckpointError, match=r"tensor 'backbone.layers.0.mixer.A_log' has dtype I32; "
                                              r"Mamba2ForCausalLM expects a floating dtype"):
        load_model(dst)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "index"])
def test_unreadable_weights_are_a_checkpoint_error(tmp_path, damage):
    dst = copy_fixture("qwen3_5_tiny", tmp_path)
    weights = dst / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbage":
        weights.write_bytes(np.random.default_rng().bytes(4096))
    else:
        (dst / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(dst)


def test_two_tensors_for_one_parameter_are_rejected(tmp_path):
    dst = copy_fixture("mamba2_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("backbone.embedding.weight", t["backbone.embeddings.weight"] + 1))
    with pytest.raises(CheckpointError, match="both map to the parameter 'backbone.embeddings.weight'"):
        load_model(dst)


def test_malformed_index_is_a_checkpoint_error(tmp_path):
    dst = copy_fixture("qwen3_5_tiny", tmp_path)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 1}}))
    with pytest.raises(CheckpointError, match="missing or malformed 'weight_map'"):
        load_model(dst)


def test_bad_dtypes_are_rejected():
    with pytest.raises(TypeError, match="`dtype` must be None or a floating dtype"):
        load_model(fixture_dir("mamba2_tiny"), dtype=jnp.int8)
    with pytest.raises(TypeError, match="`ssm_state_dtype` must be float32 or bfloat16; got"):
        load_model(fixture_dir("mamba2_tiny"), ssm_state_dtype=jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float16, "float16", jnp.float64])
def test_float16_and_float64_weights_are_refused(dtype):
    """Only float32 and bfloat16 are supported: float16 overflows in the SSM ops (inf outputs)."""
    with pytest.raises(TypeError, match=r"`dtype` must be None or a floating dtype \(float32, bfloat16\); got float"):
        load_model(fixture_dir("mamba2_tiny"), dtype=dtype)
    with pytest.raises(TypeError, match=r"`dtype` must be None or a floating dtype \(float32, bfloat16\); got float"):
        init_model(fixture_dir("qwen3_5_tiny"), dtype=dtype)
    with pytest.raises(TypeError, match="`ssm_state_dtype` must be float32 or bfloat16; got float"):
        init_model(fixture_dir("qwen3_5_tiny"), ssm_state_dtype=dtype)


def test_float16_message_says_why():
    with pytest.raises(TypeError, match="got float16 \\(float16 is not supported: the SSM ops overflow its range"):
        load_model(fixture_dir("mamba2_tiny"), dtype=jnp.float16)


def test_float16_checkpoint_needs_an_explicit_dtype(tmp_path):
    """A float16 checkpoint is not kept as stored (dtype=None); dtype=float32 casts it and loads."""
    dst = copy_fixture("mamba2_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("backbone.norm_f.weight", t["backbone.norm_f.weight"].astype(np.float16)))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'backbone.norm_f.weight' has dtype F16, "
                                              r"which the models do not run in \(supported: F32, BF16\); pass "
                                              r"dtype=jnp.float32"):
        load_model(dst)
    model = load_model(dst, dtype=jnp.float32)
    assert model.backbone.norm_f.weight[...].dtype == jnp.float32


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_a_checkpoint_error(tmp_path, bad):
    dst = copy_fixture("nemotron_h_tiny", tmp_path)

    def poison(t):
        t["backbone.layers.4.mixer.in_proj.weight"][3, 5] = bad

    _rewrite(dst, poison)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'backbone.layers.4.mixer.in_proj.weight' "
                                              r"holds 1 non-finite value\(s\) \(NaN or inf\), the first "
                                              rf"{bad} at index \(3, 5\)"):
        load_model(dst)


def test_non_finite_expert_weight_is_named(tmp_path):
    """Per-expert tensors are checked one by one as they are stacked."""
    dst = copy_fixture("qwen3_next_tiny", tmp_path)
    _rewrite(dst, lambda t: t["model.layers.1.mlp.experts.3.down_proj.weight"].__setitem__((0, 0), np.nan))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.experts.3.down_proj.weight' holds 1 "
                                              r"non-finite"):
        load_model(dst, dtype=jnp.bfloat16)


def test_out_of_vocabulary_ids_and_a_full_kv_cache_are_errors():
    model = load_model(fixture_dir("qwen3_5_tiny"))
    ids = reference("qwen3_5_tiny")["prompt_ids"]
    with pytest.raises(ValueError, match=r"`input_ids` has token id 256 outside the vocabulary \[0, 256\)"):
        model(np.array([[1, 256]]))
    _, cache = model.prefill(ids[:, :4], max_len=5)
    with pytest.raises(ValueError, match=r"`tokens` has token id -1 outside the vocabulary"):
        model.decode(np.array([1, -1]), cache)
    _, cache = model.decode(np.array([1, 2]), cache)
    with pytest.raises(ValueError, match="the KV cache is full: a row holds 5 of max_len = 5 positions"):
        model.decode(np.array([1, 2]), cache)


@pytest.mark.parametrize("mode", ["call", "prefill"])
def test_bad_input_ids_are_named_at_the_model_boundary(mode):
    """Empty, ragged, mis-ranked or float ids fail with `input_ids` named, before any op runs."""
    model = get_model("qwen3_5_tiny")
    run = model if mode == "call" else (lambda ids: model.prefill(ids, max_len=8))
    with pytest.raises(ValueError, match=r"`input_ids` must not be empty: shape \[batch, seqlen\] with batch >= 1 "
                                         r"and seqlen >= 1; got \(2, 0\)"):
        run(np.zeros((2, 0), np.int32))
    with pytest.raises(ValueError, match=r"`input_ids` must not be empty.*got \(0, 3\)"):
        run(np.zeros((0, 3), np.int32))
    with pytest.raises(ValueError, match=r"`input_ids` must be a rectangular integer array \[batch, seqlen\]; "
                                         r"got a list"):
        run([[1, 2, 3], [4]])
    with pytest.raises(ValueError, match=r"`input_ids` must have shape \[batch, seqlen\]; got \(3,\)"):
        run(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="`input_ids` must be an integer array; got dtype float32"):
        run(np.ones((1, 3), np.float32))


def test_bad_buffer_length_and_route_are_named():
    """prefill's `replay_buffer_len` other than None or an int >= 1, and decode's unknown `route` (a standard
    state's cache, which no route reaches, included), are named before any op runs."""
    model = get_model("qwen3_5_tiny")
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=rf"`replay_buffer_len` must be None or an int >= 1; got {bad!r}"):
            model.prefill(ids, max_len=8, replay_buffer_len=bad)
    for replay_buffer_len in (None, 2):
        _, cache = model.prefill(ids, max_len=8, replay_buffer_len=replay_buffer_len)
        with pytest.raises(ValueError, match="`route` must be one of 'output', .*; got 'bogus'"):
            model.decode(np.array([1, 2]), cache, route="bogus")
        logits, _ = model.decode(np.array([1, 2]), cache)  # the cache stays usable
        assert np.isfinite(np.asarray(logits)).all()


def test_bad_decode_tokens_are_named():
    model = get_model("qwen3_5_tiny")
    _, cache = model.prefill(np.array([[1, 2, 3], [4, 5, 6]]), max_len=8)
    with pytest.raises(ValueError, match=r"`tokens` must not be empty: shape \[batch\] with batch >= 1; got \(0,\)"):
        model.decode(np.zeros((0,), np.int32), cache)
    with pytest.raises(TypeError, match="`tokens` must be an integer array; got dtype bool"):
        model.decode(np.array([True, False]), cache)
    logits, _ = model.decode([7, 8], cache)  # a list of ints is an int array
    assert logits.shape == (2, 256)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match="'.*a_file' is a file, not a folder"):
        load_model(tmp_path / "a_file")
    dst = copy_fixture("mamba2_tiny", tmp_path)
    os.remove(dst / "config.json")
    with pytest.raises(CheckpointNotFoundError, match=r"config.json: no such file"):
        load_model(dst)
    dst = copy_fixture("qwen3_5_tiny", tmp_path)
    os.remove(dst / "model.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors"):
        load_model(dst)


def _edit_config(dst, fn):
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type(tmp_path):
    dst = copy_fixture("mamba2_tiny", tmp_path)
    _edit_config(dst, lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(ConfigError, match=r"config.json: unknown model_type 'llama'"):
        load_model(dst)
    _edit_config(dst, lambda c: c.pop("model_type"))
    with pytest.raises(ConfigError, match=r"config.json: missing key 'model_type' \(the model family\); supported: "):
        load_model(dst)
    for bad in (None, 3):
        with pytest.raises(TypeError, match=rf"`path` must be a checkpoint folder \(str or os.PathLike\); got "
                                            rf"{type(bad).__name__} {bad}"):
            load_model(bad)


def test_unknown_layer_type(tmp_path):
    dst = copy_fixture("nemotron_h_tiny", tmp_path)
    _edit_config(dst, lambda c: c["layers_block_type"].__setitem__(2, "sliding_attention"))
    with pytest.raises(ConfigError, match=r"'layers_block_type': unknown layer type 'sliding_attention' at layer 2"):
        load_model(dst)
    dst = copy_fixture("qwen3_5_tiny", tmp_path)
    _edit_config(dst, lambda c: c["layer_types"].__setitem__(0, "mamba"))
    with pytest.raises(ConfigError, match=r"'layer_types': unknown layer type 'mamba' at layer 0"):
        load_model(dst)


# ------------------------------------------------------------------------------------------------
# configs


def fixture_config(name):
    return json.loads(open(os.path.join(fixture_dir(name), "config.json")).read())


def test_nemotron_legacy_names_give_the_same_config():
    new = fixture_config("nemotron_h_tiny")
    legacy = dict(new)
    del legacy["layers_block_type"]
    legacy["hybrid_override_pattern"] = "ME*-ME"
    for old, key in [("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"),
                     ("mamba_chunk_size", "chunk_size"), ("mamba_conv_bias", "use_conv_bias")]:
        legacy[old] = legacy.pop(key)
    legacy["mamba_dt_limit"] = [0.0, float("inf")]
    del legacy["time_step_limit"]
    a = NemotronHConfig.from_hf_config(new)
    b = NemotronHConfig.from_hf_config(legacy)
    assert a == b
    assert a.layer_types == ("mamba", "moe", "attention", "mlp", "mamba", "moe")
    assert a.dt_limit == (0.0, float("inf"))
    assert a.mamba_norm_group_size == 16  # d_inner 32 / n_groups 2
    # the legacy list names of older hub configs
    older = dict(new, layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"])
    assert NemotronHConfig.from_hf_config(older) == a


def test_nemotron_config_validation():
    base = fixture_config("nemotron_h_tiny")
    with pytest.raises(ConfigError, match=r"'n_groups' = 3 must divide 'mamba_num_heads' = 4"):
        NemotronHConfig.from_hf_config(dict(base, n_groups=3))
    with pytest.raises(ConfigError, match=r"'num_key_value_heads' = 3 must divide 'num_attention_heads' = 4"):
        NemotronHConfig.from_hf_config(dict(base, num_key_value_heads=3))
    with pytest.raises(ConfigError, match=r"missing key 'layers_block_type'"):
        NemotronHConfig.from_hf_config({k: v for k, v in base.items() if k != "layers_block_type"})
    with pytest.raises(ConfigError, match=r"'hybrid_override_pattern': unknown layer type 'X' at layer 1"):
        NemotronHConfig.from_hf_config(dict({k: v for k, v in base.items() if k != "layers_block_type"},
                                            hybrid_override_pattern="MX"))
    with pytest.raises(ConfigError, match=r"'num_experts_per_tok' must be in \[1, n_routed_experts = 4\]"):
        NemotronHConfig.from_hf_config(dict(base, num_experts_per_tok=5))
    with pytest.raises(ConfigError, match=r"key 'hidden_size' must be int"):
        NemotronHConfig.from_hf_config(dict(base, hidden_size="32"))
    with pytest.raises(ConfigError, match=r"key 'conv_kernel' must be a positive integer; found 0"):
        NemotronHConfig.from_hf_config(dict(base, conv_kernel=0))
    with pytest.raises(ConfigError, match=r"key 'conv_kernel' must be a positive integer; found 0"):
        NemotronHConfig.from_hf_config(dict(fixture_config("mamba2_tiny"), conv_kernel=0))


REQUIRED_KEYS = [  # (fixture, the key and its aliases): each fixes shapes no default would match
    ("nemotron_h_tiny", ("ssm_state_size",)),
    ("nemotron_h_tiny", ("mamba_num_heads",)),
    ("nemotron_h_tiny", ("mamba_head_dim",)),
    ("nemotron_h_tiny", ("n_groups", "mamba_n_groups")),
    ("nemotron_h_tiny", ("num_key_value_heads",)),
    ("nemotron_h_tiny", ("head_dim", "attention_head_dim")),
    ("nemotron_h_tiny", ("moe_shared_expert_intermediate_size",)),
    ("nemotron_h_tiny", ("layers_block_type", "layer_types", "hybrid_override_pattern")),
    ("mamba2_tiny", ("state_size",)),
    ("mamba2_tiny", ("n_groups",)),
    ("qwen3_5_tiny", ("num_key_value_heads",)),
    ("qwen3_5_tiny", ("head_dim",)),
    ("qwen3_5_tiny", ("intermediate_size",)),
    ("qwen3_5_tiny", ("layer_types", "full_attention_interval")),
    ("qwen3_next_tiny", ("num_experts",)),
    ("qwen3_next_tiny", ("shared_expert_intermediate_size",)),
]


@pytest.mark.parametrize("name, keys", REQUIRED_KEYS, ids=[f"{n}-{k[0]}" for n, k in REQUIRED_KEYS])
def test_missing_required_key_is_named(tmp_path, name, keys):
    """A config without a required key names the file, the key and its aliases (no silent default)."""
    cfg = {k: v for k, v in fixture_config(name).items() if k not in keys}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    aliases = ""
    if len(keys) > 1:
        aliases = rf" \(or its alias{'es' if len(keys) > 2 else ''} " + ", ".join(f"'{k}'" for k in keys[1:]) + r"\)"
    with pytest.raises(ConfigError, match=rf"{re.escape(str(tmp_path / 'config.json'))}: missing key '{keys[0]}'"
                                          rf"{aliases}, which is required"):
        load_model(tmp_path)


def test_nemotron_without_ssm_state_size_is_a_config_error(tmp_path):
    """The reported case: the whole checkpoint, config.json lacking ssm_state_size."""
    dst = copy_fixture("nemotron_h_tiny", tmp_path)
    _edit_config(dst, lambda c: c.pop("ssm_state_size"))
    with pytest.raises(ConfigError, match=r"config.json: missing key 'ssm_state_size', which is required"):
        load_model(dst)


def test_optional_keys_keep_transformers_defaults():
    base = fixture_config("nemotron_h_tiny")
    optional = ("conv_kernel", "chunk_size", "use_conv_bias", "use_bias", "time_step_limit", "layer_norm_epsilon",
                "mamba_hidden_act", "attention_bias", "mlp_hidden_act", "mlp_bias", "n_group", "topk_group")
    cfg = NemotronHConfig.from_hf_config({k: v for k, v in base.items() if k not in optional})
    assert (cfg.conv_kernel, cfg.chunk_size, cfg.use_conv_bias, cfg.use_bias) == (4, 128, True, False)
    assert cfg.dt_limit == (0.0, float("inf")) and cfg.layer_norm_epsilon == 1e-5
    # Qwen: partial_rotary_factor defaults to 0.25, as in transformers' Qwen3-Next / Qwen3.5 configs
    qwen = {k: v for k, v in fixture_config("qwen3_5_tiny").items() if k not in ("rope_parameters",
                                                                                "partial_rotary_factor")}
    assert QwenHybridConfig.from_hf_config(qwen).rotary_dim == 4  # head_dim 16 * 0.25


def test_mamba2_config():
    cfg = NemotronHConfig.from_hf_config(fixture_config("mamba2_tiny"))
    assert cfg.layer_types == ("mamba", "mamba") and cfg.mamba_norm_group_size == 32
    assert cfg.dt_limit == (0.0, float("inf")) and cfg.residual_in_fp32 and not cfg.tie_word_embeddings
    with pytest.raises(ConfigError, match=r"'num_heads' \* 'head_dim' = 24 must equal"):
        NemotronHConfig.from_hf_config(dict(fixture_config("mamba2_tiny"), num_heads=3))


def test_qwen_configs():
    nxt = QwenHybridConfig.from_hf_config(fixture_config("qwen3_next_tiny"))
    assert nxt.layer_types == ("gdn", "gdn", "attention", "gdn") and nxt.mlp_types == ("moe",) * 4
    assert nxt.gdn_packed and nxt.rotary_dim == 4
    q35 = QwenHybridConfig.from_hf_config(fixture_config("qwen3_5_tiny"))
    assert q35.mlp_types == ("mlp",) * 4 and not q35.gdn_packed
    # legacy: full_attention_interval instead of layer_types, top-level rope keys
    legacy = {k: v for k, v in fixture_config("qwen3_next_tiny").items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(full_attention_interval=3, rope_theta=10000.0, partial_rotary_factor=0.25, mlp_only_layers=[1])
    cfg = QwenHybridConfig.from_hf_config(legacy)
    assert cfg.layer_types == ("gdn", "gdn", "attention", "gdn")
    assert cfg.mlp_types == ("moe", "mlp", "moe", "moe") and cfg.rotary_dim == 4
    # the multimodal wrapper reads text_config
    wrapped = {"model_type": "qwen3_5", "text_config": {k: v for k, v in fixture_config("qwen3_5_tiny").items()
                                                        if k != "model_type"}}
    assert QwenHybridConfig.from_hf_config(wrapped) == q35
    bad = dict(fixture_config("qwen3_5_tiny"), rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ConfigError, match=r"rope_type 'yarn' is not supported"):
        QwenHybridConfig.from_hf_config(bad)
    with pytest.raises(ConfigError, match=r"'linear_num_key_heads' = 3 must divide 'linear_num_value_heads' = 4"):
        QwenHybridConfig.from_hf_config(dict(fixture_config("qwen3_5_tiny"), linear_num_key_heads=3))
    with pytest.raises(ConfigError, match=r"'layer_types' has 4 entries; 'num_hidden_layers' = 5"):
        QwenHybridConfig.from_hf_config(dict(fixture_config("qwen3_5_tiny"), num_hidden_layers=5))
