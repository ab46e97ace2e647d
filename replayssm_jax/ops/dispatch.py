"""Backend and route resolution of the public ops.

Backends (keyword-only `backend` of every op):

  "xla"        the pure-JAX reference (any platform),
  "pallas"     the Pallas GPU kernels, compiled (needs a CUDA GPU),
  "interpret"  the same Pallas kernels in interpret mode (any platform; slow,
               for tests),
  None         "pallas" when JAX's default backend is a GPU and the op has a
               Pallas kernel (:data:`KERNEL_OPS`), else "xla".

An explicitly requested backend that cannot run raises (no GPU for
"pallas"; no kernel for the op); nothing falls back silently.

Routes of a replay step (`route`): "output" (the output from the
checkpoint plus the buffer, no state formed), "state" (the state formed for
the readout), "direct" (the buffered records folded into the checkpoint,
then a standard step written back at once), "deferred" (the output route
with each row's flush deferred to its next step: that step first flushes
the rows that entered full, then appends without a flush, so a row that
fills its buffer keeps it full, cursor L, until then) and "auto", resolved
here by :func:`resolve_route`. All four routes give the same numbers up to
float32 rounding. One replay step also takes "append" (:data:`STEP_ROUTES`): the
output route without the flush, for a schedule that flushes its rows
itself (the `Generator`'s lockstep cycles); a decode loop of such steps
alone would fill the buffers, so the loops (Generator, engine, CLI) take
:data:`ROUTES` only.
"""

from __future__ import annotations

import jax

from replayssm_jax import kernels

BACKENDS = ("pallas", "interpret", "xla")
ROUTES = ("output", "state", "direct", "deferred", "auto")
STEP_ROUTES = ROUTES + ("append",)

# Batch rows from which route "auto" takes the deferred route (outside a
# state pool, f32 or bf16 checkpoint, a grid that is not one launch). On the
# H200 (bench/RESULTS.md, 2026-12-03, "The deferred route"), L = 16, from
# staggered cursors, its kernels took less time than the output route's at
# every shape measured: batch 64, 256 and 512 with an f32 checkpoint, 256
# with a bf16 one, both layers, on the Mosaic GPU append kernels and on the
# Triton replay kernel alike. Smaller batches were not measured.
DEFERRED_MIN_BATCH = 64

# Ops with a Pallas kernel; the others run the reference on every backend
# choice of None and raise for an explicit "pallas" / "interpret".
KERNEL_OPS = frozenset({"attention_decode", "conv_update", "mamba2_step", "mamba2_verify", "mamba2_replay_step", "mamba2_replay_verify",
                        "gdn_conv_step", "gdn_step", "gdn_verify", "gdn_replay_step", "gdn_replay_verify"})


def default_backend() -> str:
    """"pallas" on a GPU, "xla" elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_backend(backend: str | None, op: str | None = None) -> str:
    """The backend that runs op `op` (any op if None) for the choice `backend`.

    Args:
      backend: "pallas", "interpret", "xla" or None (:func:`default_backend`
        where `op` is None or has a kernel, else "xla").
      op: the name of a public op, e.g. "gdn_step", or None.

    Returns:
      "pallas", "interpret" or "xla".

    Raises:
      ValueError: an unknown backend name.
      RuntimeError: "pallas" requested where JAX has no GPU; "pallas" or
        "interpret" (also chosen by None) with `jax_enable_x64` on.
    """
    if backend is None:
        chosen = default_backend() if op is None or op in KERNEL_OPS else "xla"
    elif backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS} or None; got {backend!r}")
    elif backend == "pallas" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"`backend='pallas'` needs a CUDA GPU; JAX's default backend is {jax.default_backend()!r}"
            " (use backend='interpret' to run the kernels on the CPU, or 'xla')"
        )
    else:
        chosen = backend
    if chosen != "xla" and jax.config.jax_enable_x64:
        # The kernels index with int32 (cursors, program ids); with x64 on, Pallas forms int64 indices
        # beside them (its interpret mode then fails with a dtype mismatch inside JAX).
        raise RuntimeError(f"the Pallas kernels (backend {chosen!r}"
                           + (", chosen by backend=None" if backend is None else "")
                           + ") do not run with `jax_enable_x64` on; turn it off, or pass backend='xla'")
    return chosen


def choose_backend(op: str, backend: str | None, config) -> str:
    """The backend of one call of op `op`: :func:`resolve_backend`, checked
    against the op's kernels and against `config`.

    Args:
      op: the name of a public op.
      backend: the caller's choice (see the module docstring).
      config: the caller's kernel `config` (None: the heuristic).

    Returns:
      "pallas", "interpret" or "xla".

    Raises:
      ValueError, RuntimeError: as :func:`resolve_backend`.
      NotImplementedError: "pallas" or "interpret" for an op without a kernel.
      TypeError: a `config` where the "xla" backend runs the op (it has no
        tiling to tune).
    """
    chosen = resolve_backend(backend, op)
    if chosen != "xla":
        if op not in KERNEL_OPS:
            raise NotImplementedError(f"op {op!r} has no Pallas kernel; use backend='xla' (or None)")
        return chosen
    if config is not None:
        if op not in KERNEL_OPS:
            why = f" ({op} has no Pallas kernel: it runs the reference on every backend)"
        elif backend is None:
            why = f" (backend=None picked it: JAX's default backend is {jax.default_backend()!r})"
        else:
            why = ""
        raise TypeError(f"`config` tunes the Pallas kernels; the 'xla' backend{why} takes none")
    return chosen


def backend_for(op: str, backend: str | None) -> str:
    """The backend of op `op` inside a model whose ops run on `backend`.

    A model's `backend` selects the implementation of its decode ops. Ops
    without a Pallas kernel (the chunked prefill forms: :data:`KERNEL_OPS`)
    run their XLA form under every choice, so that "pallas" or "interpret"
    apply to a whole model. The model's choice is validated first, also for
    an op without a kernel (a prefill then fails as early as a decode).

    Returns:
      "pallas", "interpret" or "xla".

    Raises:
      ValueError: an unknown backend name.
      RuntimeError: "pallas" where JAX has no GPU.
    """
    chosen = resolve_backend(backend)
    return chosen if op in KERNEL_OPS else "xla"


def check_route(route: str, routes: tuple[str, ...] = ROUTES) -> str:
    """`route` if it is one of `routes` (a decode loop's :data:`ROUTES`, or one step's :data:`STEP_ROUTES`).

    Raises:
      ValueError: another route.
    """
    if route not in routes:
        why = " (a route of one replay step, `ops.STEP_ROUTES`, not of a decode loop)" if route in STEP_ROUTES else ""
        raise ValueError(f"`route` must be one of {', '.join(map(repr, routes))}; got {route!r}{why}")
    return route


def resolve_route(route: str, backend: str, state, config=None, *, pool: bool = False) -> str:
    """The route a replay step on `backend` takes for `route` on `state`.

    "output", "state", "direct", "deferred" and "append" are taken as given. "auto" is, on the
    kernel backends ("pallas", "interpret"), the direct route where the
    default replay step is one launch
    (:func:`replayssm_jax.kernels.replay_is_one_launch`: a latency-bound
    grid, batch x heads <= 132, e.g. the Qwen3.5-4B GDN layer at batch 1-4
    and the Nemotron-3-Nano-4B Mamba-2 layer at batch 1) and `config` is
    None, else (large grids, where the buffered step saves state traffic)
    the deferred route from DEFERRED_MIN_BATCH rows outside a state pool
    (`pool` False), else the output route. On the H200 at L = 16 with an
    f32 checkpoint, from staggered cursors, the deferred route's kernels
    took 1.10, 1.12 and 1.08x the original's kernel time (GDN, batch 64,
    256, 512) and 1.11, 1.05 and 1.03x (Mamba-2) on a Hopper-class GPU's
    Mosaic GPU append kernels, 1.16-1.24x on the Triton replay kernel, the
    output route 1.21-1.26x (bench/RESULTS.md, 2026-12-03, "The deferred
    route"). With a `config` given, "auto" follows its kind: a
    :class:`~replayssm_jax.kernels.StepConfig` tiles the direct route, a
    :class:`~replayssm_jax.kernels.ReplayConfig` the output route. On the H200 the direct step
    ran at 0.88-0.99x of the standard step's speed at those batches and the
    buffered one at 0.53-0.74x (bench/RESULTS.md, 2026-11-30). On "xla",
    and for a state with an 8-bit checkpoint (which the direct route would
    round at every step), "auto" is the output route.

    Args:
      route: one of :data:`STEP_ROUTES`.
      backend: a resolved backend, "pallas", "interpret" or "xla".
      state: the Mamba2ReplayState or GDNReplayState of the step (only its
        shapes and dtypes are read).
      config: the caller's kernel config, or None.
      pool: whether the step runs over a state pool (`slots` given; only
        "auto" reads it).

    Returns:
      "output", "state", "direct", "deferred" or "append".

    Raises:
      ValueError: an unknown route.
      TypeError: "auto" with a :class:`~replayssm_jax.kernels.TMAReadoutConfig`
        (it tiles a named route: the append and deferred routes, and a GDN layer's direct route).
    """
    if check_route(route, STEP_ROUTES) != "auto":
        return route
    if isinstance(config, kernels.TMAReadoutConfig):
        raise TypeError("a TMAReadoutConfig tiles a named route, not route='auto': 'deferred' or 'append' (either "
                        "layer; a decode loop on 'append' alone would fill the buffers) or a GDN layer's 'direct'; "
                        "pass the route")
    if backend == "xla" or state.scale is not None:  # an 8-bit checkpoint: rounded at the flush only
        return "output"
    if config is not None:
        return "direct" if isinstance(config, kernels.StepConfig) else "output"
    batch, heads, rows, cols = state.checkpoint.shape
    if kernels.replay_is_one_launch(batch, heads, rows, cols, state.checkpoint.dtype, state.buffer_len):
        return "direct"
    return "deferred" if batch >= DEFERRED_MIN_BATCH and not pool else "output"


def check_buffer_len(buffer_len: int, backend: str | None, name: str = "buffer_len") -> None:
    """Raise ValueError if the replay-step kernels that `backend` selects cannot
    take a buffer of `buffer_len` slots (:data:`replayssm_jax.kernels.MAX_BUFFER_LEN`;
    the "xla" backend has no limit). `name` is the caller's argument name.

    Raises:
      ValueError: `buffer_len` above the kernels' limit (for "pallas" and
        "interpret" on any machine), or an unknown backend.
      RuntimeError: "pallas" where JAX has no GPU, with `buffer_len` within
        the limit.
    """
    named = backend in ("pallas", "interpret")  # the limit holds on any machine: checked before the device
    chosen = backend if named else resolve_backend(backend, "mamba2_replay_step")
    if chosen != "xla" and buffer_len > kernels.MAX_BUFFER_LEN:
        raise ValueError(f"`{name}` must be <= {kernels.MAX_BUFFER_LEN} with backend {chosen!r} (the kernels' "
                         f"limit); got {buffer_len} (use backend='xla')")
    if named:
        resolve_backend(backend, "mamba2_replay_step")
