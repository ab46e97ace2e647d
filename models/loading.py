"""Loading Hugging Face checkpoints: config.json + safetensors -> Flax NNX model.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json`` with its shards. `load_model` reads
the config, picks the model family from ``model_type``, builds the module
abstractly (``nnx.eval_shape``: no weights allocated twice) and fills every
parameter from the checkpoint by name.

The name mapping is strict: a parameter without a tensor, a tensor that no
parameter takes (beyond the documented ignores, e.g. ``mtp.*`` multi-token
prediction heads that transformers also skips) and a tensor of the wrong shape
each raise `CheckpointError` naming the file, the key and the shapes.

Per-expert checkpoint tensors (``...experts.{e}.up_proj.weight``) are stacked
into the model's [E, out, in] expert parameters.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from models.config import ConfigError

__all__ = ["CheckpointError", "CheckpointNotFoundError", "TensorSource", "read_config", "load_params",
           "load_model", "MODEL_TYPES"]

#: Parameters kept in float32 when a lower `dtype` is requested (the SSM dynamics and router bias).
KEEP_FP32 = frozenset({"A_log", "dt_bias", "D", "e_score_correction_bias"})


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model built from its config."""


class CheckpointNotFoundError(FileNotFoundError):
    """A checkpoint folder without config.json or safetensors weights."""


def read_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of checkpoint folder `path`.

    Raises:
      CheckpointNotFoundError: `path` is not a folder or has no config.json.
      ConfigError: config.json is not a JSON object.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint folder {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointNotFoundError(f"{cfg_path}: no such file (a Hugging Face checkpoint folder needs config.json)")
    with open(cfg_path, "rb") as f:
        try:
            d = json.loads(f.read().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object; found {type(d).__name__}")
    return d


class TensorSource:
    """Lazy access to the safetensors tensors of a checkpoint folder (single file or sharded).

    ``keys()``: all tensor names; ``file_of(key)``: its file; ``shape(key)``: its shape
    (read from the header); ``get(key)``: the numpy array.

    Raises (constructor):
      CheckpointNotFoundError: neither model.safetensors nor model.safetensors.index.json,
        or a shard named by the index is missing.
      CheckpointError: a malformed index.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self._file_of: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        if os.path.isfile(index):
            with open(index, "rb") as f:
                try:
                    weight_map = json.loads(f.read().decode("utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"{index}: not valid JSON ({e})") from None
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: missing or malformed 'weight_map'")
            for fname in sorted(set(weight_map.values())):
                fpath = os.path.join(path, fname)
                if not os.path.isfile(fpath):
                    raise CheckpointNotFoundError(f"{fpath}: shard named by {index} does not exist")
            self._file_of = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            self._file_of = {k: single for k in self._handle(single).keys()}
        else:
            raise CheckpointNotFoundError(
                f"{path}: no model.safetensors or model.safetensors.index.json (safetensors weights are required)")

    def _handle(self, fname):
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(fname, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{fname}: not a readable safetensors file ({e})") from None
        return self._handles[fname]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def file_of(self, key: str) -> str:
        return self._file_of[key]

    def _read(self, key: str, what):
        fname = self._file_of[key]
        try:
            return what(self._handle(fname))
        except SafetensorError as e:
            raise CheckpointError(f"{fname}: cannot read tensor {key!r} ({e})") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._read(key, lambda f: f.get_slice(key).get_shape()))

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of `key` (e.g. "F32", "BF16", "I64")."""
        return self._read(key, lambda f: f.get_slice(key).get_dtype())

    def get(self, key: str) -> np.ndarray:
        return self._read(key, lambda f: f.get_tensor(key))


_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def _describe(src: TensorSource) -> str:
    files = sorted({os.path.basename(f) for f in src._file_of.values()})
    return ", ".join(files) if len(files) <= 3 else f"{files[0]} ... ({len(files)} shards)"


def load_params(model_factory: Callable[[], nnx.Module], src: TensorSource, *,
                checkpoint_key: Callable[[str], str | None] = lambda k: k, dtype=None,
                model_name: str = "model") -> nnx.Module:
    """Build ``model_factory()`` with its parameters read from `src`.

    Args:
      model_factory: zero-argument constructor of the NNX model (called under
        ``nnx.eval_shape``, so nothing is allocated).
      src: the checkpoint tensors.
      checkpoint_key: maps a checkpoint tensor name to the model's name for it
        (e.g. a prefix rename), or None to skip the tensor on purpose.
      dtype: None keeps each tensor's dtype; else floating tensors are cast to it
        (except `KEEP_FP32` parameters, kept in float32).
      model_name: used in error messages.

    Returns:
      The model, every parameter filled.

    Raises:
      CheckpointError: a missing tensor, an unexpected tensor, or a shape mismatch
        (naming the file, the key, and the expected and found shapes).
    """
    abstract = nnx.eval_shape(model_factory)
    graphdef, state = nnx.split(abstract)
    available: dict[str, str] = {}
    for key in src.keys():
        name = checkpoint_key(key)
        if name is None:
            continue
        if name in available:
            raise CheckpointError(f"{src.path}: tensors {available[name]!r} and {key!r} both map to the parameter "
                                  f"{name!r} of {model_name}")
        available[name] = key
    used: set[str] = set()
    where = f"{src.path} ({_describe(src)})"

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = available.get(name)
        if key is None:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {shape}) for {model_name}")
        found = src.shape(key)
        if found != shape:
            raise CheckpointError(f"{src.file_of(key)}: tensor {key!r} has shape {found}; {model_name} expects "
                                  f"{shape}")
        kind = src.dtype(key)
        if not (kind.startswith("F") or kind.startswith("BF")):
            raise CheckpointError(f"{src.file_of(key)}: tensor {key!r} has dtype {kind}; {model_name} expects a "
                                  f"floating dtype (F16, BF16, F32, F64)")
        used.add(name)
        return src.get(key)

    leaves = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        shape = tuple(var.shape)
        m = _EXPERT_PARAM.match(name)
        if m and len(shape) == 3 and name not in available:
            per = [fetch(f"{m['prefix']}.{e}.{m['proj']}.weight", shape[1:]) for e in range(shape[0])]
            arr = np.stack(per)
        else:
            arr = fetch(name, shape)
        leaf = path[-1]
        if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
            arr = jnp.asarray(arr).astype(jnp.float32 if leaf in KEEP_FP32 else dtype)
        leaves.append((path, var.replace(jnp.asarray(arr))))
    unexpected = sorted(available[n] for n in set(available) - used)
    if unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:10])
        more = f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""
        raise CheckpointError(f"{where}: unexpected tensor(s) {shown}{more}: {model_name} has no parameter for them")
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def check_dtypes(dtype, ssm_state_dtype) -> None:
    """Raise TypeError unless `dtype` is None or floating and `ssm_state_dtype` is float32 or bfloat16."""
    try:
        ok = dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"`dtype` must be None or a floating dtype (float32, bfloat16); got {dtype!r}")
    try:
        ok = jnp.dtype(ssm_state_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"`ssm_state_dtype` must be float32 or bfloat16; got {ssm_state_dtype!r}")


def _families():
    from models import nemotron_h, qwen_hybrid

    return {
        "mamba2": nemotron_h.load,
        "nemotron_h": nemotron_h.load,
        "qwen3_next": qwen_hybrid.load,
        "qwen3_5_text": qwen_hybrid.load,
        "qwen3_5": qwen_hybrid.load,
    }


MODEL_TYPES = ("mamba2", "nemotron_h", "qwen3_next", "qwen3_5_text", "qwen3_5")


def load_model(path: str | os.PathLike, dtype=None, *, ssm_state_dtype=jnp.float32) -> nnx.Module:
    """Load a Hugging Face checkpoint folder as a Flax NNX model.

    Args:
      path: folder with config.json and model.safetensors (or a sharded index).
      dtype: None keeps the checkpoint dtype; else cast floating weights to it
        (A_log, dt_bias, D and the router bias stay float32).
      ssm_state_dtype: dtype of the SSM states / checkpoints kept between decode steps.

    Returns:
      `models.nemotron_h.NemotronHForCausalLM` (model_type "nemotron_h", "mamba2") or
      `models.qwen_hybrid.QwenHybridForCausalLM` ("qwen3_next", "qwen3_5_text", "qwen3_5").

    Raises:
      CheckpointNotFoundError: no folder, no config.json, or no safetensors weights.
      ConfigError: unknown model_type or layer type, missing / malformed config keys.
      CheckpointError: missing or unexpected tensors, shape or dtype mismatches,
        unreadable safetensors files.
      TypeError: a non-floating `dtype` or an `ssm_state_dtype` other than f32 / bf16.
    """
    check_dtypes(dtype, ssm_state_dtype)
    cfg = read_config(path)
    source = os.path.join(os.fspath(path), "config.json")
    model_type = cfg.get("model_type")
    families = _families()
    if model_type not in families:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return families[model_type](path, cfg, dtype=dtype, ssm_state_dtype=ssm_state_dtype, source=source)
