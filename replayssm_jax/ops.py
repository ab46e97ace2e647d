"""Public SSM ops with a choice of backend.

Every op has the signature of its :mod:`replayssm_jax.reference` namesake
plus a keyword-only `backend`:

  "xla"        the pure-JAX reference (any platform),
  "pallas"     the Pallas GPU kernels, compiled (needs a CUDA GPU),
  "interpret"  the same Pallas kernels in interpret mode (any platform; slow,
               for tests),
  None         "pallas" when JAX's default backend is a GPU and the op has a
               Pallas kernel (:data:`KERNEL_OPS`), else "xla".

An explicitly requested backend that cannot run raises (no GPU for
"pallas"; no kernel for the op); nothing falls back silently. The kernel
backends accept a keyword-only `config=` (:class:`replayssm_jax.kernels.StepConfig`
for the standard step and the replay step's direct route,
:class:`replayssm_jax.kernels.ReplayConfig` for its output and state
routes) that overrides the frozen tiling heuristic.
"""

from __future__ import annotations

import functools
import math

import jax

from replayssm_jax import _validate as val
from replayssm_jax import reference
from replayssm_jax.reference import gdn as _ref_gdn
from replayssm_jax.reference import mamba2 as _ref_mamba2
from replayssm_jax.state import (  # noqa: F401  (re-exported)
    GDNReplayState,
    Mamba2ReplayState,
    gdn_replay_init,
    mamba2_replay_init,
    replay_commit,
)

BACKENDS = ("pallas", "interpret", "xla")

# Ops with a Pallas kernel; the others run the reference on every backend
# choice of None and raise for an explicit "pallas" / "interpret".
KERNEL_OPS = frozenset({"mamba2_step", "mamba2_replay_step", "gdn_step", "gdn_replay_step"})


def default_backend() -> str:
    """"pallas" on a GPU, "xla" elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_backend(backend: str | None, op: str | None = None) -> str:
    """Validate `backend` (None picks :func:`default_backend`, or "xla" for
    an op without a kernel).

    Raises:
      ValueError: an unknown backend name.
      RuntimeError: "pallas" requested where JAX has no GPU.
    """
    if backend is None:
        return default_backend() if op is None or op in KERNEL_OPS else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS} or None; got {backend!r}")
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"`backend='pallas'` needs a CUDA GPU; JAX's default backend is {jax.default_backend()!r}"
            " (use backend='interpret' to run the kernels on the CPU, or 'xla')"
        )
    return backend


def check_buffer_len(buffer_len: int, backend: str | None, name: str = "buffer_len") -> None:
    """Raise ValueError if the replay-step kernels that `backend` selects cannot
    take a buffer of `buffer_len` slots (the limit of :mod:`replayssm_jax.kernels`;
    the "xla" backend has none). `name` is the caller's argument name."""
    chosen = resolve_backend(backend, "mamba2_replay_step")
    if chosen == "xla":
        return
    from replayssm_jax.kernels import MAX_BUFFER_LEN

    if buffer_len > MAX_BUFFER_LEN:
        raise ValueError(f"`{name}` must be <= {MAX_BUFFER_LEN} with backend {chosen!r} (the kernels' limit); "
                         f"got {buffer_len} (use backend='xla')")


def _replay_route(route: str, state, config) -> str:
    """`route`, with "auto" resolved: the direct route where the kernels'
    default replay step is one launch (a latency-bound grid) and no `config`
    is given, else the output route."""
    from replayssm_jax import kernels

    if val.check_route(route) != "auto":
        return route
    batch, heads, V, K = state.checkpoint.shape
    one_launch = kernels.replay_is_one_launch(batch, heads, V, K, state.checkpoint.dtype, state.buffer_len)
    return "direct" if config is None and one_launch else "output"


def _gdn_scale(scale, state_shape) -> float:
    return state_shape[-1] ** -0.5 if scale is None else float(scale)


def _kernel_gdn_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=True, *, interpret, config=None):
    from replayssm_jax import kernels

    state = _ref_gdn._check_state(state)
    _ref_gdn._check_inputs(state.shape, q, k, v, g, beta, scale, use_qk_l2norm)
    return kernels.gdn_step(state, q, k, v, g, beta, scale=_gdn_scale(scale, state.shape),
                            use_qk_l2norm=bool(use_qk_l2norm), config=config, interpret=interpret)


def _kernel_gdn_replay_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=True, route="output", *, interpret,
                            config=None):
    from replayssm_jax import kernels

    _ref_gdn._check_replay_inputs(state, q, k, v, g, beta, scale, use_qk_l2norm)
    return kernels.gdn_replay_step(state, q, k, v, g, beta, scale=_gdn_scale(scale, state.checkpoint.shape),
                                   use_qk_l2norm=bool(use_qk_l2norm), route=_replay_route(route, state, config),
                                   config=config, interpret=interpret)


def _kernel_mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                        dt_limit=(0.0, math.inf), *, interpret, config=None):
    from replayssm_jax import kernels

    state = _ref_mamba2._check_state(state)
    _ref_mamba2._check_inputs(state.shape, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    return kernels.mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=bool(dt_softplus),
                               dt_limit=val.check_dt_limit(dt_limit), config=config, interpret=interpret)


def _kernel_mamba2_replay_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                               dt_limit=(0.0, math.inf), route="output", *, interpret, config=None):
    from replayssm_jax import kernels

    _ref_mamba2._check_replay_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_limit)
    return kernels.mamba2_replay_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=bool(dt_softplus),
                                      dt_limit=val.check_dt_limit(dt_limit), route=_replay_route(route, state, config),
                                      config=config, interpret=interpret)


# The kernels take validated arguments in keyword form: these check them as
# the reference does, resolve the defaults (scale) and route="auto", and call them.
_KERNEL_CALLS = {
    "gdn_step": _kernel_gdn_step,
    "gdn_replay_step": _kernel_gdn_replay_step,
    "mamba2_step": _kernel_mamba2_step,
    "mamba2_replay_step": _kernel_mamba2_replay_step,
}


def _kernel(name: str, backend: str):
    """The Pallas implementation of op `name`, bound to compiled or interpret mode."""
    if name not in KERNEL_OPS:
        raise NotImplementedError(f"op {name!r} has no Pallas kernel; use backend='xla' (or None)")
    return functools.partial(_KERNEL_CALLS[name], interpret=backend == "interpret")


def _op(name: str):
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def op(*args, backend: str | None = None, **kwargs):
        chosen = resolve_backend(backend, name)
        if chosen == "xla":
            if kwargs.get("config") is not None:
                if name not in KERNEL_OPS:
                    why = f" ({name} has no Pallas kernel: it runs the reference on every backend)"
                elif backend is None:
                    why = f" (backend=None picked it: JAX's default backend is {jax.default_backend()!r})"
                else:
                    why = ""
                raise TypeError(f"`config` tunes the Pallas kernels; the 'xla' backend{why} takes none")
            kwargs.pop("config", None)  # config=None: the default, accepted by every backend
        impl = ref if chosen == "xla" else _kernel(name, chosen)
        return impl(*args, **kwargs)

    if name in KERNEL_OPS:
        backends = "'pallas' (GPU), 'interpret', 'xla' or None (see replayssm_jax.ops); `config` tunes the kernels"
    else:
        backends = ("'xla' or None: this op has no Pallas kernel, so 'pallas' and 'interpret' raise "
                    "NotImplementedError")
    op.__doc__ = (ref.__doc__ or "").rstrip() + f"\n\n    Backend (keyword-only `backend`): {backends}.\n"
    return op


mamba2_step = _op("mamba2_step")
mamba2_chunked = _op("mamba2_chunked")
mamba2_replay_step = _op("mamba2_replay_step")
mamba2_replay_verify = _op("mamba2_replay_verify")
mamba2_replay_materialize = _op("mamba2_replay_materialize")
mamba2_replay_flush = _op("mamba2_replay_flush")
gdn_step = _op("gdn_step")
gdn_chunked = _op("gdn_chunked")
gdn_replay_step = _op("gdn_replay_step")
gdn_replay_verify = _op("gdn_replay_verify")
gdn_replay_materialize = _op("gdn_replay_materialize")
gdn_replay_flush = _op("gdn_replay_flush")
