"""The roofline of one decode step: the least time its traffic and its GEMMs need on this device.

A decode step of a hybrid model runs, in order, GEMMs (the projections, MLP and LM head),
attention over the KV caches, and the SSM kernels over their states. Its bound is the sum of

- GEMMs: per other dot of the step's jaxpr (projections, MLP, experts, LM head), max(its operand
  and result bytes at the copy bandwidth, its FLOPs at the bf16 matmul rate);
- attention: per dot under the attention layers' name scope (`ATTENTION_SCOPE`: scores and
  values over a KV cache), and per Pallas kernel there (the decode attention kernel), its bytes
  at the copy bandwidth, a KV cache operand (an array of a KV cache's shape) counted at the live
  length only (the positions a step must read, not the cache's allocated max_len);
- SSM states (the Pallas kernels, which are no dots of the jaxpr; with the "xla" backend the
  dots of the ops' reference form, under the layers' `SSM_SCOPE`, are left out of the GEMMs:
  their traffic is this term): standard state 2 |S| (read and written); ReplaySSM checkpoint |S| (1 + 2 / L)
  (read, and re-read and written once per flush), |S| (1 + 1 / L) where the Generator decodes in
  lockstep (read, and written by the direct step that flushes every row once per L steps), and
  buffer records B (1 + 1 / L) (read, one of L slots written); the conv ring R W / S (W - 1 of its
  S columns read, one written).

Elementwise work (norms, gates, the conv's arithmetic, sampling) is left out: the sum is a lower
bound. `decode_roofline` derives every term from the shapes of the model's compiled decode
(`jax.make_jaxpr` of `HybridCausalLM.decode` on the Generator's cache layout): nothing runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.layers.attention import ATTENTION_SCOPE
from replayssm_jax.layers.cache import KVCache, ReplayLayerState, SSMLayerState
from replayssm_jax.layers.ssm_mixer import SSM_SCOPE


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize


def _subjaxprs(eqn):
    """(jaxpr, times it runs per run of eqn) of each jaxpr an equation calls; a Pallas kernel's body is not
    the step's XLA work (its traffic is counted from the states) and is skipped."""
    if eqn.primitive.name == "pallas_call":
        return
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr, times
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item, times


def _attention_bytes(avals, kv_shapes: frozenset, live_fraction: float) -> float:
    """Bytes of attention operands or results, one of a KV cache's shape (in `kv_shapes`) at `live_fraction`
    of its size."""
    return sum(_nbytes(a) * (live_fraction if tuple(a.shape) in kv_shapes else 1) for a in avals)


def dot_costs(jaxpr, kv_shapes: frozenset, live_fraction: float, times: int = 1):
    """(kind, bytes, flops) of every dot_general in `jaxpr` and the jaxprs it calls: kind "attention" (under
    `ATTENTION_SCOPE`; an operand of a KV cache's shape, one of `kv_shapes`, counted at `live_fraction` of
    its bytes: live length over max_len) or "gemm"; and of every Pallas kernel under `ATTENTION_SCOPE` (the
    decode attention kernel): "attention", its operands' and results' bytes counted so, its FLOPs 0 (the
    bound is its traffic). The SSM state ops (under `SSM_SCOPE`) are skipped: the state term counts them."""
    for eqn in jaxpr.eqns:
        if SSM_SCOPE in str(eqn.source_info.name_stack):
            continue
        if eqn.primitive.name == "pallas_call" and ATTENTION_SCOPE in str(eqn.source_info.name_stack):
            avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
            yield "attention", times * _attention_bytes(avals, kv_shapes, live_fraction), 0
        elif eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval for v in eqn.invars)
            out = eqn.outvars[0].aval
            flops = 2 * int(np.prod(out.shape)) * math.prod(lhs.shape[d] for d in lhs_contract)
            if ATTENTION_SCOPE in str(eqn.source_info.name_stack):
                yield "attention", times * (_attention_bytes((lhs, rhs), kv_shapes, live_fraction) + _nbytes(out)), \
                    times * flops
            else:
                yield "gemm", times * (_nbytes(lhs) + _nbytes(rhs) + _nbytes(out)), times * flops
        for sub, count in _subjaxprs(eqn):
            yield from dot_costs(sub, kv_shapes, live_fraction, times * count)


def state_bytes(cache, lockstep: bool = False) -> int:
    """Bytes the SSM kernels and conv rings of one decode step must move (module docstring), from the
    cache's shapes; `lockstep`: every row's flush as one direct step a cycle (Generator's lockstep)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, (SSMLayerState, ReplayLayerState)):
            ring = layer.conv_state.columns
            total += _nbytes(ring) * layer.conv_state.width / ring.shape[1]
        if isinstance(layer, SSMLayerState):
            total += 2 * _nbytes(layer.ssm_state)
        elif isinstance(layer, ReplayLayerState):
            replay = layer.replay
            L = replay.buffer_len
            checkpoint = _nbytes(replay.checkpoint) + (0 if replay.scale is None else _nbytes(replay.scale))
            per_row = {id(x) for x in (replay.checkpoint, replay.scale, replay.cursor, replay.counter)}
            records = sum(_nbytes(a) for a in jax.tree.leaves(replay) if id(a) not in per_row)
            total += checkpoint * (1 + (1 if lockstep else 2) / L) + records * (1 + 1 / L)
    return int(total)


def decode_roofline(gen, batch: int, prompt_len: int, new_tokens: int, copy_gbps: float,
                    matmul_tflops: float) -> dict:
    """The roofline of one decode step of `gen` (a replayssm_jax.generation.Generator) at `batch` rows,
    halfway through `new_tokens` after `prompt_len` (the live KV length), on the Generator's cache layout
    (max_len = prompt_len + new_tokens).

    Returns {"ms": the bound, "gemm_ms", "attention_ms", "state_ms", "weights_gib" (the GEMMs' operand
    bytes), "gemm_tflop", "state_gib", "copy_gbps", "matmul_tflops"}."""
    graphdef, params = gen.graphdef, gen.params
    max_len = prompt_len + new_tokens
    ids = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)

    def prefill(params, ids):
        return nnx.merge(graphdef, params).prefill(
            ids, max_len, replay_buffer_len=gen.buffer_len, buffer_dtype=gen.buffer_dtype, backend=gen.backend,
            last_logits_only=True, checkpoint_dtype=gen.state_dtype, checkpoint_rounding=gen.state_rounding)[1]

    cache = jax.eval_shape(prefill, params, ids)

    def decode(params, cache, tokens):
        return nnx.merge(graphdef, params).decode(tokens, cache, route=gen.route, backend=gen.backend)

    jaxpr = jax.make_jaxpr(decode)(params, cache, jax.ShapeDtypeStruct((batch,), jnp.int32)).jaxpr
    bandwidth, rate = copy_gbps * 1e9, matmul_tflops * 1e12
    kv_shapes = frozenset(tuple(a.shape) for layer in cache.layers if isinstance(layer, KVCache)
                          for a in (layer.k, layer.v))
    costs = list(dot_costs(jaxpr, kv_shapes, (prompt_len + new_tokens // 2) / max_len))
    gemm_s = sum(max(b / bandwidth, f / rate) for kind, b, f in costs if kind == "gemm")
    attention_s = sum(b / bandwidth for kind, b, _ in costs if kind == "attention")
    states = state_bytes(cache, lockstep=gen.lockstep_cycle(cache) is not None)
    state_s = states / bandwidth
    return dict(ms=1e3 * (gemm_s + attention_s + state_s), gemm_ms=1e3 * gemm_s, attention_ms=1e3 * attention_s,
                state_ms=1e3 * state_s, weights_gib=sum(b for kind, b, _ in costs if kind == "gemm") / 2**30,
                gemm_tflop=sum(f for kind, _, f in costs if kind == "gemm") / 1e12, state_gib=states / 2**30,
                copy_gbps=copy_gbps, matmul_tflops=matmul_tflops)
