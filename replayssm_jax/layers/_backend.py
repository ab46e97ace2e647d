"""Backend choice for the SSM ops the layers call."""

from __future__ import annotations

from replayssm_jax import ops


def chunked_backend(op_name: str, backend: str | None) -> str | None:
    """The backend of a prefill (chunked) op, given the model's `backend`.

    A model's `backend` selects the implementation of its decode ops. The
    chunked prefill forms have no Pallas kernel (:data:`ops.KERNEL_OPS`), so
    under "pallas" or "interpret" they run their XLA form; None and "xla"
    pass through (None already resolves to "xla" for an op without a kernel).
    The model's backend is validated first: an unknown name raises
    ValueError, and "pallas" without a GPU RuntimeError, at prefill already.
    """
    ops.resolve_backend(backend)
    if backend in ("pallas", "interpret") and op_name not in ops.KERNEL_OPS:
        return "xla"
    return backend
