"""Checks of two forms of a layer's op inputs against each other (GDN's raw and given gates, Mamba-2's dt
inside a wider array and dt itself): every decode-time op, on one backend, with the same draws."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import kernels, ops
from replayssm_jax.speculative.tree import DraftTree

f32, bf16 = jnp.float32, jnp.bfloat16
L = 8  # the replay states' buffer length

# (op, replay route, draft tree) of every decode-time op.
_OPS = [("step", None, None)] + [("replay_step", route, None)
                                 for route in ("output", "state", "direct", "append", "deferred")] + [
    ("replay_verify", None, None), ("replay_verify", None, DraftTree((-1, 0, 0, 1, 2))),
    ("verify", None, None), ("verify", None, DraftTree((-1, 0, 0)))]
# The replay step's output route at two tilings besides the default, which at the tests' CPU shapes (batch x
# heads within one wave of programs, `kernels.config.default_replay_config`) fuses the flush into the replay
# launch with one row tile a program: the flush fused with three row tiles a program, and a launch of its
# own over blocks of two batch rows (the per-head parameters not indexed by row).
_FLUSH_TILINGS = {"fused-flush": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3, fused_flush=True),
                  "flush-launch-2-rows": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=2, flush_block_v=4,
                                                              flush_warps=1, flush_rows=2)}


def _case(name, route, tree, config, backend, tag="", slow=False):
    marks = [pytest.mark.gpu] if backend == "pallas" else [pytest.mark.slow] if slow else []
    case_id = "-".join(filter(None, (name, route, "tree" if tree else "", tag, backend)))
    return pytest.param(name, route, tree, config, backend, marks=marks, id=case_id)


# (op, route, tree, config, backend) of the checks: every op on the reference and the interpreted kernels,
# the chunked prefill on the reference, the output route on both flush tilings interpreted, and every op
# compiled (GPU marker, at the test's GPU shape). In the default run: on the reference the step and the
# chunked prefill, the others `slow` (each reference op takes the input form by one shared helper at its
# entry, before any route or tree: `reference.mamba2.dt_columns`, `reference.gdn._gates_of`); interpreted
# every op on a chain, the replay step on the output, direct and append routes and the flush launch of its
# own; the draft trees `slow` (a tree's nodes read their inputs by the chain's per-step code, `_window_steps`
# of the kernels), and so are the state and deferred routes (SLOW_ROUTES) and the fused flush of three row
# tiles a program (the default tiling's output route fuses the flush, one tile a program).
SLOW_ROUTES = ("state", "deferred")  # the state route reads the step's inputs as the output route, the
# deferred route's replay kernel as the append route (its flush launch reads the records only)
FORM_CASES = ([_case(*op, None, "xla", slow=op[0] != "step") for op in _OPS]
              + [_case(*op, None, "interpret", slow=op[2] is not None or op[1] in SLOW_ROUTES) for op in _OPS]
              + [_case("chunked", None, None, None, "xla")]
              + [_case("replay_step", "output", None, config, "interpret", tag, slow=tag == "fused-flush")
                 for tag, config in _FLUSH_TILINGS.items()]
              + [_case(*op, None, "pallas") for op in _OPS])


def cursors(route, batch: int) -> np.ndarray:
    """Mixed cursors in 0..L; a full row (cursor L, as after a commit) but on the append route."""
    top = L - 1 if route == "append" else L
    return (np.arange(batch) * 5 + 1) % (top + 1)


def run_both_forms(layer, name, rng, backend, forms, route=None, tree=None, config=None):
    """(op on the first form, op on the second) of op `name` ("step", "replay_step", "replay_verify",
    "verify" or "chunked") of the adapter `layer` (replayssm_jax.testing.GDN or Mamba2) on `backend`, on
    one state and one draw of inputs: forms(inputs) -> (keywords of the first form, of the second), each
    with the layer's parameters (`layer._kw`). route, tree, config: of the replay step and the verifies."""
    s, op = layer.s, getattr(ops, f"{layer.layer}_{'verify' if name == 'verify' else name}")
    heads_dims = layer.heads_dims()
    if name == "step":
        lead, state = (), (layer.state(f32),)
    elif name == "replay_step":
        lead, state = (), (layer.replay_state(L, f32, bf16, cursors(route, s.batch)),)
    elif name == "replay_verify":
        lead, state = (4 if tree is None else tree.size,), (layer.replay_state(L, f32, bf16, np.arange(s.batch) * 3
                                                                                % (L + 1)),)
    elif name == "verify":
        W = 3 if tree is None else tree.size
        lead = (W,)
        state = (jnp.asarray(0.5 * rng.standard_normal((s.batch, W + 1, *heads_dims)), f32),
                 jnp.asarray(np.arange(s.batch) % (W + 1), jnp.int32))
    else:  # chunked
        lead, state = (11,), (layer.state(f32),)
    options = dict(route=route, config=config) if name == "replay_step" else (
        dict(tree=tree) if "verify" in name else dict(chunk_size=4) if name == "chunked" else {})
    return tuple(op(*state, **layer._kw(inputs), **options, backend=backend) for inputs in forms(layer.draw(*lead)))


def lowered_params(lowered):
    """pytest.params of the CUDA-lowering cases (op, route, TMAReadoutConfig or None) of an input form, with
    ids; the Triton state and deferred routes `slow` (SLOW_ROUTES: their reads of the step's inputs are the
    output and append routes', which lower by default)."""
    return [pytest.param(n, r, c, id=f"{n}-{r or ''}-{'tma' if c is not None else 'triton'}",
                         marks=[pytest.mark.slow] if c is None and r in SLOW_ROUTES else [])
            for n, r, c in lowered]
