"""Backend choice for the SSM ops the layers call."""

from __future__ import annotations

from replayssm_jax import ops


def chunked_backend(op_name: str, backend: str | None) -> str | None:
    """The backend for a chunked (prefill) op.

    An explicit `backend` is passed through unchanged (and fails loudly in
    replayssm_jax.ops if it cannot run). With None, the platform default is used
    when it implements `op_name`; on a GPU, where the default is "pallas" and the
    chunked forms have no Pallas kernel yet, the prefill runs the "xla" form (the
    decode ops still get the default, i.e. the kernels).
    """
    if backend is not None:
        return backend
    if ops.default_backend() == "xla":
        return None
    from replayssm_jax import kernels

    return None if hasattr(kernels, op_name) else "xla"
