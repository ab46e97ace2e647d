"""The multi-token prediction heads (models.mtp): loading the ``mtp.*`` tensors, the head's
formula, the target's final-normed hidden state, and the MTP drafter (greedy and sampled
drafts, its KV cache, rollback, jit, a speculative round that keeps the cache aligned).

transformers drops the ``mtp.*`` tensors, so the fixtures of tests/data have none:
`with_mtp_tensors` copies a fixture into a tmp folder, adds random ``mtp.*`` tensors
named as the released checkpoints name them, and declares them in config.json.
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

from models import CheckpointError, ConfigError, NemotronHConfig, QwenHybridConfig, load_model, registry, split_params
from models.common import make_decode_step, make_prefill
from models.mtp import (
    MTPCache,
    MTPDrafter,
    NemotronHMTPHead,
    QwenMTPHead,
    add_mtp_head,
    check_config,
    mtp_forward,
)
from replayssm_jax.sampling import SamplingParams, token_log_probs
from replayssm_jax.speculative import Drafts, greedy_acceptance

DATA = os.path.join(os.path.dirname(__file__), "data")
HEAD_FIXTURES = ["qwen3_5_tiny", "qwen3_next_tiny", "nemotron_h_tiny"]
TOL = 1e-5

_NEMOTRON_TYPES = {"full_attention": "attention", "attention": "attention", "*": "attention", "moe": "moe",
                   "E": "moe", "mlp": "mlp", "-": "mlp", "linear_attention": "mamba", "mamba": "mamba", "M": "mamba"}


# ------------------------------------------------------------------------------------------------
# fixtures with an MTP head


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), dst)
    os.chmod(dst, 0o755)
    for f in dst.iterdir():
        os.chmod(f, 0o644)
    return dst


def _qwen_mtp_shapes(cfg, tensors):
    """The released Qwen3-Next / Qwen3.5 ``mtp.*`` names: the four fusion / final tensors, then
    ``mtp.layers.0.*`` named as a decoder layer (shapes of the first attention layer's attention
    and norms, of layer 0's MLP or MoE)."""
    h = cfg["hidden_size"]
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    attn = cfg["layer_types"].index("full_attention")
    for key, t in tensors.items():
        rest = key.split(".", 3)[-1]
        from_attn = key.startswith(f"model.layers.{attn}.") and not rest.startswith("mlp.")
        if from_attn or (key.startswith("model.layers.0.mlp.")):
            shapes["mtp.layers.0." + rest] = t.shape
    return shapes


def _nemotron_mtp_shapes(cfg, tensors):
    """The released Nemotron-H ``mtp.*`` names: ``mtp.layers.{i}.norm`` / ``.mixer.*`` per block of
    mtp_layers_block_type (shapes of the first backbone block of that type), ``enorm``, ``hnorm``,
    ``eh_proj`` on block 0 and ``final_layernorm`` on the last."""
    h = cfg["hidden_size"]
    backbone = [_NEMOTRON_TYPES[t] for t in cfg["layers_block_type"]]
    kinds = [_NEMOTRON_TYPES[t] for t in cfg["mtp_layers_block_type"]]
    shapes = {"mtp.layers.0.enorm.weight": (h,), "mtp.layers.0.hnorm.weight": (h,),
              "mtp.layers.0.eh_proj.weight": (h, 2 * h), f"mtp.layers.{len(kinds) - 1}.final_layernorm.weight": (h,)}
    for i, kind in enumerate(kinds):
        prefix = f"backbone.layers.{backbone.index(kind)}."
        for key, t in tensors.items():
            if key.startswith(prefix):
                shapes[f"mtp.layers.{i}." + key[len(prefix):]] = t.shape
    return shapes


def mtp_tensor_shapes(name):
    """{checkpoint name: shape} of the ``mtp.*`` tensors of fixture `name` with one MTP layer."""
    cfg = json.load(open(os.path.join(DATA, name, "config.json")))
    tensors = load_file(os.path.join(DATA, name, "model.safetensors"))
    return (_nemotron_mtp_shapes if cfg["model_type"] == "nemotron_h" else _qwen_mtp_shapes)(cfg, tensors)


MTP_CONFIG_KEY = {"qwen3_5_tiny": "mtp_num_hidden_layers", "qwen3_next_tiny": "num_nextn_predict_layers",
                  "nemotron_h_tiny": "num_nextn_predict_layers"}


def with_mtp_tensors(name, tmp_path, *, seed=0, declare=1):
    """A copy of fixture `name` in tmp_path with random ``mtp.*`` tensors and `declare` MTP layers
    in config.json (under the key its checkpoints use). Norm weights are random around their
    neutral value (0 for Qwen's zero-centered norms, 1 for Nemotron-H's), so that the two input
    norms differ; the other tensors are random of the scale of the backbone's."""
    dst = _copy(name, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    rng = np.random.default_rng(seed)
    nemotron = name.startswith("nemotron")
    for key, shape in mtp_tensor_shapes(name).items():
        if len(shape) == 1 and key.endswith("norm.weight"):
            value = (1.0 if nemotron else 0.0) + 0.3 * rng.standard_normal(shape)
        else:
            value = 0.05 * rng.standard_normal(shape)
        tensors[key] = value.astype(np.float32)
    save_file(tensors, dst / "model.safetensors")
    _edit_config(dst, lambda c: c.__setitem__(MTP_CONFIG_KEY[name], declare))
    return dst


def _edit_config(dst, fn):
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))


def _rewrite(dst, fn):
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors")


_LOADED: dict = {}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """name -> (model with its MTP head, the checkpoint folder), loaded once per module."""

    def get(name):
        if name not in _LOADED:
            dst = with_mtp_tensors(name, tmp_path_factory.mktemp(name))
            _LOADED[name] = load_model(dst, mtp=True), dst
        return _LOADED[name]

    return get


def head_checkpoint_names(model):
    """{checkpoint name: shape} of ``model.mtp``'s parameters, stacked experts [E, ...] as per-expert names."""
    names = {}
    for path, var in nnx.to_flat_state(nnx.state(model.mtp)):
        name = "mtp." + ".".join(str(p) for p in path)
        m = re.fullmatch(r"(.*\.experts)\.(gate_proj|up_proj|down_proj)", name)
        if m:
            names.update({f"{m[1]}.{e}.{m[2]}.weight": tuple(var.shape[1:]) for e in range(var.shape[0])})
        else:
            names[name] = tuple(var.shape)
    return names


# ------------------------------------------------------------------------------------------------
# the head's parameters and loading


def test_head_parameter_names_are_the_released_checkpoint_names():
    """Literal names (Qwen3.5's dense head; Nemotron-H's attention + MoE head)."""
    qwen = abstract_model_with_head("qwen3_5_tiny")
    assert sorted(head_checkpoint_names(qwen)) == sorted([
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
        "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.k_proj.weight",
        "mtp.layers.0.self_attn.v_proj.weight", "mtp.layers.0.self_attn.o_proj.weight",
        "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
        "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.mlp.up_proj.weight", "mtp.layers.0.mlp.down_proj.weight"])
    assert head_checkpoint_names(qwen)["mtp.fc.weight"] == (64, 128)
    nemotron = abstract_model_with_head("nemotron_h_tiny")
    experts = [f"mtp.layers.1.mixer.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("up", "down")]
    assert sorted(head_checkpoint_names(nemotron)) == sorted([
        "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.0.mixer.k_proj.weight",
        "mtp.layers.0.mixer.v_proj.weight", "mtp.layers.0.mixer.o_proj.weight", "mtp.layers.1.norm.weight",
        "mtp.layers.1.mixer.gate.weight", "mtp.layers.1.mixer.gate.e_score_correction_bias",
        "mtp.layers.1.mixer.shared_experts.up_proj.weight", "mtp.layers.1.mixer.shared_experts.down_proj.weight",
        "mtp.layers.1.final_layernorm.weight", *experts])


def abstract_model_with_head(name):
    """The model of fixture `name` with one MTP layer declared and its head, abstract (no weights)."""
    cfg = json.load(open(os.path.join(DATA, name, "config.json")))
    cfg[MTP_CONFIG_KEY[name]] = 1
    family, config = registry.parse(cfg, source=name)
    return nnx.eval_shape(lambda: add_mtp_head(family.model_class(config)))


@pytest.mark.parametrize("name", HEAD_FIXTURES)
def test_head_parameters_match_the_fixture_tensors(name):
    """Every ``mtp.*`` tensor the fixture utility writes (derived from the backbone's names) is
    a parameter of the head, with its shape, and the head has no other parameter."""
    model = abstract_model_with_head(name)
    assert head_checkpoint_names(model) == {k: tuple(s) for k, s in mtp_tensor_shapes(name).items()}


@pytest.mark.parametrize("name", HEAD_FIXTURES)
def test_load_with_and_without_mtp(name, loaded):
    model, dst = loaded(name)
    head = {"nemotron_h_tiny": NemotronHMTPHead}.get(name, QwenMTPHead)
    assert isinstance(model.mtp, head)
    tensors = load_file(dst / "model.safetensors")
    names = head_checkpoint_names(model)
    assert set(names) == {k for k in tensors if k.startswith("mtp.")}
    state = dict(nnx.to_flat_state(nnx.state(model)))
    for key, t in tensors.items():
        if not key.startswith("mtp."):
            continue
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", key)
        path = tuple(int(p) if p.isdigit() else p for p in (m[1] + "." + m[3] if m else key).split("."))
        value = np.asarray(state[path][...])
        np.testing.assert_array_equal(value[int(m[2])] if m else value, t, err_msg=key)
    plain = load_model(dst)
    assert plain.mtp is None
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    for each in (model, plain):
        logits = jax.jit(lambda g, p, ids: nnx.merge(g, p)(ids), static_argnums=0)(*split_params(each),
                                                                                  jnp.asarray(ref["prompt_ids"]))
        assert np.max(np.abs(np.asarray(logits) - ref["prefill_logits"])) < 1e-4


def test_mtp_requested_from_a_checkpoint_without_mtp_tensors():
    path = os.path.join(DATA, "qwen3_5_tiny")
    with pytest.raises(CheckpointError, match=re.escape(path) + r".*no tensors under the prefix 'mtp\.'"):
        load_model(path, mtp=True)


@pytest.mark.parametrize("name, key", [("qwen3_5_tiny", "mtp.pre_fc_norm_hidden.weight"),
                                       ("qwen3_next_tiny", "mtp.layers.0.mlp.experts.1.up_proj.weight"),
                                       ("nemotron_h_tiny", "mtp.layers.1.final_layernorm.weight")])
def test_missing_mtp_tensor_is_named(tmp_path, name, key):
    dst = with_mtp_tensors(name, tmp_path)
    _rewrite(dst, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{re.escape(key)}'"):
        load_model(dst, mtp=True)


def test_mtp_shape_mismatch_and_unexpected_tensor_are_named(tmp_path):
    dst = with_mtp_tensors("qwen3_5_tiny", tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("mtp.fc.weight", np.zeros((64, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"tensor 'mtp.fc.weight' has shape \(64, 64\); "
                                              r"Qwen3_5ForCausalLM expects \(64, 128\)"):
        load_model(dst, mtp=True)
    load_model(dst)  # without the head, the mtp.* tensors are skipped
    dst = with_mtp_tensors("nemotron_h_tiny", tmp_path / "second")
    _rewrite(dst, lambda t: t.__setitem__("mtp.layers.2.norm.weight", np.ones(32, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*'mtp.layers.2.norm.weight'"):
        load_model(dst, mtp=True)


@pytest.mark.parametrize("name, edit, message", [
    ("qwen3_5_tiny", {"mtp_num_hidden_layers": 0}, r"'mtp_num_hidden_layers' .* = 0: the config declares no MTP"),
    ("qwen3_next_tiny", {"num_nextn_predict_layers": 2},
     r"'mtp_num_hidden_layers' \(or 'num_nextn_predict_layers'\) = 2: only one MTP layer is supported"),
    ("qwen3_5_tiny", {"mtp_use_dedicated_embeddings": True}, r"'mtp_use_dedicated_embeddings' is true"),
    ("nemotron_h_tiny", {"num_nextn_predict_layers": 0}, r"'num_nextn_predict_layers' = 0"),
    ("nemotron_h_tiny", {"mtp_layers_block_type": ["mamba", "attention"]}, r"Mamba-2 blocks in the MTP head"),
    ("nemotron_h_tiny", {"mtp_layers_block_type": ["moe"]}, r"has no attention block"),
    ("nemotron_h_tiny", {"mtp_layers_block_type": ["attention", "X"]},
     r"key 'mtp_layers_block_type': unknown layer type 'X' at layer 1"),
])
def test_mtp_config_errors_name_the_key(tmp_path, name, edit, message):
    dst = with_mtp_tensors(name, tmp_path)
    _edit_config(dst, lambda c: c.update(edit))
    with pytest.raises(ConfigError, match=re.escape(str(dst / "config.json")) + ".*" + message):
        load_model(dst, mtp=True)


def test_mtp_config_keys_as_transformers_and_vllm_read_them():
    qwen = json.load(open(os.path.join(DATA, "qwen3_next_tiny", "config.json")))
    assert QwenHybridConfig.from_hf_config(qwen).mtp_num_hidden_layers == 1  # absent: vLLM's default
    assert QwenHybridConfig.from_hf_config({**qwen, "num_nextn_predict_layers": 0}).mtp_num_hidden_layers == 0
    nemo = json.load(open(os.path.join(DATA, "nemotron_h_tiny", "config.json")))
    assert NemotronHConfig.from_hf_config(nemo).num_nextn_predict_layers == 0
    legacy = {k: v for k, v in nemo.items() if k != "mtp_layers_block_type"}
    legacy.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E-")
    assert NemotronHConfig.from_hf_config(legacy).mtp_layer_types == ("attention", "moe", "mlp")
    default = {k: v for k, v in nemo.items() if k != "mtp_layers_block_type"}
    assert NemotronHConfig.from_hf_config({**default, "num_nextn_predict_layers": 1}).mtp_layer_types == (
        "attention", "moe")
    with pytest.raises(ConfigError, match="model_type 'mamba2' has no multi-token prediction head"):
        check_config(load_model(os.path.join(DATA, "mamba2_tiny")).config, "mamba2_tiny")
    with pytest.raises(TypeError, match="`mtp` must be a bool; got str 'yes'"):
        load_model(os.path.join(DATA, "qwen3_5_tiny"), mtp="yes")


# ------------------------------------------------------------------------------------------------
# the target's hidden state


# Qwen3.5 by default: `return_hidden` is the models' shared code around each family's final norm and LM head,
# which tests/test_model_verify.py::test_verify_returns_the_final_normed_hidden_states checks on Nemotron-H's
# (mamba2_tiny) by default; nemotron_h_tiny `slow`.
@pytest.mark.parametrize("name", ["qwen3_5_tiny", pytest.param("nemotron_h_tiny", marks=pytest.mark.slow)])
def test_prefill_and_decode_return_the_final_normed_hidden_state(name, loaded):
    model, _ = loaded(name)
    ref = np.load(os.path.join(DATA, name, "reference.npz"))
    prompt, full = jnp.asarray(ref["prompt_ids"]), jnp.asarray(ref["generated_ids"])
    T = prompt.shape[1]
    graphdef, params = split_params(model)
    logits, cache = make_prefill(graphdef, max_len=T + 2)(params, prompt)
    logits_h, hidden, cache_h = make_prefill(graphdef, max_len=T + 2, return_hidden=True)(params, prompt)
    np.testing.assert_array_equal(np.asarray(logits_h), np.asarray(logits))
    assert hidden.shape == (prompt.shape[0], T, model.config.hidden_size)
    np.testing.assert_allclose(np.asarray(model._lm_head(hidden)), np.asarray(logits), atol=1e-5)
    # After the final norm: hidden / scale has unit RMS at every position.
    norm = model.model.norm if hasattr(model, "model") else model.backbone.norm_f
    scale = np.asarray(norm.weight[...]) + (1.0 if norm.zero_centered else 0.0)
    rms = np.sqrt(np.mean((np.asarray(hidden) / scale) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, atol=1e-3)
    step = make_decode_step(graphdef, return_hidden=True)
    last, cache_last = make_decode_step(graphdef)(params, cache, full[:, T])
    step_logits, step_hidden, cache_step = step(params, cache_h, full[:, T])
    np.testing.assert_array_equal(np.asarray(step_logits), np.asarray(last))
    assert jax.tree.structure(cache_step) == jax.tree.structure(cache_last)
    # One more prompt token: its hidden states (every position, also with last_logits_only) and its
    # last logits are the decode step's.
    prefill_last = make_prefill(graphdef, max_len=T + 2, return_hidden=True, last_logits_only=True)
    longer_logits, longer, _ = prefill_last(params, full[:, :T + 1])
    assert longer.shape == (prompt.shape[0], T + 1, model.config.hidden_size)
    np.testing.assert_allclose(np.asarray(step_hidden), np.asarray(longer[:, T]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(longer_logits), np.asarray(step_logits), atol=1e-4)


# ------------------------------------------------------------------------------------------------
# the head's formula


def _rms(x, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _reference_head(model, hidden, tokens, *, swap_concat=False, swap_norms=False):
    """The documented formula in NumPy around the library's decoder blocks (full causal forward from
    position 0): e = norm_e(E[token]), h = norm_h(hidden), x = proj(concat(e, h)), blocks, final norm,
    the target's LM head. `swap_concat` / `swap_norms` give the two wrong variants."""
    head, cfg = model.mtp, model.config
    qwen = isinstance(head, QwenMTPHead)
    w = lambda mod: np.asarray(mod.weight[...], np.float64)  # noqa: E731
    if qwen:
        eps = cfg.rms_norm_eps
        norm_e, norm_h, proj = 1 + w(head.pre_fc_norm_embedding), 1 + w(head.pre_fc_norm_hidden), w(head.fc)
        embed = w(model.model.embed_tokens)
    else:
        eps, first = cfg.layer_norm_epsilon, head.layers[0]
        norm_e, norm_h, proj = w(first.enorm), w(first.hnorm), w(first.eh_proj)
        embed = w(model.backbone.embeddings)
    if swap_norms:
        norm_e, norm_h = norm_h, norm_e
    e = _rms(embed[np.asarray(tokens)], eps) * norm_e
    h = _rms(hidden, eps) * norm_h
    x = (np.concatenate([h, e] if swap_concat else [e, h], axis=-1) @ proj.T).astype(np.float32)
    x = jnp.asarray(x)
    for block in head.layers:
        x = block(x)
    if qwen:
        out = _rms(x, eps) * (1 + w(head.norm))
    else:
        out = _rms(x, eps) * w(head.layers[len(head.layers) - 1].final_layernorm)
    lm = w(model.lm_head) if model.lm_head is not None else embed
    return out @ lm.T, out


def _random_inputs(rng, model, batch, T):
    hidden = rng.standard_normal((batch, T, model.config.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, model.config.vocab_size, (batch, T)).astype(np.int32)
    return jnp.asarray(hidden), jnp.asarray(tokens)


def _empty_cache(model, batch, max_len):
    return MTPCache.zeros(model.mtp.kv_layout(), batch, max_len)


_head = jax.jit(lambda graphdef, params, hidden, tokens, cache: mtp_forward(nnx.merge(graphdef, params), hidden,
                                                                            tokens, cache), static_argnums=0)


def head(model, hidden, tokens, cache):
    """`mtp_forward` under jit (one compile per shape)."""
    return _head(*split_params(model), hidden, tokens, cache)


_propose = jax.jit(MTPDrafter.propose)


def propose(drafter, params, hidden, tokens, cache, key=None, num_tokens=None):
    """`MTPDrafter.propose` under jit (the drafter is a static pytree)."""
    return _propose(drafter, params, hidden, tokens, cache, key, num_tokens=num_tokens)


# One fixture per head class by default (Qwen's on qwen3_next_tiny, Nemotron-H's); qwen3_5_tiny `slow`: the
# same head class and formula (its blocks are the library's, which the reference runs too).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "qwen3_5_tiny" else n
                                  for n in HEAD_FIXTURES])
def test_head_forward_matches_the_formula(name, loaded, rng):
    model, _ = loaded(name)
    hidden, tokens = _random_inputs(rng, model, 2, 5)
    logits, out, cache = head(model, hidden, tokens, _empty_cache(model, 2, 8))
    ref_logits, ref_out = _reference_head(model, hidden, tokens)
    err = np.max(np.abs(np.asarray(logits) - ref_logits))
    assert err < 1e-4, f"{name}: logits max abs err {err:.3g}"
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.length), [5, 5])
    # The order of the concatenation and the pairing of the norms are both visible in the output.
    for wrong in (dict(swap_concat=True), dict(swap_norms=True)):
        assert np.max(np.abs(np.asarray(logits) - _reference_head(model, hidden, tokens, **wrong)[0])) > 100 * err


@pytest.mark.parametrize("name", ["qwen3_next_tiny", "nemotron_h_tiny"])
def test_head_cache_continuity(name, loaded, rng):
    """T positions in one call equal T calls of one position each (through the KV cache)."""
    model, _ = loaded(name)
    hidden, tokens = _random_inputs(rng, model, 2, 6)
    logits, _, cache = head(model, hidden, tokens, _empty_cache(model, 2, 8))
    step_cache = _empty_cache(model, 2, 8)
    for t in range(6):
        step_logits, _, step_cache = head(model, hidden[:, t:t + 1], tokens[:, t:t + 1], step_cache)
        np.testing.assert_allclose(np.asarray(step_logits[:, 0]), np.asarray(logits[:, t]), atol=1e-5)
    for a, b in zip(jax.tree.leaves(step_cache), jax.tree.leaves(cache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# the drafter


def _chained_reference(model, hidden, tokens, n, k):
    """Reference of k chained greedy drafts: each step re-runs the head from an empty cache over
    each row's whole sequence (its n[b] target positions, then the head's own outputs and drafts),
    zero-padded to a fixed length (the head is causal). Returns (drafts [batch, k], the logits of
    the first draft [batch, vocab])."""
    batch, _, width = hidden.shape
    length = int(max(n)) + k
    seq_h, seq_t = np.zeros((batch, length, width), np.float32), np.zeros((batch, length), np.int32)
    for b in range(batch):
        seq_h[b, :n[b]], seq_t[b, :n[b]] = hidden[b, :n[b]], tokens[b, :n[b]]
    rows, drafts, first = np.arange(batch), np.zeros((batch, k), np.int32), None
    for j in range(k):
        logits, out, _ = head(model, jnp.asarray(seq_h), jnp.asarray(seq_t), _empty_cache(model, batch, length))
        at = np.asarray(n) - 1 + j
        step_logits = np.asarray(logits)[rows, at]
        first = step_logits if j == 0 else first
        drafts[:, j] = np.argmax(step_logits, axis=-1)
        seq_h[rows, at + 1], seq_t[rows, at + 1] = np.asarray(out)[rows, at], drafts[:, j]
    return drafts, jnp.asarray(first)


@pytest.mark.parametrize("name", ["qwen3_next_tiny", "nemotron_h_tiny"])
def test_greedy_drafts_are_the_chained_argmax(name, loaded, rng):
    model, _ = loaded(name)
    drafter = MTPDrafter.for_model(model, 3)
    _, params = split_params(model)
    hidden, tokens = _random_inputs(rng, model, 2, 5)
    n = np.array([5, 3])
    drafts, cache = propose(drafter, params, hidden, tokens, drafter.init_cache(2, 12), num_tokens=jnp.asarray(n))
    assert isinstance(drafts, Drafts) and drafts.q_probs is None
    np.testing.assert_array_equal(np.asarray(drafts.num_drafts), [3, 3])
    np.testing.assert_array_equal(np.asarray(drafts.tokens), _chained_reference(model, hidden, tokens, n, 3)[0])
    np.testing.assert_array_equal(np.asarray(cache.length), n)  # the committed entries; drafts' are dead
    # One position per row ([batch, hidden], [batch]): the same as T = 1.
    one, _ = propose(drafter, params, hidden[:, 0], tokens[:, 0], drafter.init_cache(2, 12))
    ref, _ = propose(drafter, params, hidden[:, :1], tokens[:, :1], drafter.init_cache(2, 12))
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(ref.tokens))


def test_sampled_drafts_carry_their_distribution(loaded, rng):
    model, _ = loaded("qwen3_5_tiny")
    sampling = SamplingParams(temperature=0.7, top_k=40)
    drafter = MTPDrafter.for_model(model, 4, sampling=sampling)
    _, params = split_params(model)
    hidden, tokens = _random_inputs(rng, model, 3, 4)
    cache = drafter.init_cache(3, 10)
    key = jax.random.key(int(rng.integers(1 << 31)))
    drafts, _ = propose(drafter, params, hidden, tokens, cache, key)
    q = np.asarray(drafts.q_probs)
    assert q.shape == (3, 4, model.config.vocab_size)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    chosen = np.take_along_axis(q, np.asarray(drafts.tokens)[..., None], axis=-1)[..., 0]
    assert (chosen > 0).all()
    assert ((q > 0).sum(-1) <= 40).all()  # top-k applied
    _, first_logits = _chained_reference(model, hidden, tokens, [4, 4, 4], 1)
    np.testing.assert_allclose(q[:, 0], np.exp(np.asarray(token_log_probs(first_logits, sampling))), atol=1e-5)
    again, _ = propose(drafter, params, hidden, tokens, cache, key)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(drafts.tokens))
    with pytest.raises(TypeError, match="`key` must be one PRNG key"):
        drafter.propose(params, hidden, tokens, cache)


def test_rollback_restores_the_length(loaded, rng):
    model, _ = loaded("qwen3_next_tiny")
    drafter = MTPDrafter.for_model(model, 3)
    _, params = split_params(model)
    hidden, tokens = _random_inputs(rng, model, 2, 6)
    _, cache0 = propose(drafter, params, hidden[:, :4], tokens[:, :4], drafter.init_cache(2, 16),
                        num_tokens=jnp.array([4, 2]))
    drafts1, cache1 = propose(drafter, params, hidden[:, 4:], tokens[:, 4:], cache0, num_tokens=jnp.array([2, 1]))
    np.testing.assert_array_equal(np.asarray(cache1.length), [6, 3])
    back = drafter.rollback(cache1, cache0.length)
    np.testing.assert_array_equal(np.asarray(back.length), [4, 2])
    for a, b in zip(jax.tree.leaves(back.layers[0].k), jax.tree.leaves(cache1.layers[0].k)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    drafts2, cache2 = propose(drafter, params, hidden[:, 4:], tokens[:, 4:], back, num_tokens=jnp.array([2, 1]))
    np.testing.assert_array_equal(np.asarray(drafts2.tokens), np.asarray(drafts1.tokens))
    for a, b in zip(jax.tree.leaves(cache2), jax.tree.leaves(cache1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    with pytest.raises(ValueError, match=r"`lengths` must be in \[0, 6\] for every row; got \[7, 0\]"):
        drafter.rollback(cache1, np.array([7, 0]))
    with pytest.raises(ValueError, match=r"`lengths` must have shape \[batch\] = \(2,\); got \(3,\)"):
        drafter.rollback(cache1, np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="`lengths` must have an integer dtype"):
        drafter.rollback(cache1, np.zeros(2, np.float32))


def test_propose_and_rollback_under_jit_with_fixed_shapes(loaded, rng):
    """One trace for two rounds of new values; the same results as the eager (unjitted) call."""
    model, _ = loaded("qwen3_5_tiny")
    drafter = MTPDrafter.for_model(model, 2)
    _, params = split_params(model)
    traces = []

    @jax.jit
    def round_(drafter, params, hidden, tokens, cache, num_tokens):
        traces.append(1)
        drafts, cache = drafter.propose(params, hidden, tokens, cache, num_tokens=num_tokens)
        return drafts, cache, drafter.rollback(cache, cache.length - 1)

    cache = drafter.init_cache(2, 12)
    for n in ([3, 1], [2, 3]):
        hidden, tokens = _random_inputs(rng, model, 2, 3)
        drafts, new, back = round_(drafter, params, hidden, tokens, cache, jnp.asarray(n, jnp.int32))
        eager, eager_cache = drafter.propose(params, hidden, tokens, cache, num_tokens=np.array(n))
        np.testing.assert_array_equal(np.asarray(drafts.tokens), np.asarray(eager.tokens))
        np.testing.assert_array_equal(np.asarray(new.length), np.asarray(eager_cache.length))
        np.testing.assert_array_equal(np.asarray(back.length), np.asarray(eager_cache.length) - 1)
        cache = new
    assert len(traces) == 1


def test_bad_propose_arguments_are_named_and_leave_the_cache_usable(loaded, rng):
    model, _ = loaded("qwen3_5_tiny")
    drafter = MTPDrafter.for_model(model, 3)
    _, params = split_params(model)
    hidden, tokens = _random_inputs(rng, model, 2, 4)
    cache = drafter.init_cache(2, 8)
    cases = [
        (ValueError, r"`hidden` must have shape \[batch, T, hidden\] with hidden = 64; got \(2, 4, 32\)",
         dict(hidden=hidden[..., :32])),
        (TypeError, r"`hidden` must have a floating-point dtype", dict(hidden=tokens[..., None])),
        (ValueError, r"`tokens` must have shape \[batch, T\] = \(2, 4\); got \(2, 3\)", dict(tokens=tokens[:, :3])),
        (ValueError, r"`tokens` has token id 256 outside the vocabulary", dict(tokens=tokens.at[0, 1].set(256))),
        (TypeError, r"`tokens` must be an integer array", dict(tokens=hidden[..., 0])),
        (ValueError, r"`num_tokens` must be in \[1, 4\] for every row; got \[0, 4\]", dict(num_tokens=[0, 4])),
        (ValueError, r"`cache.layers\[0\].k` must have shape \[batch, max_len, num_key_value_heads, head_dim\] = "
                     r"\(2, 8, 2, 16\); got \(3, 8, 2, 16\)", dict(cache=drafter.init_cache(3, 8))),
        (TypeError, r"`cache` must be an MTPCache", dict(cache=None)),
        (ValueError, r"`cache` is too short: row 0 holds 0 entries and needs 6 .* max_len = 5",
         dict(cache=drafter.init_cache(2, 5))),
    ]
    for error, message, bad in cases:
        args = {**dict(hidden=hidden, tokens=tokens, cache=cache, num_tokens=None), **bad}
        with pytest.raises(error, match=message):
            drafter.propose(params, args["hidden"], args["tokens"], args["cache"], num_tokens=args["num_tokens"])
    drafts, after = drafter.propose(params, hidden, tokens, cache)
    assert drafts.tokens.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(cache.length), [0, 0])
    np.testing.assert_array_equal(np.asarray(after.length), [4, 4])
    with pytest.raises(ValueError, match=r"has no MTP head; load it with models.load_model\(path, mtp=True\)"):
        MTPDrafter.for_model(load_model(os.path.join(DATA, "qwen3_5_tiny")), 3)
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be >= 1; got 0"):
        MTPDrafter.for_model(model, 0)
    with pytest.raises(ValueError, match="`max_len` must be >= 1; got 0"):
        drafter.init_cache(2, 0)


# ------------------------------------------------------------------------------------------------
# a speculative round


# `slow`: the head's cache follows the target through speculative rounds by default in the compiled loop
# (tests/test_speculative_model_drafters.py::test_mtp_head_cache_follows_the_target_through_the_loop,
# Nemotron-H's head), and the Qwen head's drafts and cache over calls with per-row counts in
# test_greedy_drafts_are_the_chained_argmax and test_rollback_restores_the_length.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_next_tiny", "nemotron_h_tiny"])
def test_speculative_rounds_keep_the_head_cache_aligned(name, loaded, rng):
    """Greedy speculative decoding, the target verified by its full causal forward (prefill of the
    zero-padded sequence, return_hidden). Row 0 drafts the target's own greedy continuation (all
    accepted, m = K + 1), row 1 the MTP head's drafts (random weights: few accepted), so the rows
    commit different counts. The tokens are plain greedy decoding's, the head's cache length follows
    the target's position, and its entries equal one head pass over the committed sequence (the
    target's hidden states, the tokens one later)."""
    model, _ = loaded(name)
    k, batch, prompt_len, rounds = 3, 2, 5, 4
    total = prompt_len + rounds * (k + 1) + k + 1
    graphdef, params = split_params(model)
    forward = jax.jit(lambda p, ids: nnx.merge(graphdef, p).prefill(ids, ids.shape[1], return_hidden=True)[:2])
    greedy = np.zeros((batch, total), np.int32)
    greedy[:, :prompt_len] = rng.integers(0, model.config.vocab_size, (batch, prompt_len))
    for t in range(prompt_len, total):
        greedy[:, t] = np.argmax(np.asarray(forward(params, jnp.asarray(greedy))[0][:, t - 1]), axis=-1)

    drafter = MTPDrafter.for_model(model, k)
    seq = np.zeros_like(greedy)
    seq[:, :prompt_len + 1] = greedy[:, :prompt_len + 1]  # the prompt and the first new token
    position = np.full(batch, prompt_len)  # tokens the target has consumed; seq[:, position] comes next
    _, hidden = forward(params, jnp.asarray(seq))
    cache = drafter.init_cache(batch, total)
    drafts, cache = propose(drafter, params, hidden[:, :prompt_len], jnp.asarray(seq[:, 1:prompt_len + 1]), cache)
    counts = []
    for _ in range(rounds):
        tokens = np.asarray(drafts.tokens).copy()
        tokens[0] = greedy[0, position[0] + 1:position[0] + 1 + k]
        for b in range(batch):
            seq[b, position[b] + 1:position[b] + 1 + k] = tokens[b]
        logits, hidden = forward(params, jnp.asarray(seq))
        window = jnp.asarray(position[:, None] + np.arange(k + 1)[None, :])[..., None]  # positions p .. p + K
        accepted = greedy_acceptance(jnp.take_along_axis(logits, window, axis=1), tokens, drafts.num_drafts)
        m = np.asarray(accepted.num_accepted)
        counts.append(m)
        for b in range(batch):
            seq[b, position[b] + 1:] = 0
            seq[b, position[b] + 1:position[b] + 1 + m[b]] = np.asarray(accepted.tokens[b, :m[b]])
        drafts, cache = propose(drafter, params, jnp.take_along_axis(hidden, window, axis=1), accepted.tokens, cache,
                                num_tokens=jnp.asarray(m))
        position = position + m
        np.testing.assert_array_equal(np.asarray(cache.length), position)
    assert all(c[0] == k + 1 for c in counts)
    for b in range(batch):
        np.testing.assert_array_equal(seq[b, :position[b] + 1], greedy[b, :position[b] + 1])
    _, hidden = forward(params, jnp.asarray(seq))
    n = int(position.min())
    _, _, full = head(model, hidden[:, :n], jnp.asarray(seq[:, 1:n + 1]), _empty_cache(model, batch, n))
    for got, want in zip(cache.layers, full.layers):
        if got is not None:
            np.testing.assert_allclose(np.asarray(got.k[:, :n]), np.asarray(want.k), atol=1e-5)
            np.testing.assert_allclose(np.asarray(got.v[:, :n]), np.asarray(want.v), atol=1e-5)
