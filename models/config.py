"""Frozen model configs built from a Hugging Face ``config.json``.

Each family config reads the keys of ``config.json`` verbatim (new names and the
legacy aliases that transformers still accepts), validates them up front and
raises `ConfigError` naming the file, the key, and the expected and found values.

Required keys are those that fix the checkpoint's tensor shapes or layer
pattern (sizes, head counts, head dims, state sizes, expert counts, the layer
types), where transformers' default is a particular model's value that another
checkpoint would not match: a config without one raises `ConfigError` naming
the key and its aliases, rather than building a model whose shapes then clash
with the checkpoint. The other keys (norm epsilons, biases, activations, the
conv width, the chunk size, the time-step limit, RoPE theta and fraction,
routing options) keep transformers' defaults, as listed per config class.

- `NemotronHConfig`: model_type "nemotron_h" (Nemotron-H / Nemotron-3, Mamba-2 +
  attention + MLP/MoE) and "mamba2" (plain Mamba2ForCausalLM: Mamba-2 layers only).
- `QwenHybridConfig`: model_type "qwen3_next" (Qwen3-Next: GDN + gated attention,
  sparse MoE) and "qwen3_5_text" (Qwen3.5 text model: GDN + gated attention, dense MLP),
  also "qwen3_5" (the multimodal wrapper; its ``text_config`` is read).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigError", "NemotronHConfig", "QwenHybridConfig", "parse_float"]


class ConfigError(ValueError):
    """A config.json that this package cannot build a model from."""


def parse_float(value: Any, *, where: str) -> float:
    """A float from config.json, accepting ``{"__float__": "Infinity"}`` (transformers' encoding of inf)."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number; found {value!r}") from None


def missing_key(source: str, keys: tuple[str, ...]) -> ConfigError:
    """The error for a required key absent from `source` under each of its names (first the key, then aliases)."""
    aliases = ""
    if len(keys) > 1:
        aliases = f" (or its alias{'es' if len(keys) > 2 else ''} {', '.join(repr(k) for k in keys[1:])})"
    return ConfigError(f"{source}: missing key {keys[0]!r}{aliases}, which is required: it fixes the model's "
                       f"shapes, and no default would match the checkpoint")


class _Reader:
    """Reads keys of a config dict with aliases, defaults and type checks."""

    def __init__(self, d: dict, source: str):
        self.d = d
        self.source = source

    def has(self, *keys: str) -> bool:
        return any(k in self.d and self.d[k] is not None for k in keys)

    def get(self, *keys: str, default: Any = dataclasses.MISSING, kind: type | tuple = object) -> Any:
        """The first present (non-null) key of `keys`, else `default` (required if none)."""
        for key in keys:
            if key in self.d and self.d[key] is not None:
                value = self.d[key]
                if kind is float:
                    return parse_float(value, where=f"{self.source}: key {key!r}")
                if kind is int and isinstance(value, float) and value.is_integer():
                    value = int(value)
                if kind is not object and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                    raise ConfigError(f"{self.source}: key {key!r} must be {getattr(kind, '__name__', kind)}; "
                                      f"found {value!r}")
                return value
        if default is dataclasses.MISSING:
            raise missing_key(self.source, keys)
        return default

    def size(self, *keys: str) -> int:
        """A required positive int under `keys` (a key and its aliases)."""
        return self.positive(self.get(*keys, kind=int), keys[0])

    def positive(self, value: int, key: str) -> int:
        if value <= 0:
            raise ConfigError(f"{self.source}: key {key!r} must be a positive integer; found {value!r}")
        return value

    def divides(self, divisor: int, divisor_key: str, value: int, value_key: str) -> None:
        if divisor <= 0 or value % divisor:
            raise ConfigError(f"{self.source}: {divisor_key!r} = {divisor} must divide {value_key!r} = {value}")


# ------------------------------------------------------------------------------------------------
# Nemotron-H and plain Mamba-2

NEMOTRON_LAYER_TYPES = ("mamba", "attention", "mlp", "moe")
_NEMOTRON_TYPE_NAMES = {
    "linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
    "full_attention": "attention", "attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
    "moe": "moe", "E": "moe",
}
#: transformers' default ``mtp_layers_block_type``: one attention block, then one MoE block.
_DEFAULT_MTP_LAYER_TYPES = ("attention", "moe")


@dataclass(frozen=True)
class NemotronHConfig:
    """Nemotron-H (and plain Mamba-2) model config.

    ``layer_types`` holds one of "mamba", "attention", "mlp", "moe" per layer
    (config.json: ``layers_block_type`` / ``layer_types`` with "linear_attention",
    "full_attention", "mlp", "moe", or the legacy ``hybrid_override_pattern``
    string of M, *, -, E).

    ``dt_limit`` is the clamp of the processed Mamba-2 time step, ``time_step_limit``
    (``mamba_dt_limit``), as in mamba_ssm's kernels and transformers' CUDA path.
    Note: transformers' pure-PyTorch Nemotron-H path instead clamps from below at
    ``time_step_min`` (``torch.clamp(dt, time_step_min)``); the two differ only
    where softplus(dt + dt_bias) < time_step_min (not the case in the test fixture).
    Pass ``dataclasses.replace(config, dt_limit=...)`` to choose otherwise.

    ``mamba_norm_group_size``: transformers' Nemotron-H normalises the gated
    RMSNorm per group (d_inner // n_groups); its plain Mamba2 over all of d_inner.

    Multi-token prediction (`models.mtp`, loaded with ``load_model(path, mtp=True)``):
    ``num_nextn_predict_layers`` (default 0: none) MTP steps, each a stack of blocks of
    ``mtp_layer_types`` (config.json ``mtp_layers_block_type``, or the legacy
    ``mtp_hybrid_override_pattern`` string; transformers' default ["attention", "moe"]),
    read as transformers reads them; the pattern only where MTP layers are declared.

    Required config.json keys (aliases in parentheses), read where the layer
    types use them. Nemotron-H: ``vocab_size``, ``hidden_size``, the layer
    pattern (``layers_block_type``, ``layer_types``, ``hybrid_override_pattern``);
    Mamba-2 layers: ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
    ``n_groups`` (``mamba_n_groups``); attention: ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` (``attention_head_dim``); MLP:
    ``intermediate_size``; MoE: ``n_routed_experts`` (``num_local_experts``),
    ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``moe_shared_expert_intermediate_size`` (0: no shared expert). Mamba2:
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_heads``,
    ``head_dim``, ``state_size``, ``n_groups``. Every other key has transformers'
    default: ``layer_norm_epsilon`` 1e-5, ``tie_word_embeddings`` False (Mamba2:
    True), ``residual_in_fp32`` False (Mamba2: True), ``conv_kernel`` 4,
    ``use_conv_bias`` True, ``use_bias`` False, ``chunk_size`` 128 (Mamba2: 256),
    ``time_step_limit`` (0, inf), ``mamba_hidden_act`` "silu", ``attention_bias``
    False, ``mlp_hidden_act`` "relu2", ``mlp_bias`` False, ``moe_latent_size``
    None, ``n_group`` 1, ``topk_group`` 1, ``norm_topk_prob`` True,
    ``routed_scaling_factor`` 1.0 (Mamba2: ``expand`` 2).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    residual_in_fp32: bool
    # Mamba-2 mixer
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    chunk_size: int
    dt_limit: tuple[float, float]
    mamba_norm_group_size: int
    mamba_hidden_act: str = "silu"
    # attention
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    # MLP
    intermediate_size: int = 0
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # multi-token prediction (models.mtp)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = _DEFAULT_MTP_LAYER_TYPES

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf_config(cls, d: dict, source: str = "config.json") -> "NemotronHConfig":
        """Build and validate from a config.json dict (model_type "nemotron_h" or "mamba2").

        Raises:
          ConfigError: a missing required key (named with its aliases), a malformed key, an unknown
            layer type, or sizes that do not divide.
        """
        r = _Reader(d, source)
        model_type = r.get("model_type", kind=str)
        if model_type == "mamba2":
            return cls._from_mamba2(r)
        if model_type != "nemotron_h":
            raise ConfigError(f"{source}: NemotronHConfig reads model_type 'nemotron_h' or 'mamba2'; "
                              f"found {model_type!r}")
        hidden = r.size("hidden_size")
        key, layer_types = cls._block_types(r, ("layers_block_type", "layer_types"), "hybrid_override_pattern")
        if layer_types is None:
            raise missing_key(source, ("layers_block_type", "layer_types", "hybrid_override_pattern"))
        if r.has("num_hidden_layers") and r.get("num_hidden_layers", kind=int) != len(layer_types):
            raise ConfigError(f"{source}: 'num_hidden_layers' = {d['num_hidden_layers']} does not match the "
                              f"{len(layer_types)} layers of {key!r}")
        mtp_layers = r.get("num_nextn_predict_layers", kind=int, default=0)
        if mtp_layers < 0:
            raise ConfigError(f"{source}: key 'num_nextn_predict_layers' must be >= 0; found {mtp_layers}")
        mtp_types = _DEFAULT_MTP_LAYER_TYPES
        if mtp_layers:  # transformers reads the MTP pattern only when MTP layers are declared
            mtp_types = cls._block_types(r, ("mtp_layers_block_type",), "mtp_hybrid_override_pattern")[1]
            mtp_types = _DEFAULT_MTP_LAYER_TYPES if mtp_types is None else mtp_types
        kinds = set(layer_types) | (set(mtp_types) if mtp_layers else set())
        mamba = "mamba" in kinds

        def mamba_size(*keys):  # required with Mamba-2 layers; unused (0) without
            return r.size(*keys) if mamba else r.get(*keys, kind=int, default=0)

        heads = mamba_size("mamba_num_heads")
        head_dim = mamba_size("mamba_head_dim")
        n_groups = mamba_size("n_groups", "mamba_n_groups")
        fields = dict(
            model_type=model_type, vocab_size=r.size("vocab_size"),
            hidden_size=hidden, layer_types=layer_types,
            layer_norm_epsilon=r.get("layer_norm_epsilon", kind=float, default=1e-5),
            tie_word_embeddings=r.get("tie_word_embeddings", kind=bool, default=False),
            residual_in_fp32=r.get("residual_in_fp32", kind=bool, default=False),
            mamba_num_heads=heads, mamba_head_dim=head_dim,
            ssm_state_size=mamba_size("ssm_state_size"), n_groups=n_groups,
            conv_kernel=r.positive(r.get("conv_kernel", "mamba_d_conv", kind=int, default=4), "conv_kernel"),
            use_conv_bias=r.get("use_conv_bias", "mamba_conv_bias", kind=bool, default=True),
            use_bias=r.get("use_bias", "mamba_proj_bias", kind=bool, default=False),
            chunk_size=r.get("chunk_size", "mamba_chunk_size", kind=int, default=128),
            dt_limit=cls._time_step_limit(r),
            mamba_norm_group_size=0,
            mamba_hidden_act=r.get("mamba_hidden_act", kind=str, default="silu"),
            num_nextn_predict_layers=mtp_layers, mtp_layer_types=mtp_types,
        )
        if mamba:
            r.divides(n_groups, "n_groups", heads, "mamba_num_heads")
            fields["mamba_norm_group_size"] = heads * head_dim // n_groups
        if "attention" in kinds:
            nh = r.size("num_attention_heads")
            kvh = r.size("num_key_value_heads")
            r.divides(kvh, "num_key_value_heads", nh, "num_attention_heads")
            fields.update(num_attention_heads=nh, num_key_value_heads=kvh,
                          head_dim=r.size("head_dim", "attention_head_dim"),
                          attention_bias=r.get("attention_bias", kind=bool, default=False))
        if kinds & {"mlp", "moe"}:
            fields.update(mlp_hidden_act=r.get("mlp_hidden_act", kind=str, default="relu2"),
                          mlp_bias=r.get("mlp_bias", kind=bool, default=False))
        if "mlp" in kinds:
            fields["intermediate_size"] = r.size("intermediate_size")
        if "moe" in kinds:
            n_exp = r.size("n_routed_experts", "num_local_experts")
            top_k = r.get("num_experts_per_tok", kind=int)
            if not 1 <= top_k <= n_exp:
                raise ConfigError(f"{source}: 'num_experts_per_tok' must be in [1, n_routed_experts = {n_exp}]; "
                                  f"found {top_k}")
            n_group = r.get("n_group", kind=int, default=1)
            r.divides(n_group, "n_group", n_exp, "n_routed_experts")
            topk_group = r.get("topk_group", kind=int, default=1)
            if not 1 <= topk_group <= n_group:
                raise ConfigError(f"{source}: 'topk_group' must be in [1, n_group = {n_group}]; found {topk_group}")
            fields.update(
                n_routed_experts=n_exp, num_experts_per_tok=top_k,
                moe_intermediate_size=r.size("moe_intermediate_size"),
                moe_shared_expert_intermediate_size=r.get("moe_shared_expert_intermediate_size", kind=int),
                moe_latent_size=r.get("moe_latent_size", kind=int, default=None), n_group=n_group,
                topk_group=topk_group, norm_topk_prob=r.get("norm_topk_prob", kind=bool, default=True),
                routed_scaling_factor=r.get("routed_scaling_factor", kind=float, default=1.0))
        return cls(**fields)

    @staticmethod
    def _block_types(r: _Reader, list_keys: tuple[str, ...], pattern_key: str):
        """(key, layer types) of a block pattern given as a list under `list_keys` or as a
        legacy pattern string under `pattern_key`; (None, None) if neither is present.

        Raises:
          ConfigError: an unknown layer type or an empty pattern, naming the key.
        """
        if r.has(*list_keys):
            key, raw = list_keys[0], r.get(*list_keys, kind=list)
        elif r.has(pattern_key):
            key, raw = pattern_key, list(r.get(pattern_key, kind=str))
        else:
            return None, None
        types = []
        for i, name in enumerate(raw):
            if not isinstance(name, str) or name not in _NEMOTRON_TYPE_NAMES:
                raise ConfigError(f"{r.source}: key {key!r}: unknown layer type {name!r} at layer {i}; expected one "
                                  f"of 'linear_attention', 'full_attention', 'mlp', 'moe' (or M, *, -, E)")
            types.append(_NEMOTRON_TYPE_NAMES[name])
        if not types:
            raise ConfigError(f"{r.source}: key {key!r} lists no layers")
        return key, tuple(types)

    @staticmethod
    def _time_step_limit(r: _Reader) -> tuple[float, float]:
        limit = r.get("time_step_limit", "mamba_dt_limit", kind=(list, tuple), default=(0.0, math.inf))
        if len(limit) != 2:
            raise ConfigError(f"{r.source}: key 'time_step_limit' must be [low, high]; found {limit!r}")
        lo = parse_float(limit[0], where=f"{r.source}: key 'time_step_limit'")
        hi = parse_float(limit[1], where=f"{r.source}: key 'time_step_limit'")
        if not 0.0 <= lo <= hi:
            raise ConfigError(f"{r.source}: key 'time_step_limit' must satisfy 0 <= low <= high; found {limit!r}")
        return lo, hi

    @classmethod
    def _from_mamba2(cls, r: _Reader) -> "NemotronHConfig":
        hidden = r.size("hidden_size")
        expand = r.get("expand", kind=int, default=2)
        heads = r.size("num_heads")
        head_dim = r.size("head_dim")
        if heads * head_dim != expand * hidden:
            raise ConfigError(f"{r.source}: 'num_heads' * 'head_dim' = {heads * head_dim} must equal "
                              f"'expand' * 'hidden_size' = {expand * hidden} (the mixer's intermediate size)")
        n_groups = r.size("n_groups")
        r.divides(n_groups, "n_groups", heads, "num_heads")
        n_layers = r.size("num_hidden_layers")
        return cls(
            model_type="mamba2", vocab_size=r.size("vocab_size"),
            hidden_size=hidden, layer_types=("mamba",) * n_layers,
            layer_norm_epsilon=r.get("layer_norm_epsilon", kind=float, default=1e-5),
            tie_word_embeddings=r.get("tie_word_embeddings", "tie_embedding_weights", kind=bool, default=True),
            residual_in_fp32=r.get("residual_in_fp32", kind=bool, default=True),
            mamba_num_heads=heads, mamba_head_dim=head_dim,
            ssm_state_size=r.size("state_size"), n_groups=n_groups,
            conv_kernel=r.positive(r.get("conv_kernel", kind=int, default=4), "conv_kernel"),
            use_conv_bias=r.get("use_conv_bias", kind=bool, default=True),
            use_bias=r.get("use_bias", kind=bool, default=False),
            chunk_size=r.get("chunk_size", kind=int, default=256),
            dt_limit=cls._time_step_limit(r),
            mamba_norm_group_size=heads * head_dim,
            mamba_hidden_act=r.get("hidden_act", kind=str, default="silu"),
        )


# ------------------------------------------------------------------------------------------------
# Qwen3-Next and Qwen3.5

_QWEN_TYPE_NAMES = {"linear_attention": "gdn", "full_attention": "attention"}


@dataclass(frozen=True)
class QwenHybridConfig:
    """Qwen3-Next / Qwen3.5 text model config.

    ``layer_types``: "gdn" or "attention" per layer (config.json ``layer_types``
    with "linear_attention" / "full_attention", or legacy ``full_attention_interval``).
    ``mlp_types``: "moe" or "mlp" per layer (Qwen3-Next: MoE unless the layer is in
    ``mlp_only_layers`` or (i + 1) % decoder_sparse_step != 0; Qwen3.5: dense).
    ``gdn_packed``: Qwen3-Next's packed ``in_proj_qkvz`` / ``in_proj_ba`` (True) or
    Qwen3.5's separate projections (False). ``rotary_dim`` = int(head_dim *
    partial_rotary_factor); only the "default" RoPE type is supported (Qwen3.5's
    multimodal RoPE sections coincide with it for text-only positions).
    ``attn_output_gate``: q_proj also yields the sigmoid output gate (default True).

    Required config.json keys: ``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, the layer pattern (``layer_types``, or
    ``full_attention_interval``), ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``intermediate_size``
    (where a layer has a dense MLP); Qwen3-Next also ``num_experts`` (0: no MoE)
    and, with MoE layers, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``. Every other key has transformers'
    default: ``rms_norm_eps`` 1e-6, ``tie_word_embeddings`` False, ``hidden_act``
    "silu", ``attention_bias`` False, ``attn_output_gate`` True,
    ``linear_conv_kernel_dim`` 4, ``rope_theta`` 10000, ``partial_rotary_factor``
    0.25, ``decoder_sparse_step`` 1, ``mlp_only_layers`` [], ``norm_topk_prob`` True.

    Multi-token prediction (`models.mtp`, loaded with ``load_model(path, mtp=True)``):
    ``mtp_num_hidden_layers``, the number of MTP decoder layers (config.json
    ``mtp_num_hidden_layers``, as Qwen3.5 checkpoints write it, or
    ``num_nextn_predict_layers``, the name vLLM reads for Qwen3-Next; where neither is
    present, 1, vLLM's default: Qwen3-Next's published config.json declares none, its
    checkpoint holds one). ``mtp_use_dedicated_embeddings``: the head has its own
    embedding table (default False: it shares the model's).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    hidden_act: str
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    rotary_dim: int
    attn_output_gate: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_packed: bool
    # MLP / MoE
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # multi-token prediction (models.mtp)
    mtp_num_hidden_layers: int = 1
    mtp_use_dedicated_embeddings: bool = False

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf_config(cls, d: dict, source: str = "config.json") -> "QwenHybridConfig":
        """Build and validate from a config.json dict (model_type "qwen3_next", "qwen3_5_text" or "qwen3_5").

        Raises:
          ConfigError: a missing required key (named with its aliases), a malformed key, an unknown
            layer or RoPE type, or sizes that do not divide.
        """
        r = _Reader(d, source)
        model_type = r.get("model_type", kind=str)
        if model_type == "qwen3_5":
            text = r.get("text_config", kind=dict)
            text = {"model_type": "qwen3_5_text", **text}
            if "tie_word_embeddings" not in text and "tie_word_embeddings" in d:
                text["tie_word_embeddings"] = d["tie_word_embeddings"]
            return cls.from_hf_config(text, source=f"{source} (text_config)")
        if model_type not in ("qwen3_next", "qwen3_5_text"):
            raise ConfigError(f"{source}: QwenHybridConfig reads model_type 'qwen3_next', 'qwen3_5_text' or "
                              f"'qwen3_5'; found {model_type!r}")
        hidden = r.size("hidden_size")
        n_layers = r.size("num_hidden_layers")
        if r.has("layer_types"):
            raw = r.get("layer_types", kind=list)
            layer_types = []
            for i, name in enumerate(raw):
                if name not in _QWEN_TYPE_NAMES:
                    raise ConfigError(f"{source}: key 'layer_types': unknown layer type {name!r} at layer {i}; "
                                      f"expected 'linear_attention' or 'full_attention'")
                layer_types.append(_QWEN_TYPE_NAMES[name])
            if len(layer_types) != n_layers:
                raise ConfigError(f"{source}: 'layer_types' has {len(layer_types)} entries; "
                                  f"'num_hidden_layers' = {n_layers}")
        elif r.has("full_attention_interval"):
            interval = r.size("full_attention_interval")
            layer_types = ["attention" if (i + 1) % interval == 0 else "gdn" for i in range(n_layers)]
        else:
            raise missing_key(source, ("layer_types", "full_attention_interval"))
        nh = r.size("num_attention_heads")
        kvh = r.size("num_key_value_heads")
        r.divides(kvh, "num_key_value_heads", nh, "num_attention_heads")
        head_dim = r.size("head_dim")
        rope = r.get("rope_parameters", kind=dict, default=None) or {}
        legacy = r.get("rope_scaling", kind=dict, default=None) or {}
        rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
        if rope_type != "default":
            raise ConfigError(f"{source}: key 'rope_parameters': rope_type {rope_type!r} is not supported "
                              f"(supported: 'default')")
        theta = parse_float(rope.get("rope_theta", d.get("rope_theta", 10000.0)), where=f"{source}: 'rope_theta'")
        factor = parse_float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)),
                             where=f"{source}: 'partial_rotary_factor'")
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ConfigError(f"{source}: 'partial_rotary_factor' = {factor} gives rotary dim {rotary_dim}; "
                              f"expected an even number in (0, head_dim = {head_dim}]")
        lk = r.size("linear_num_key_heads")
        lv = r.size("linear_num_value_heads")
        r.divides(lk, "linear_num_key_heads", lv, "linear_num_value_heads")
        fields = dict(
            model_type=model_type, vocab_size=r.size("vocab_size"),
            hidden_size=hidden, layer_types=tuple(layer_types), mlp_types=("mlp",) * n_layers,
            rms_norm_eps=r.get("rms_norm_eps", kind=float, default=1e-6),
            tie_word_embeddings=r.get("tie_word_embeddings", kind=bool, default=False),
            hidden_act=r.get("hidden_act", kind=str, default="silu"),
            num_attention_heads=nh, num_key_value_heads=kvh, head_dim=head_dim,
            attention_bias=r.get("attention_bias", kind=bool, default=False), rope_theta=theta,
            rotary_dim=rotary_dim, attn_output_gate=r.get("attn_output_gate", kind=bool, default=True),
            linear_num_key_heads=lk, linear_num_value_heads=lv,
            linear_key_head_dim=r.size("linear_key_head_dim"),
            linear_value_head_dim=r.size("linear_value_head_dim"),
            linear_conv_kernel_dim=r.positive(r.get("linear_conv_kernel_dim", kind=int, default=4),
                                              "linear_conv_kernel_dim"),
            gdn_packed=(model_type == "qwen3_next"),
            intermediate_size=0,
            mtp_num_hidden_layers=r.get("mtp_num_hidden_layers", "num_nextn_predict_layers", kind=int, default=1),
            mtp_use_dedicated_embeddings=r.get("mtp_use_dedicated_embeddings", kind=bool, default=False),
        )
        if fields["mtp_num_hidden_layers"] < 0:
            raise ConfigError(f"{source}: key 'mtp_num_hidden_layers' must be >= 0; found "
                              f"{fields['mtp_num_hidden_layers']}")
        if model_type == "qwen3_next":
            n_exp = r.get("num_experts", kind=int)
            step = r.get("decoder_sparse_step", kind=int, default=1)
            mlp_only = set(r.get("mlp_only_layers", kind=list, default=[]))
            mlp_types = tuple("moe" if (i not in mlp_only and n_exp > 0 and (i + 1) % step == 0) else "mlp"
                              for i in range(n_layers))
            fields["mlp_types"] = mlp_types
            if "moe" in mlp_types:
                top_k = r.get("num_experts_per_tok", kind=int)
                if not 1 <= top_k <= n_exp:
                    raise ConfigError(f"{source}: 'num_experts_per_tok' must be in [1, num_experts = {n_exp}]; "
                                      f"found {top_k}")
                fields.update(
                    num_experts=n_exp, num_experts_per_tok=top_k,
                    moe_intermediate_size=r.size("moe_intermediate_size"),
                    shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", kind=int),
                    norm_topk_prob=r.get("norm_topk_prob", kind=bool, default=True))
        if "mlp" in fields["mlp_types"]:
            fields["intermediate_size"] = r.size("intermediate_size")
        return cls(**fields)
