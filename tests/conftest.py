"""Shared fixtures. Random inputs are drawn fresh on every run; the seed is
printed (pytest shows it for a failing test) and REPLAYSSM_TEST_SEED replays it.

Compilation is most of the suite's time on a CPU (the XLA compiles of the
models' prefill and decode programs), so two settings make it cheaper:

  - the XLA CPU backend compiles without LLVM's optimisation passes
    (`--xla_backend_optimization_level=0`, about half the compile time of a
    decode program): on a machine without a CUDA plugin, unless XLA_FLAGS
    already sets a level. The HLO passes (fusion, buffer assignment, the
    in-place updates that tests/test_inplace_hlo.py checks) are the same.
  - JAX's persistent compilation cache in a folder of the run's temporary
    directory, shared by the xdist workers: a program that another test
    (another `Generator`, another jit of the same function) already compiled
    is loaded instead of compiled again. REPLAYSSM_TEST_NO_COMPILE_CACHE=1
    turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import secrets

import numpy as np
import pytest


def _cpu_only() -> bool:
    return not any(importlib.util.find_spec(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


if _cpu_only() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """The run's persistent compilation cache folder (shared by the xdist workers), or None when turned off."""
    if os.environ.get("REPLAYSSM_TEST_NO_COMPILE_CACHE"):
        return None
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # basetemp/popen-gwN: the run's folder is one up
    return str(root / "jax-compile-cache")


@pytest.fixture(scope="session", autouse=True)
def persistent_compile_cache(compile_cache_dir):
    from replayssm_jax.generation import set_compile_cache

    set_compile_cache(compile_cache_dir)
    yield compile_cache_dir
    set_compile_cache(None)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("REPLAYSSM_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.nodeid}: REPLAYSSM_TEST_SEED={seed}")
    return np.random.default_rng(seed)
