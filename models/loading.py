"""Loading Hugging Face checkpoints: config.json + safetensors -> Flax NNX model.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json`` with its shards. `load_model` reads
the config, looks the model family up by ``model_type`` in `models.registry`,
builds the module abstractly (``nnx.eval_shape``: no weights allocated twice)
and fills every parameter from the checkpoint by name.

The name mapping is strict: a parameter without a tensor, a tensor that no
parameter takes (beyond the documented ignores, e.g. ``mtp.*`` multi-token
prediction heads that transformers also skips, unless ``mtp=True`` asks for the
head: `models.mtp`) and a tensor of the wrong shape
each raise `CheckpointError` naming the file, the key and the shapes; so does a
tensor holding NaN or inf (checked as each tensor is read).

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

from models import registry
from models.config import ConfigError
from models.mtp import add_mtp_head
from models.mtp import check_config as check_mtp_config

__all__ = ["CheckpointError", "CheckpointNotFoundError", "TensorSource", "read_config", "read_json_object",
           "check_folder", "load_params", "load_model", "check_dtypes", "SUPPORTED_DTYPES"]

#: Parameters kept in float32 when a lower `dtype` is requested (the SSM dynamics and router bias).
KEEP_FP32 = frozenset({"A_log", "dt_bias", "D", "e_score_correction_bias"})

#: Weight dtypes the models run in. float16 is refused: its range (max 65504) overflows in the SSM
#: recurrences, whose outputs and states then hold inf.
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
#: The safetensors names of SUPPORTED_DTYPES (a tensor kept as stored, `dtype=None`, must be one).
_SUPPORTED_TENSOR_DTYPES = ("F32", "BF16")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model built from its config."""


class CheckpointNotFoundError(FileNotFoundError):
    """A checkpoint folder without config.json or safetensors weights."""


def read_json_object(file: str) -> dict:
    """The JSON object in `file` (a config.json or generation_config.json).

    Raises:
      ConfigError: `file` is not UTF-8 JSON or holds something other than an object (naming `file`).
    """
    with open(file, "rb") as f:
        try:
            d = json.loads(f.read().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{file}: expected a JSON object; found {type(d).__name__}")
    return d


def check_folder(path: str | os.PathLike) -> str:
    """`path` as a str, if it is a folder.

    Raises:
      TypeError: `path` not a str or os.PathLike.
      CheckpointNotFoundError: `path` is not a folder.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a checkpoint folder (str or os.PathLike); got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
        raise CheckpointNotFoundError(f"checkpoint folder {path!r} {what}")
    return path


def read_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of checkpoint folder `path`.

    Raises:
      CheckpointNotFoundError: `path` is not a folder or has no config.json.
      ConfigError: config.json is not a JSON object.
    """
    cfg_path = os.path.join(check_folder(path), "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointNotFoundError(f"{cfg_path}: no such file (a Hugging Face checkpoint folder needs config.json)")
    return read_json_object(cfg_path)


class TensorSource:
    """Lazy access to the safetensors tensors of a checkpoint folder (single file or sharded).

    ``keys()``: all tensor names; ``file_of(key)``: its file; ``shape(key)``: its shape
    (read from the header); ``get(key)``: the numpy array; ``get_slice(key, index)``: a
    slice of it, read alone.

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

    def get_slice(self, key: str, index: tuple) -> np.ndarray:
        """The slice `index` (a tuple of slices) of tensor `key`, read without the rest of it."""
        return self._read(key, lambda f: f.get_slice(key)[index])


_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def _describe(src: TensorSource) -> str:
    files = sorted({os.path.basename(f) for f in src._file_of.values()})
    return ", ".join(files) if len(files) <= 3 else f"{files[0]} ... ({len(files)} shards)"


def load_params(model_factory: Callable[[], nnx.Module], src: TensorSource, *,
                checkpoint_key: Callable[[str], str | None] = lambda k: k, dtype=None,
                model_name: str = "model", place: Callable | None = None) -> nnx.Module:
    """Build ``model_factory()`` with its parameters read from `src`.

    Args:
      model_factory: zero-argument constructor of the NNX model (called under
        ``nnx.eval_shape``, so nothing is allocated).
      src: the checkpoint tensors.
      checkpoint_key: maps a checkpoint tensor name to the model's name for it
        (e.g. a prefix rename), or None to skip the tensor on purpose.
      dtype: None keeps each tensor's dtype (which must then be F32 or BF16); else
        floating tensors are cast to it (except `KEEP_FP32` parameters, kept in float32).
      model_name: used in error messages.
      place: None: each tensor is read whole and put on the default device. Else
        ``place(names, shape, read) -> jax.Array`` builds each parameter (path `names`,
        stored shape) from ``read(index)``, which returns the (cast, checked) values of
        a tuple-of-slices `index` of the stored tensor: `models.sharding.place` reads
        only each device's blocks.

    Returns:
      The model, every parameter filled.

    Raises:
      CheckpointError: a missing tensor, an unexpected tensor, a shape mismatch
        (naming the file, the key, and the expected and found shapes), a
        non-floating tensor, a tensor holding NaN or inf, or with `dtype=None`
        a tensor stored in a dtype other than F32 / BF16.
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

    def tensor(name: str, shape: tuple[int, ...]) -> str:
        """The checkpoint key of parameter `name` after checking its shape and dtype (marks it used)."""
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
        if dtype is None and kind not in _SUPPORTED_TENSOR_DTYPES:
            raise CheckpointError(f"{src.file_of(key)}: tensor {key!r} has dtype {kind}, which the models do not "
                                  f"run in (supported: {', '.join(_SUPPORTED_TENSOR_DTYPES)}); pass "
                                  f"dtype=jnp.float32 or dtype=jnp.bfloat16 to cast the weights")
        used.add(name)
        return key

    def read(key: str, index: tuple | None) -> np.ndarray:
        """Tensor `key` (or its slice `index`, a tuple of slices), checked to be finite."""
        arr = src.get(key) if index is None else src.get_slice(key, index)
        finite = np.isfinite(arr)
        if not finite.all():
            bad = np.argwhere(~finite)
            starts = [0] * arr.ndim if index is None else [sl.start or 0 for sl in index]
            first = tuple(int(i) + start for i, start in zip(bad[0], starts))
            raise CheckpointError(f"{src.file_of(key)}: tensor {key!r} holds {len(bad)} non-finite value(s) "
                                  f"(NaN or inf){' in the slice read' if index is not None else ''}, the first "
                                  f"{arr[tuple(bad[0])]} at index {first}")
        return arr

    def reader(name: str, shape: tuple[int, ...]) -> Callable[[tuple | None], np.ndarray]:
        """index (None: all) -> the values of parameter `name` there; stacked per-expert tensors for an
        [E, out, in] expert parameter the checkpoint stores per expert."""
        m = _EXPERT_PARAM.match(name)
        if m and len(shape) == 3 and name not in available:
            keys = [tensor(f"{m['prefix']}.{e}.{m['proj']}.weight", shape[1:]) for e in range(shape[0])]
            return lambda index: np.stack([read(k, None if index is None else index[1:])
                                           for k in (keys if index is None else keys[index[0]])])
        key = tensor(name, shape)
        return lambda index: read(key, index)

    def cast(leaf: str, arr):
        if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
            return arr.astype(jnp.float32 if leaf in KEEP_FP32 else dtype)
        return arr

    leaves = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        shape = tuple(var.shape)
        read_at = reader(name, shape)
        leaf = path[-1]
        if place is None:
            value = cast(leaf, jnp.asarray(read_at(None)))
        else:
            value = place(tuple(str(p) for p in path), shape,
                          lambda index, read_at=read_at, leaf=leaf: np.asarray(cast(leaf, read_at(index))))
        leaves.append((path, var.replace(value)))
    unexpected = sorted(available[n] for n in set(available) - used)
    if unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:10])
        more = f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""
        raise CheckpointError(f"{where}: unexpected tensor(s) {shown}{more}: {model_name} has no parameter for them")
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def check_dtypes(dtype, ssm_state_dtype) -> None:
    """Raise TypeError unless `dtype` is None, float32 or bfloat16 and `ssm_state_dtype` is float32 or bfloat16.

    float16 is refused for both: the SSM recurrences overflow its range (outputs and states turn inf).
    """
    for name, value, allow_none in (("dtype", dtype, True), ("ssm_state_dtype", ssm_state_dtype, False)):
        if allow_none and value is None:
            continue
        given = _dtype_or_none(value)
        if given not in SUPPORTED_DTYPES:
            allowed = "None or a floating dtype (float32, bfloat16)" if allow_none else "float32 or bfloat16"
            why = (" (float16 is not supported: the SSM ops overflow its range, max 65504, and return inf)"
                   if given == jnp.dtype(jnp.float16) else "")
            raise TypeError(f"`{name}` must be {allowed}; got {given.name if given is not None else repr(value)}{why}")


def _dtype_or_none(value):
    try:
        return jnp.dtype(value)
    except TypeError:
        return None


def load_model(path: str | os.PathLike, dtype=None, *, ssm_state_dtype=jnp.float32, mtp: bool = False,
               mesh=None) -> nnx.Module:
    """Load a Hugging Face checkpoint folder as a Flax NNX model.

    The model family is the one registered for config.json's ``model_type``
    (`models.registry`); its config parser, model class and checkpoint name
    mapping build the model.

    Args:
      path: folder with config.json and model.safetensors (or a sharded index).
      dtype: None keeps the checkpoint dtype (each tensor must then be float32
        or bfloat16); float32 or bfloat16 casts floating weights to it (A_log,
        dt_bias, D and the router bias stay float32). float16 is refused.
      ssm_state_dtype: dtype of the SSM states / checkpoints kept between decode
        steps: float32 or bfloat16.
      mtp: also load the multi-token prediction head from the ``mtp.*`` tensors
        (as ``model.mtp``, `models.mtp`; parameter names = tensor names, every
        tensor used, shapes checked as for the rest). False: they are skipped
        and ``model.mtp`` is None.
      mesh: None, or a ("dp", "tp") ``jax.sharding.Mesh`` (`models.sharding.make_mesh`):
        the model is returned as a `models.sharding.ShardedLM`, each weight placed on its
        devices as it is read (each device's block read from the safetensors file alone,
        fused projections in the shard layout: `models.sharding`).

    Returns:
      `models.nemotron_h.NemotronHForCausalLM` (model_type "nemotron_h", "mamba2") or
      `models.qwen_hybrid.QwenHybridForCausalLM` ("qwen3_next", "qwen3_5_text", "qwen3_5");
      with a mesh, a `models.sharding.ShardedLM` of it.

    Raises:
      CheckpointNotFoundError: no folder, no config.json, or no safetensors weights.
      ConfigError: unknown model_type or layer type, a missing required key (named
        with its aliases), a malformed key.
      CheckpointError: missing or unexpected tensors, shape or dtype mismatches,
        NaN or inf in a tensor, unreadable safetensors files; with mtp=True, a
        checkpoint without ``mtp.*`` tensors (naming the folder and the prefix).
      ConfigError: with mtp=True, a config that declares no MTP head (or one of
        another form, `models.mtp.check_config`).
      TypeError: `path` not a str or os.PathLike; a `dtype` other than None, float32, bfloat16, an
        `ssm_state_dtype` other than float32, bfloat16, a non-bool `mtp`, or a
        `mesh` that is not a Mesh.
      ValueError: with a mesh: axes other than ("dp", "tp"), mtp=True, or a config
        size that tp does not divide (naming the config key, its value and tp;
        `models.sharding.check_config`), before any weight is read.
    """
    check_dtypes(dtype, ssm_state_dtype)
    if not isinstance(mtp, bool):
        raise TypeError(f"`mtp` must be a bool; got {type(mtp).__name__} {mtp!r}")
    cfg = read_config(path)
    model_type = cfg.get("model_type")
    source = os.path.join(os.fspath(path), "config.json")
    family, config = registry.parse(cfg, source=source)
    if mesh is not None:
        from models import sharding

        sharding.check_mesh(mesh)
        if mtp:
            raise ValueError("`mtp=True` with a `mesh`: the multi-token prediction head is not sharded")
        sharding.check_config(config, mesh.shape[sharding.TP])
    src = TensorSource(path)
    param_dtype = dtype or jnp.float32

    def build():
        return family.model_class(config, ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype)

    checkpoint_key = family.weight_map(config, model_type)
    if mtp:
        build, checkpoint_key = _with_mtp_head(build, checkpoint_key, config, src, source, param_dtype)
    if mesh is None:
        return load_params(build, src, checkpoint_key=checkpoint_key, dtype=dtype,
                           model_name=family.class_names[model_type])

    def place(names, shape, read):
        return sharding.place(read, shape, mesh, sharding.param_axis(names), sharding.fused_parts(config, names))

    model = load_params(build, src, checkpoint_key=checkpoint_key, dtype=dtype,
                        model_name=family.class_names[model_type], place=place)
    return sharding.sharded_from_state(family.model_class, config, nnx.state(model), mesh,
                                       ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype)


#: The prefix of the multi-token prediction head's tensors (Qwen3-Next, Qwen3.5, Nemotron-H).
MTP_PREFIX = "mtp."


def _with_mtp_head(build, checkpoint_key, config, src: TensorSource, source: str, param_dtype):
    """(model factory, name mapping) that add the MTP head and read its ``mtp.*`` tensors by their names.

    Raises:
      ConfigError: the config declares no MTP head this package builds.
      CheckpointError: no ``mtp.*`` tensor in `src`.
    """
    check_mtp_config(config, source)
    if not any(key.startswith(MTP_PREFIX) for key in src.keys()):
        raise CheckpointError(f"{src.path} ({_describe(src)}): mtp=True, but the checkpoint has no tensors under "
                              f"the prefix {MTP_PREFIX!r} (the multi-token prediction head)")

    def build_with_head():
        return add_mtp_head(build(), param_dtype=param_dtype)

    def key_with_head(key: str) -> str | None:
        return key if key.startswith(MTP_PREFIX) else checkpoint_key(key)

    return build_with_head, key_with_head
