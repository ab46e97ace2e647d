"""Shared fixtures. Random inputs are drawn fresh on every run; the seed is
printed (pytest shows it for a failing test) and REPLAYSSM_TEST_SEED replays it.

Compilation is most of the suite's time on a CPU (the XLA compiles of the
models' prefill and decode programs), so two settings make it cheaper:

  - the XLA CPU backend compiles without LLVM's optimisation passes
    (`--xla_backend_optimization_level=0`, about half the compile time of a
    decode program): on a machine without a CUDA plugin, unless XLA_FLAGS
    already sets a level. The HLO passes (fusion, buffer assignment, the
    in-place updates that tests/test_inplace_hlo.py checks) are the same.
  - JAX's persistent compilation cache, shared by the xdist workers: a
    program that another test (another `Generator`, another jit of the same
    function) already compiled is loaded instead of compiled again. Its
    folder is REPLAYSSM_TEST_COMPILE_CACHE if set (kept), else a new
    temporary folder, removed when the run ends;
    REPLAYSSM_TEST_NO_COMPILE_CACHE=1 turns the cache off. A test that
    switches the cache (the command's `--compile-cache` / `--no-compile-cache`
    call `set_compile_cache`) has it switched back when it ends, so the tests
    that follow it in the same worker keep loading from the run's folder.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import tempfile

import numpy as np
import pytest


def _cpu_only() -> bool:
    return not any(importlib.util.find_spec(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


if _cpu_only() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


COMPILE_CACHE = "REPLAYSSM_TEST_COMPILE_CACHE"
_created_cache = None  # the folder this process made (the xdist controller's), removed at the end


def pytest_configure(config):
    """Turn on the persistent compilation cache; the folder made here goes to the xdist workers in their
    environment (they start after this hook)."""
    global _created_cache
    if os.environ.get("REPLAYSSM_TEST_NO_COMPILE_CACHE"):
        return
    if not os.environ.get(COMPILE_CACHE):
        _created_cache = os.environ[COMPILE_CACHE] = tempfile.mkdtemp(prefix="replayssm-jax-compile-cache-")
    from replayssm_jax.generation import set_compile_cache

    set_compile_cache(os.environ[COMPILE_CACHE])


def pytest_unconfigure(config):
    if _created_cache is not None:
        shutil.rmtree(_created_cache, ignore_errors=True)
        os.environ.pop(COMPILE_CACHE, None)


@pytest.fixture(autouse=True)
def _restore_compile_cache():
    """JAX's persistent compilation cache folder as before the test (see the module docstring)."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from replayssm_jax.generation import set_compile_cache

        set_compile_cache(before)


# Memory mappings of a test process past which JAX's caches are cleared after a test (`_bounded_memory_maps`),
# well below Linux's default limit of 65530 a process (vm.max_map_count).
MAX_MEMORY_MAPS = 40000
_MAPS_LOG = os.environ.get("REPLAYSSM_TEST_MAPS_LOG")  # a file that records each clearing (pid, mappings)


def _memory_maps() -> int | None:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """JAX's caches cleared after a test once the process holds MAX_MEMORY_MAPS memory mappings.

    Each program XLA compiles for the CPU keeps about 20 mappings (its code) while JAX's caches hold it
    (20-21 a program for 300 small jitted functions, back to the start after `jax.clear_caches()`,
    2026-12-04), so an xdist worker that compiles a few thousand programs reaches the kernel's limit, and
    the next compile crashes the process: a segmentation fault in XLA's compile or in
    `executable.serialize()`, in four clean-clone runs of the suite (2026-12-03, three times on 2026-12-04),
    each past 92% of it and in an interpreted verify test; sampled in the next run, a worker held 38378 at
    45% of it. The run's persistent compilation cache still holds the
    programs, so a test that needs one again loads it."""
    yield
    count = _memory_maps()
    if count is not None and count > MAX_MEMORY_MAPS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
        if _MAPS_LOG:
            with open(_MAPS_LOG, "a") as log:
                log.write(f"{os.getpid()} {count} -> {_memory_maps()}\n")


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("REPLAYSSM_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.nodeid}: REPLAYSSM_TEST_SEED={seed}")
    return np.random.default_rng(seed)
