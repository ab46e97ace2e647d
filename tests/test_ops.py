"""replayssm_jax.ops: backend and route resolution, and the docstrings of the public ops.

The argument checks are tested in test_validation.py, the math in
test_reference.py, the kernels in test_kernels.py.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from replayssm_jax import kernels, ops, reference
from replayssm_jax.ops import dispatch


@pytest.mark.parametrize(("layer", "batch", "picked"), [
    ("gdn", 1, "direct"), ("gdn", 4, "direct"), ("gdn", 8, "output"), ("gdn", 256, "deferred"),
    ("mamba2", 1, "direct"), ("mamba2", 2, "output"), ("mamba2", 64, "deferred"),
])
def test_auto_route_at_model_shapes(layer, batch, picked):
    """The direct route where the default replay step is one launch (batch x
    heads <= 132): Qwen3.5-4B's GDN layer (32 value heads) at batch 1-4,
    Nemotron-3-Nano-4B's Mamba-2 layer (96 heads) at batch 1; the deferred
    route from DEFERRED_MIN_BATCH rows outside a state pool; else the output
    route."""
    if layer == "gdn":
        rs = jax.eval_shape(lambda: ops.gdn_replay_init(jnp.zeros((batch, 32, 128, 128)), 16, 16))
    else:
        rs = jax.eval_shape(lambda: ops.mamba2_replay_init(jnp.zeros((batch, 96, 80, 128)), 16, 8))
    rows, cols = rs.checkpoint.shape[2:]
    assert kernels.replay_is_one_launch(batch, rs.checkpoint.shape[1], rows, cols, jnp.float32, 16) == (
        picked == "direct")
    for backend in ("pallas", "interpret"):
        assert ops.resolve_route("auto", backend, rs) == picked
        # over a state pool: the output route where the deferred route would be taken
        assert ops.resolve_route("auto", backend, rs, pool=True) == ("output" if picked == "deferred" else picked)
        assert ops.resolve_route("auto", backend, rs, kernels.ReplayConfig(block_v=16)) == "output"
        assert ops.resolve_route("auto", backend, rs, kernels.StepConfig(block_v=16)) == "direct"
    assert (picked == "deferred") == (batch >= dispatch.DEFERRED_MIN_BATCH)
    assert ops.resolve_route("auto", "xla", rs) == "output"
    for route in ("output", "state", "direct", "deferred"):
        assert ops.resolve_route(route, "interpret", rs) == route
        assert ops.resolve_route(route, "xla", rs) == route
    with pytest.raises(ValueError, match="`route` must be one of 'output', 'state', 'direct', 'deferred', 'auto', "
                                         "'append'; got 'fast'"):
        ops.resolve_route("fast", "interpret", rs)


def test_backend_for_a_model():
    """A model's backend applies to its ops with a kernel; the others (the
    chunked prefill forms) run "xla". The model's choice is checked also for
    an op without a kernel."""
    for backend in ("interpret", "xla"):
        assert ops.backend_for("mamba2_step", backend) == backend
        assert ops.backend_for("gdn_replay_step", backend) == backend
        assert ops.backend_for("mamba2_chunked", backend) == "xla"
        assert ops.backend_for("gdn_chunked", backend) == "xla"
    assert ops.backend_for("gdn_step", None) == ops.default_backend()
    assert ops.backend_for("gdn_chunked", None) == "xla"
    with pytest.raises(ValueError, match=r"`backend` must be one of \('pallas', 'interpret', 'xla'\) or None; "
                                         r"got 'cuda'"):
        ops.backend_for("gdn_chunked", "cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="`backend='pallas'` needs a CUDA GPU"):
            ops.backend_for("mamba2_chunked", "pallas")


def test_ops_without_a_kernel_refuse_kernel_backends():
    with pytest.raises(NotImplementedError, match="op 'gdn_chunked' has no Pallas kernel; use backend='xla'"):
        dispatch.choose_backend("gdn_chunked", "interpret", None)
    with pytest.raises(TypeError, match=r"the 'xla' backend \(gdn_chunked has no Pallas kernel"):
        dispatch.choose_backend("gdn_chunked", None, kernels.StepConfig(block_v=8))
    assert dispatch.choose_backend("gdn_step", "interpret", kernels.StepConfig(block_v=8)) == "interpret"
    assert dispatch.choose_backend("gdn_chunked", None, None) == "xla"
    assert set(ops.KERNEL_OPS) == {"attention_decode", "conv_update", "mamba2_step", "mamba2_verify", "mamba2_replay_step", "mamba2_replay_verify",
                                   "gdn_conv_step", "gdn_step", "gdn_verify", "gdn_replay_step", "gdn_replay_verify"}


OPS = [name for name in ops.__all__ if name.startswith(("mamba2_", "gdn_", "conv_", "attention_"))
       or name == "replay_commit"]


@pytest.mark.parametrize("name", OPS)
def test_public_ops_are_documented_functions(name):
    """Each public op is its own function with Args, Returns and Raises, and
    (but the state constructors) a keyword-only `backend` and `config`."""
    op = getattr(ops, name)
    assert inspect.isfunction(op) and op.__module__ == "replayssm_jax.ops" and op.__name__ == name
    doc = inspect.getdoc(op)
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, f"{name}: no {section} section"
    params = inspect.signature(op).parameters
    if name.endswith("_init") or name == "replay_commit":
        return
    assert "replayssm_jax.reference." in doc, f"{name}: the docstring names no source of the math"
    for kw in ("backend", "config"):
        assert params[kw].kind is inspect.Parameter.KEYWORD_ONLY and params[kw].default is None
    # The reference namesake takes the same arguments, less backend and config (and a decode step's
    # keyword-only `slots`, a state pool's rows: the reference steps the rows it is given).
    ref_params = inspect.signature(getattr(reference, name)).parameters
    if "slots" in params:
        assert params["slots"].kind is inspect.Parameter.KEYWORD_ONLY and params["slots"].default is None
    assert list(ref_params) == [p for p in params if p not in ("backend", "config", "slots")]
