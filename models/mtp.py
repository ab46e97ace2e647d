"""Multi-token prediction (MTP) heads of Qwen3-Next / Qwen3.5 and Nemotron-H, and the MTP drafter.

The checkpoints of these models carry a small draft head under ``mtp.*`` that
predicts the token after next from the model's last hidden state and the next
token. `models.load_model(path, mtp=True)` attaches it to the model as
``model.mtp``; `MTPDrafter` proposes speculative drafts with it (ARCHITECTURE.md,
"Speculative decoding"). Dimension names: batch, T (positions given in one call), K =
num_speculative_tokens, hidden (hidden_size), vocab (vocab_size), max_len (the
head's KV cache length).

**The head, one step** (the target's embedding table E and LM head are shared;
every norm is an RMSNorm, zero-centered (1 + weight) in Qwen, plain in Nemotron-H):

    e = norm_e(E[token])                     embedding of the token at position i + 1
    h = norm_h(hidden)                       the target's hidden state at position i
    x = proj(concat(e, h))                   embedding half first, then the hidden half
    x = blocks(x)                            pre-norm residual decoder blocks, own KV cache
    out = final_norm(x)                      the head's own final norm
    logits = lm_head(out)                    a distribution over the token at position i + 2

- Qwen3-Next / Qwen3.5 (`QwenMTPHead`): ``mtp.pre_fc_norm_embedding`` (norm_e),
  ``mtp.pre_fc_norm_hidden`` (norm_h), ``mtp.fc`` (proj, [hidden, 2 hidden], no
  bias), one decoder layer ``mtp.layers.0`` with gated attention (the target's
  attention type) and the MLP type of the target's layer 0 (MoE in Qwen3-Next,
  dense in Qwen3.5), ``mtp.norm`` (final_norm). Source: vLLM
  ``model_executor/models/qwen3_next_mtp.py`` and ``qwen3_5_mtp.py``
  (Qwen3NextMultiTokenPredictor.forward concatenates the normed embedding before
  the normed hidden state, runs a "full_attention" decoder layer built with the
  layer index of its ``mtp.layers.i`` name, then ``mtp.norm`` with the residual),
  and SGLang ``models/qwen3_next_mtp.py`` (the same order, a one-layer model with
  ``full_attention_interval = 1``).
- Nemotron-H (`NemotronHMTPHead`): the blocks of ``mtp_layers_block_type``
  (["attention", "moe"] in the released checkpoints) as ``mtp.layers.{i}`` with
  ``norm`` and ``mixer``; the first also holds ``enorm`` (norm_e), ``hnorm``
  (norm_h) and ``eh_proj`` (proj), the last ``final_layernorm``. Source: vLLM
  ``model_executor/models/nemotron_h_mtp.py`` (NemotronHMTPAttentionDecoderLayer:
  cat([enorm(embeds), hnorm(hidden)]) -> eh_proj, the block, then the residual
  added and final_layernorm at the end of the step).

**Which hidden state.** The head reads the target's hidden state *after* the
target's final norm (``model.norm`` / ``backbone.norm_f``), the tensor its LM
head scores: vLLM's Qwen3-Next and Nemotron-H models return the final-normed
state and the MTP proposer feeds exactly that to ``pre_fc_norm_hidden`` /
``hnorm``. The choice matters: LightLLM measured a 52% longer mean acceptance
on Qwen3.5 after switching from the pre-norm to the post-norm state (pull
request ModelTC/LightLLM#1402, 2026). `HybridCausalLM.prefill` / ``decode``
return this state with ``return_hidden=True``. For the second and later drafts
of a round the head reads its *own* output after its final norm (the same
tensor it scores), as vLLM and SGLang chain it.

**Positions.** Entry i of the head's KV cache is the step on (target hidden at
position i, token at position i + 1), at RoPE position i, as vLLM's proposer
aligns them (positions of the target, input ids shifted left by one). After
each `MTPDrafter.propose` the head's cache length equals the target's position.

**A round**, with the target at position p (its last logits chose token t_p):

    drafts, mtp_cache = drafter.propose(params, hidden, tokens, mtp_cache, key, num_tokens=m)
    #   hidden [batch, T, hidden]: the target's final-normed hidden states at the m
    #   positions it committed since the last propose (first: the prompt's T positions);
    #   tokens [batch, T]: the token after each (first: prompt[:, 1:] then t_T).
    logits, hidden, cache = target.verify([t_p, drafts.tokens], cache)     # W = K + 1
    accepted = accept_drafts(logits, drafts, key, sampling)
    cache = target.commit(cache, accepted.num_accepted)
    # next round: propose(params, hidden, accepted.tokens, mtp_cache, key,
    #                     num_tokens=accepted.num_accepted)

``accepted.tokens[:, j]`` is the token at position p + 1 + j, so the window's
hidden states and the accepted tokens are aligned as the head expects. The
entries the K - 1 chained draft steps write past the committed length are
dead: the next propose overwrites them with entries from the target's hidden
states (the rollback of rejected drafts); `MTPDrafter.rollback` moves the
length back explicitly (a row reset, or a target rolled back further).

In the compiled speculative loop (`replayssm_jax.speculative.loop`;
``Generator(model, speculative=SpeculativeConfig("mtp", K))``) the drafter's
`init_state` and `update` run these steps, its `MTPDraftState` carried with
the target's cache; a done row (m = 0) keeps its head cache length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.common import HybridCausalLM, check_input_ids, check_tokens
from models.config import ConfigError, NemotronHConfig, QwenHybridConfig
from models.nemotron_h import NemotronHBlock
from models.qwen_hybrid import QwenDecoderLayer
from replayssm_jax.ops import validate as v
from replayssm_jax.layers import Attention, KVCache, Linear, RMSNorm
from replayssm_jax.layers.linear import default_rngs
from replayssm_jax.sampling import SamplingParams
from replayssm_jax.speculative import _checks
from replayssm_jax.speculative.drafters import DraftStart, Drafts, Kept, choose_drafts

__all__ = ["MTPCache", "MTPHead", "QwenMTPHead", "NemotronHMTPBlock", "NemotronHMTPHead", "MTPDrafter",
           "MTPDraftState", "check_config", "add_mtp_head", "has_mtp_head", "mtp_forward"]


# ------------------------------------------------------------------------------------------------
# config


def check_config(config, source: str) -> None:
    """Raise unless `config` declares an MTP head this module builds.

    Qwen (`QwenHybridConfig`): ``mtp_num_hidden_layers`` = 1, no dedicated
    embeddings. Nemotron-H (`NemotronHConfig`, model_type "nemotron_h"):
    ``num_nextn_predict_layers`` = 1, ``mtp_layer_types`` of attention, MLP and
    MoE blocks with at least one attention block (whose KV cache holds the
    head's length). The released checkpoints have one MTP step; vLLM also
    builds exactly one for Nemotron-H.

    Args:
      config: the model config.
      source: where it was read (named in the message), e.g. the config.json path.

    Raises:
      ConfigError: no MTP layers declared (naming the key), or a head of another form.
    """
    if isinstance(config, QwenHybridConfig):
        n, key = config.mtp_num_hidden_layers, "'mtp_num_hidden_layers' (or 'num_nextn_predict_layers')"
        if config.mtp_use_dedicated_embeddings:
            raise ConfigError(f"{source}: key 'mtp_use_dedicated_embeddings' is true; the MTP head here shares the "
                              f"model's embedding (a dedicated one is not supported)")
    elif isinstance(config, NemotronHConfig) and config.model_type == "nemotron_h":
        n, key = config.num_nextn_predict_layers, "'num_nextn_predict_layers'"
        kinds = set(config.mtp_layer_types)
        if n and not kinds <= {"attention", "mlp", "moe"}:
            raise ConfigError(f"{source}: key 'mtp_layers_block_type' = {list(config.mtp_layer_types)}: Mamba-2 "
                              f"blocks in the MTP head are not supported (attention, mlp, moe are)")
        if n and "attention" not in kinds:
            raise ConfigError(f"{source}: key 'mtp_layers_block_type' = {list(config.mtp_layer_types)} has no "
                              f"attention block; the MTP head needs one")
    else:
        model_type = getattr(config, "model_type", type(config).__name__)
        raise ConfigError(f"{source}: model_type {model_type!r} has no multi-token prediction head "
                          f"(supported: 'qwen3_next', 'qwen3_5_text', 'qwen3_5', 'nemotron_h')")
    if n == 0:
        raise ConfigError(f"{source}: key {key} = 0: the config declares no MTP layers")
    if n != 1:
        raise ConfigError(f"{source}: key {key} = {n}: only one MTP layer is supported (the released checkpoints "
                          f"have one)")


# ------------------------------------------------------------------------------------------------
# the head's decode state


@struct.dataclass
class MTPCache:
    """Decode state of an MTP head: one KV cache per attention block.

    Attributes:
      layers: one entry per block of the head: `KVCache` (attention; k, v
        [batch, max_len, num_key_value_heads, head_dim]) or None (MLP / MoE).
        Every KVCache holds the same ``length`` i32[batch]: entry i (i < length)
        is the head's step on the target's hidden state at position i and the
        token at position i + 1.
    """

    layers: tuple

    @property
    def _kv(self) -> KVCache:
        return next(s for s in self.layers if s is not None)

    @property
    def length(self) -> jax.Array:
        """i32[batch], entries held per row (equal to the target's position after a propose)."""
        return self._kv.length

    @property
    def max_len(self) -> int:
        return self._kv.max_len

    @property
    def batch(self) -> int:
        return self._kv.k.shape[0]

    def with_length(self, length: jax.Array) -> "MTPCache":
        """The same entries with `length` i32[batch] in every KV cache."""
        return MTPCache(layers=tuple(None if s is None else s.replace(length=length) for s in self.layers))

    @classmethod
    def zeros(cls, layout, batch: int, max_len: int, dtype=jnp.float32) -> "MTPCache":
        """An empty cache (length 0) for `layout`: per block (num_key_value_heads, head_dim) or None."""
        return cls(layers=tuple(None if kv is None else KVCache.zeros(batch, max_len, *kv, dtype=dtype)
                                for kv in layout))


# ------------------------------------------------------------------------------------------------
# heads


class MTPHead(nnx.Module):
    """One step of an MTP head over T positions (the module docstring gives the math).

    A subclass calls ``super().__init__(config)`` (which runs `check_config`) and
    defines `_fuse` (embeds, hidden -> proj(concat(norm_e(e), norm_h(h)))),
    `_blocks`, `_block` (one block with its KV cache or None), `_attention`
    (a block's `Attention` or None) and `_final_norm`.

    Raises:
      ConfigError: as `check_config`.
    """

    def __init__(self, config):
        check_config(config, source=type(config).__name__)

    def _fuse(self, embeds, hidden):
        raise NotImplementedError(f"{type(self).__name__} must define _fuse")

    @property
    def _blocks(self):
        raise NotImplementedError(f"{type(self).__name__} must define _blocks")

    def _block(self, block, x, state):
        raise NotImplementedError(f"{type(self).__name__} must define _block")

    def _attention(self, block) -> Attention | None:
        raise NotImplementedError(f"{type(self).__name__} must define _attention")

    def _final_norm(self, x):
        raise NotImplementedError(f"{type(self).__name__} must define _final_norm")

    def kv_layout(self) -> tuple:
        """Per block: (num_key_value_heads, head_dim) of its attention, or None."""
        attns = [self._attention(b) for b in self._blocks]
        return tuple(None if a is None else (a.num_kv_heads, a.head_dim) for a in attns)

    def cache_dtype(self):
        """The dtype of the first attention block's projections (the natural KV cache dtype)."""
        attn = next(a for a in map(self._attention, self._blocks) if a is not None)
        return attn.k_proj.weight.dtype

    def __call__(self, embeds: jax.Array, hidden: jax.Array, layers: tuple) -> tuple[jax.Array, tuple]:
        """The head on T positions per row, appended after each row's cached entries.

        Args:
          embeds: [batch, T, hidden], the target's embedding of the tokens at positions i + 1.
          hidden: [batch, T, hidden], the target's final-normed hidden states at positions i.
          layers: `MTPCache.layers`; row b's new entries go to positions length[b] .. length[b] + T - 1.

        Returns:
          (out [batch, T, hidden] after the head's final norm, the updated layers (length += T)).
        """
        x = self._fuse(embeds, hidden)
        new = []
        for block, state in zip(self._blocks, layers):
            x, state = self._block(block, x, state)
            new.append(state)
        return self._final_norm(x), tuple(new)


class QwenMTPHead(MTPHead):
    """The ``mtp.*`` head of Qwen3-Next / Qwen3.5.

    Args:
      config: the target's `QwenHybridConfig` (`check_config` must pass).
      param_dtype: dtype of freshly initialised parameters.

    Parameters (checkpoint names under ``mtp.``): ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden`` (zero-centered RMSNorm [hidden]), ``fc`` (`Linear`
    weight [hidden, 2 hidden], no bias), ``layers`` (one `QwenDecoderLayer` with
    gated attention and the MLP / MoE of the target's layer 0), ``norm``
    (zero-centered RMSNorm [hidden]).

    Raises:
      ConfigError: as `check_config`.
    """

    def __init__(self, config: QwenHybridConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        super().__init__(config)
        rngs = default_rngs(rngs)
        n = config.mtp_num_hidden_layers
        # vLLM builds MTP layer i as a "full_attention" layer with the MLP type of layer index i.
        layer_config = dataclasses.replace(config, layer_types=("attention",) * n, mlp_types=config.mlp_types[:n])
        norm = dict(eps=config.rms_norm_eps, zero_centered=True, param_dtype=param_dtype)
        self.pre_fc_norm_embedding = RMSNorm(config.hidden_size, **norm)
        self.pre_fc_norm_hidden = RMSNorm(config.hidden_size, **norm)
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([QwenDecoderLayer(layer_config, i, param_dtype=param_dtype, rngs=rngs)
                                for i in range(n)])
        self.norm = RMSNorm(config.hidden_size, **norm)

    def _fuse(self, embeds, hidden):
        return self.fc(jnp.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))

    @property
    def _blocks(self):
        return self.layers

    def _block(self, layer, x, kv):
        out, kv = layer.self_attn.extend(layer.input_layernorm(x), kv)
        return layer._ffn(x + out), kv

    def _attention(self, layer):
        return layer.self_attn

    def _final_norm(self, x):
        return self.norm(x)


class NemotronHMTPBlock(NemotronHBlock):
    """A Nemotron-H block of the MTP head: ``h + mixer(norm(h))``, with the step's
    input projection on the first block and its final norm on the last.

    Args:
      config: the target's `NemotronHConfig`.
      block_type: "attention", "mlp" or "moe".
      first: holds ``enorm``, ``hnorm`` (RMSNorm [hidden]) and ``eh_proj``
        (`Linear` weight [hidden, 2 hidden], no bias).
      last: holds ``final_layernorm`` (RMSNorm [hidden]).

    Parameters: ``norm``, ``mixer`` (as `NemotronHBlock`), and the above (None where absent).
    """

    def __init__(self, config: NemotronHConfig, block_type: str, *, first: bool, last: bool,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        super().__init__(config, block_type, param_dtype=param_dtype, rngs=rngs)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.enorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype) if first else None
        self.hnorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype) if first else None
        self.eh_proj = Linear(2 * hidden, hidden, param_dtype=param_dtype, rngs=rngs) if first else None
        self.final_layernorm = RMSNorm(hidden, eps=eps, param_dtype=param_dtype) if last else None


class NemotronHMTPHead(MTPHead):
    """The ``mtp.*`` head of Nemotron-H.

    Args:
      config: the target's `NemotronHConfig` (`check_config` must pass).
      param_dtype: dtype of freshly initialised parameters.

    Parameters: ``layers`` (`NemotronHMTPBlock` per ``config.mtp_layer_types``;
    checkpoint names ``mtp.layers.{i}.*``).

    Raises:
      ConfigError: as `check_config`.
    """

    def __init__(self, config: NemotronHConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        super().__init__(config)
        types, rngs = config.mtp_layer_types, default_rngs(rngs)
        self.layers = nnx.List([
            NemotronHMTPBlock(config, t, first=i == 0, last=i == len(types) - 1, param_dtype=param_dtype, rngs=rngs)
            for i, t in enumerate(types)])

    def _fuse(self, embeds, hidden):
        first = self.layers[0]
        return first.eh_proj(jnp.concatenate([first.enorm(embeds), first.hnorm(hidden)], -1))

    @property
    def _blocks(self):
        return self.layers

    def _block(self, block, x, kv):
        u = block._normed(x)
        if block.block_type == "attention":
            out, kv = block.mixer.extend(u, kv)
        else:
            out = block.mixer(u)
        return block._residual(x, out), kv

    def _attention(self, block):
        return block.mixer if block.block_type == "attention" else None

    def _final_norm(self, x):
        last = self.layers[len(self.layers) - 1]
        return last.final_layernorm(x.astype(last.final_layernorm.weight[...].dtype))


def add_mtp_head(model: HybridCausalLM, *, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None) -> HybridCausalLM:
    """Attach the MTP head of ``model.config`` as ``model.mtp`` and return `model`.

    Args:
      model: a `QwenHybridForCausalLM` or a Nemotron-H `NemotronHForCausalLM`.
      param_dtype: dtype of the head's freshly initialised parameters.
      rngs: for the random init (normal, std 0.02; norms as their layers).

    Raises:
      ConfigError: the config declares no MTP head this module builds (`check_config`).
    """
    head = QwenMTPHead if isinstance(model.config, QwenHybridConfig) else NemotronHMTPHead
    model.mtp = nnx.data(head(model.config, param_dtype=param_dtype, rngs=rngs))  # the slot is None (static) until now
    return model


def has_mtp_head(model) -> bool:
    """Whether `model` carries an MTP head (``load_model(path, mtp=True)`` or `add_mtp_head`)."""
    return isinstance(getattr(model, "mtp", None), MTPHead)


def mtp_forward(model: HybridCausalLM, hidden: jax.Array, tokens: jax.Array,
                cache: MTPCache) -> tuple[jax.Array, jax.Array, MTPCache]:
    """The MTP head of `model` on T positions per row, after the cached ones (no argument checks).

    Args:
      model: a model with ``model.mtp`` (`add_mtp_head`).
      hidden: [batch, T, hidden], the target's final-normed hidden states at positions
        length[b] .. length[b] + T - 1 (or the head's own outputs, when chaining).
      tokens: i32[batch, T], the tokens at the positions one later.
      cache: the head's `MTPCache`.

    Returns:
      (logits f32[batch, T, vocab] for the tokens two positions later, out [batch, T,
      hidden] (the head's output after its final norm, the next chained step's hidden),
      the cache with the T entries written and length += T).
    """
    out, layers = model.mtp(model._embed(tokens), hidden, cache.layers)
    return model._lm_head(out), out, MTPCache(layers=layers)


# ------------------------------------------------------------------------------------------------
# the drafter


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x [batch, T, ...] and index i32[batch]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


@struct.dataclass
class MTPDraftState:
    """The MTP drafter's state in the speculative loop (`MTPDrafter.init_state`).

    Attributes:
      cache: the head's `MTPCache`, its length equal to the target's position per row.
      drafts: the next round's `Drafts` (computed at the end of the previous round, or
        from the prefill).
    """

    cache: MTPCache
    drafts: Drafts


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    """Speculative drafts from a model's MTP head (ARCHITECTURE.md, "Speculative decoding").

    Build it with `MTPDrafter.for_model`. Its fields are static (the drafter is
    a pytree without leaves, so it may be an argument of a jitted function), and
    `init_cache`, `propose` and `rollback` are pure functions of fixed shapes
    that run under `jax.jit`.

    In the speculative loop (`replayssm_jax.speculative.Drafter`; its state an
    `MTPDraftState`): `init_state` steps the head over the prefill's hidden
    states and prompt[1:] + the first new token, giving the first round's
    drafts; `update` steps it over the m pairs a round kept (the verified
    hidden states at pos .. pos + m - 1, the new tokens at pos + 1 .. pos + m)
    and chains the next round's K drafts; `draft` returns those. A done row
    (m = 0) keeps its cache length. The head's cache holds `max_len` entries
    per row: the history's length plus K.

    Attributes:
      graphdef: the model's static structure (`models.split_params(model)[0]`).
      num_speculative_tokens: K >= 1 drafts per round (every row proposes K).
      kv_layout: per head block, (num_key_value_heads, head_dim) or None.
      hidden_size, vocab_size: of the model.
      cache_dtype: dtype of the head's KV cache.
      sampling: greedy params (temperature 0, the default): each draft is the
        argmax of the head's logits and q_probs is None (a point mass); else
        each draft is drawn from softmax(processed_logits(logits, sampling))
        and q_probs holds that distribution (speculative sampling's q).
      scores: the Drafts also carry the head's logits at each draft position
        (`Drafts.scores`: a draft tree's other candidates, top-k per depth;
        `replayssm_jax.speculative.tree_drafters`).

    Raises:
      TypeError, ValueError: K not an int >= 1, `sampling` not a SamplingParams.
    """

    graphdef: Any
    num_speculative_tokens: int
    kv_layout: tuple
    hidden_size: int
    vocab_size: int
    cache_dtype: Any = jnp.float32
    sampling: SamplingParams = SamplingParams()
    scores: bool = False

    #: `init_state` and `update` read the target's final-normed hidden states.
    needs_hidden = True

    def __post_init__(self):
        v.check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"`sampling` must be a SamplingParams; got {type(self.sampling).__name__}")
        object.__setattr__(self, "cache_dtype", jnp.dtype(self.cache_dtype))

    @classmethod
    def for_model(cls, model: HybridCausalLM, num_speculative_tokens: int, *,
                  sampling: SamplingParams = SamplingParams(), cache_dtype=None) -> "MTPDrafter":
        """The drafter of `model`'s MTP head.

        Args:
          model: a model with an MTP head (``load_model(path, mtp=True)`` or `add_mtp_head`);
            `propose` takes its parameters (`models.split_params(model)[1]`).
          num_speculative_tokens: K >= 1.
          sampling: how drafts are chosen (see the class).
          cache_dtype: the KV cache dtype; None: that of the head's attention weights.

        Raises:
          ValueError: `model` has no MTP head.
        """
        if not has_mtp_head(model):
            raise ValueError(f"`model` ({type(model).__name__}) has no MTP head; load it with "
                             f"models.load_model(path, mtp=True)")
        head = model.mtp
        graphdef, _ = nnx.split(model)
        return cls(graphdef=graphdef, num_speculative_tokens=num_speculative_tokens, kv_layout=head.kv_layout(),
                   hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                   cache_dtype=head.cache_dtype() if cache_dtype is None else cache_dtype, sampling=sampling)

    def init_cache(self, batch: int, max_len: int) -> MTPCache:
        """An empty head cache (length 0) of `max_len` entries per row.

        max_len must hold every position the target reaches plus K - 1 (the
        chained drafts of the last round): prompt + new tokens + K is enough.

        Raises:
          TypeError, ValueError: batch or max_len not an int >= 1.
        """
        batch = v.check_positive_int("batch", batch)
        max_len = v.check_positive_int("max_len", max_len)
        return MTPCache.zeros(self.kv_layout, batch, max_len, self.cache_dtype)

    def _check_cache(self, cache, batch: int | None = None) -> MTPCache:
        if not isinstance(cache, MTPCache):
            raise TypeError(f"`cache` must be an MTPCache (from MTPDrafter.init_cache); got {type(cache).__name__}")
        kinds = tuple(None if s is None else type(s) for s in cache.layers)
        want = tuple(None if kv is None else KVCache for kv in self.kv_layout)
        if kinds != want:
            raise ValueError(f"`cache.layers` must hold {[w and w.__name__ for w in want]} (one per head block); "
                             f"got {[k and k.__name__ for k in kinds]}")
        rows = cache.batch if batch is None else batch
        for i, (state, kv) in enumerate(zip(cache.layers, self.kv_layout)):
            if state is not None:
                v.check_shape(f"cache.layers[{i}].k", state.k, "batch, max_len, num_key_value_heads, head_dim",
                              (rows, cache.max_len, *kv))
                v.check_shape(f"cache.layers[{i}].length", state.length, "batch", (rows,))
        return cache

    def propose(self, params, hidden, tokens, cache: MTPCache, key=None, *,
                num_tokens=None) -> tuple[Drafts, MTPCache]:
        """K drafts per row from the target's hidden states and the tokens after them.

        The head first steps over the T given positions (writing T entries at
        cache.length ..); its output at position num_tokens - 1 gives draft 1;
        drafts 2..K each step on the previous step's output and draft. The
        returned cache holds length + num_tokens committed entries; the K - 1
        chained entries after them are dead (overwritten by the next propose).

        Args:
          params: the model's parameters (`models.split_params(model)[1]`), the
            head's included.
          hidden: f32 | bf16[batch, T, hidden] (or [batch, hidden], T = 1): the
            target's hidden states after its final norm (``return_hidden=True``)
            at the positions it committed since the last propose.
          tokens: integer[batch, T] (or [batch]): the token one position later
            than each hidden state (the accepted drafts and the bonus token:
            `Accepted.tokens`; after a prefill, prompt[:, 1:] and the first new token).
          cache: the head's `MTPCache` (from `init_cache` or a previous propose).
          key: a PRNG key; required unless the drafter is greedy. Row b's draws
            use fold_in(key, b) only (`replayssm_jax.speculative`).
          num_tokens: integer[batch] in 1..T, the positions of each row that are
            real (`Accepted.num_accepted`; None: T for every row). Entries past
            them are written, then overwritten.

        Returns:
          (Drafts(tokens i32[batch, K], num_drafts = K for every row, q_probs
          f32[batch, K, vocab] or None when greedy), the cache with length +=
          num_tokens).

        Raises:
          TypeError: non-float `hidden`, non-integer `tokens` / `num_tokens`, a
            `cache` that is not an MTPCache, a bad `key` when sampling.
          ValueError: shapes that do not match (hidden [batch, T, hidden_size],
            tokens [batch, T], num_tokens [batch], the cache's batch and head
            layout), an id outside the vocabulary or num_tokens outside [1, T]
            (when concrete), a cache without room for T and num_tokens + K - 1
            more entries (when concrete), or a model without an MTP head.
        """
        hidden, tokens, num_tokens = self._check_inputs(hidden, tokens, num_tokens)
        cache = self._check_cache(cache, hidden.shape[0])
        self._check_room(cache, hidden.shape[1], num_tokens)
        if not self.sampling.greedy:
            key = _checks.check_key(key)
        model = nnx.merge(self.graphdef, params)
        if not has_mtp_head(model):
            raise ValueError(f"`params` give a {type(model).__name__} without an MTP head")
        return self._step(model, hidden, tokens, cache, key, num_tokens)

    def _step(self, model, hidden, tokens, cache: MTPCache, key, num_tokens) -> tuple[Drafts, MTPCache]:
        """`propose` on checked arguments and the merged model."""
        batch = hidden.shape[0]
        k = self.num_speculative_tokens
        committed = cache.length + num_tokens
        logits, out, cache = mtp_forward(model, hidden, tokens, cache)
        last = num_tokens - 1
        keys = _checks.row_keys(key, batch, k) if not self.sampling.greedy else None
        first = _at(logits, last)
        draft, q = choose_drafts(first, self.sampling, None if keys is None else keys[0])
        cache = cache.with_length(committed)

        def chain(carry, step_keys):
            out, draft, cache = carry
            logits, out, cache = mtp_forward(model, out[:, None], draft[:, None], cache)
            draft, q = choose_drafts(logits[:, 0], self.sampling, step_keys)
            return (out[:, 0], draft, cache), (draft, q, logits[:, 0] if self.scores else None)

        drafts, qs = draft[:, None], None if q is None else q[:, None]
        scores = first[:, None] if self.scores else None
        if k > 1:
            (_, _, cache), (rest, rest_q, rest_scores) = jax.lax.scan(
                chain, (_at(out, last), draft, cache), None if keys is None else keys[1:], length=k - 1)
            drafts = jnp.concatenate([drafts, jnp.swapaxes(rest, 0, 1)], axis=1)
            if q is not None:
                qs = jnp.concatenate([qs, jnp.swapaxes(rest_q, 0, 1)], axis=1)
            if self.scores:
                scores = jnp.concatenate([scores, jnp.swapaxes(rest_scores, 0, 1)], axis=1)
        result = Drafts(tokens=drafts.astype(jnp.int32), num_drafts=jnp.full((batch,), k, jnp.int32), q_probs=qs,
                        scores=scores)
        return result, cache.with_length(committed)

    # -- the speculative loop's interface (replayssm_jax.speculative.Drafter) -----------------------
    def init_state(self, target, start: DraftStart) -> MTPDraftState:
        """The head stepped over the prefill: (hidden at p, token at p + 1) for p < P.

        Args:
          target: the target model with its MTP head (merged inside the trace).
          start: `DraftStart` with the prefill's hidden states [rows, P, hidden]
            and the history (prompt, then the first new token at position P).

        Returns:
          MTPDraftState: a cache of history length + K entries per row with
          length P, and the first round's drafts.

        Raises:
          ValueError: `target` without an MTP head, or `start` without hidden states.
        """
        if not has_mtp_head(target):
            raise ValueError(f"`target` is a {type(target).__name__} without an MTP head; load it with "
                             f"models.load_model(path, mtp=True)")
        if start.hidden is None:
            raise ValueError("`start.hidden` is None: the MTP drafter needs the prefill's hidden states "
                             "(prefill with return_hidden=True)")
        rows, max_len = start.history.shape
        p = start.prefix_len
        cache = self.init_cache(rows, max_len + self.num_speculative_tokens)
        num_tokens = jnp.full((rows,), p, jnp.int32)
        drafts, cache = self._step(target, start.hidden, start.history[:, 1:p + 1], cache, start.key, num_tokens)
        return MTPDraftState(cache=cache, drafts=drafts)

    def draft(self, target, state: MTPDraftState, history, lengths, key) -> tuple[Drafts, MTPDraftState]:
        """The drafts `init_state` or the last `update` chained (history, lengths and key unused)."""
        return state.drafts, state

    def update(self, target, state: MTPDraftState, kept: Kept) -> MTPDraftState:
        """The head stepped over the m pairs the round kept, and the next round's drafts.

        Rows with m = 0 (done) step over one dead entry and keep their length.
        """
        m = kept.num_kept
        drafts, cache = self._step(target, kept.hidden, kept.tokens, state.cache, kept.key, jnp.maximum(m, 1))
        cache = cache.with_length(jnp.where(m > 0, cache.length, state.cache.length))
        return MTPDraftState(cache=cache, drafts=drafts)

    def rollback(self, cache: MTPCache, lengths) -> MTPCache:
        """The cache with each row's length set back to `lengths` (entries past it are dead).

        Args:
          cache: the head's `MTPCache`.
          lengths: integer[batch] in 0..cache.length (checked when concrete):
            the target's position each row returns to.

        Returns:
          The cache with length = lengths (the K / V arrays unchanged).

        Raises:
          TypeError: `cache` not an MTPCache, `lengths` not integers.
          ValueError: `lengths` not [batch] or (concrete) outside [0, cache.length].
        """
        cache = self._check_cache(cache)
        lengths = v.check_int_range("lengths", lengths, "batch", (cache.batch,), 0, cache.length)
        return cache.with_length(lengths)

    # -- pieces -------------------------------------------------------------------------------
    def _check_inputs(self, hidden, tokens, num_tokens):
        """(hidden [batch, T, hidden], tokens i32[batch, T], num_tokens i32[batch]), checked."""
        hidden = v.check_float("hidden", hidden)
        if hidden.ndim == 2:
            hidden = hidden[:, None]
            tokens = check_tokens(tokens, self.vocab_size)[:, None]
        elif hidden.ndim == 3:
            tokens = check_input_ids(tokens, self.vocab_size, name="tokens")
        else:
            raise ValueError(f"`hidden` must have shape [batch, T, hidden] or [batch, hidden]; got {hidden.shape}")
        batch, window, width = hidden.shape
        v.check_rank("hidden", hidden, "batch, T, hidden")
        if width != self.hidden_size:
            raise ValueError(f"`hidden` must have shape [batch, T, hidden] with hidden = {self.hidden_size}; got "
                             f"{tuple(hidden.shape)}")
        v.check_shape("tokens", tokens, "batch, T", (batch, window))
        if num_tokens is None:
            num_tokens = jnp.full((batch,), window, jnp.int32)
        num_tokens = v.check_int_range("num_tokens", num_tokens, "batch", (batch,), 1, window)
        return hidden, tokens, num_tokens

    def _check_room(self, cache: MTPCache, window: int, num_tokens) -> None:
        """Raise unless every row has room for T and num_tokens + K - 1 new entries (concrete values only)."""
        if isinstance(cache.length, jax.core.Tracer) or isinstance(num_tokens, jax.core.Tracer):
            return
        length, n = np.asarray(cache.length), np.asarray(num_tokens)
        need = length + np.maximum(window, n + self.num_speculative_tokens - 1)
        if need.max() > cache.max_len:
            row = int(np.argmax(need))
            raise ValueError(f"`cache` is too short: row {row} holds {int(length[row])} entries and needs "
                             f"{int(need[row])} (T = {window} new, then num_tokens - 1 + K = "
                             f"{int(n[row]) - 1 + self.num_speculative_tokens}); max_len = {cache.max_len}")


jax.tree_util.register_dataclass(
    MTPDrafter, data_fields=[],
    meta_fields=["graphdef", "num_speculative_tokens", "kv_layout", "hidden_size", "vocab_size", "cache_dtype",
                 "sampling", "scores"])
