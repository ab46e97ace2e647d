"""How the library compiles a model's programs: `jax.jit` with `COMPILER_OPTIONS`.

XLA's GPU pipeline merges dots that share an operand (its DotMerger pass, where
one of them has at most `xla_gpu_dot_merger_threshold_mb` of operands and
result): ``x @ W1.T`` and ``x @ W2.T`` become one dot of ``x`` with
``concatenate(W1, W2)``. With weights passed as arguments (`nnx.split`'s
params), the concatenation is not a constant: every decode step copies the
merged weights or runs the dot as a Triton fusion that reads them piecewise.
In Qwen3.5-4B that merged gate_proj with up_proj, in_proj_qkv with in_proj_z,
and q/k/v_proj; at batch 256 the merged dots took 4.1 ms of a 15.2 ms decode
step (H200, bench/RESULTS.md, 2026-12-02). A decode step is bound by reading
the weights once, so no merge pays there: the options turn the pass off.

Every program the library compiles from a model (generation, the engine,
speculative rounds, `models.make_*`) goes through `jit`. A program of your
own over a model's `decode` or `verify` should pass ``compiler_options=
COMPILER_OPTIONS`` to its top-level `jax.jit` too (JAX takes compiler options
there only; a library program called inside it follows the outer program's).
The options name a GPU debug option, which other backends accept and ignore.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

__all__ = ["COMPILER_OPTIONS", "jit"]

# xla_gpu_dot_merger_threshold_mb = 0: no dot is small enough to merge (DotMerger's size test is `<=`
# a threshold of bytes; 0 admits none).
COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


class _Jitted:
    """`jax.jit(fun, **kwargs)` that compiles with `COMPILER_OPTIONS` when called at the top level. JAX takes
    compiler options on a top-level jit only and refuses them on a nested one (under an outer `jit`,
    `eval_shape`, `grad`, ...): such a call runs the plain jit instead, inlined into the outer program, whose
    own options apply. `lower`, `trace`, `eval_shape` and the other attributes are those of the top-level jit.
    (A call looks at no argument: flattening a model's parameters costs milliseconds per call.)"""

    def __init__(self, fun: Callable, kwargs: dict):
        options = {**COMPILER_OPTIONS, **(kwargs.pop("compiler_options", None) or {})}
        self._top = jax.jit(fun, compiler_options=options, **kwargs)
        self._nested = jax.jit(fun, **kwargs)
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        try:
            return self._top(*args, **kwargs)
        except ValueError as e:
            if "compiler_options" not in str(e) or "top-level" not in str(e):
                raise
        return self._nested(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        """As a method (a decorated function in a class body), bound to its instance as `jax.jit`'s is."""
        return self if obj is None else functools.partial(self, obj)

    def __getattr__(self, name):
        return getattr(self._top, name)


def jit(fun: Callable, **kwargs) -> Callable:
    """`jax.jit(fun, **kwargs)` compiled with `COMPILER_OPTIONS` (merged under any `compiler_options` given)
    at the top level, and usable inside another traced function (`_Jitted`)."""
    return _Jitted(fun, kwargs)
