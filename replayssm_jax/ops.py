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
backends accept a keyword-only `config=` (:class:`replayssm_jax.kernels.Config`)
that overrides the frozen tiling heuristic.
"""

from __future__ import annotations

import functools

import jax

from replayssm_jax import reference
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


def _kernel(name: str, backend: str):
    """The Pallas implementation of op `name`, bound to compiled or interpret mode."""
    from replayssm_jax import kernels

    if name not in KERNEL_OPS:
        raise NotImplementedError(f"op {name!r} has no Pallas kernel; use backend='xla' (or None)")
    impl = getattr(kernels, name)
    return functools.partial(impl, interpret=backend == "interpret")


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
