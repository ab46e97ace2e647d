"""The device's own ceilings, measured in the run that uses them: copy bandwidth and bf16 matmul rate.

- Copy bandwidth (GB/s, bytes read plus bytes written): the fastest of XLA's copy, a fused
  elementwise pass (XLA's copy of 2 GiB ran slower than the elementwise pass on the H200,
  bench/RESULTS.md) and, where PyTorch with CUDA is importable, `Tensor.copy_` between two
  device buffers (a cudaMemcpy-class device copy, timed with CUDA events).
- bf16 matmul rate (TFLOP/s): the faster of a jitted `jnp.dot` and, where available, `torch.mm`,
  on [n, n] x [n, n] bf16 operands of random values, f32 accumulation.

Each figure is the median of `repeats` timed calls after a warm-up call. On a CPU the numbers
are those of the CPU (the scripts' dry runs use them only to exercise the code).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def _median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_cuda():
    """torch, if it is importable and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_seconds(torch, fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> dict[str, float]:
    """GB/s (read + write) of each copy method measured: {"torch_copy" where PyTorch sees a GPU,
    "xla_copy", "xla_elementwise"}; `max(...)` of it is the device's copy ceiling. Call it before
    the run allocates on the device: PyTorch's buffers need room beside JAX's preallocation."""
    rates = {}
    torch = _torch_cuda()
    if torch is not None:  # before JAX's first op, which takes most of the GPU's memory by default
        src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        rates["torch_copy"] = 2 * nbytes / _torch_seconds(torch, lambda: dst.copy_(src), repeats) / 1e9
        del src, dst
        torch.cuda.empty_cache()
    x = jnp.ones((nbytes // 4,), jnp.float32)
    for name, fn in (("xla_copy", jax.jit(jnp.copy)), ("xla_elementwise", jax.jit(lambda a: a * 1.0001))):
        rates[name] = 2 * nbytes / _median_seconds(lambda fn=fn: fn(x), repeats) / 1e9
    del x
    return rates


def matmul_tflops(n: int = 8192, repeats: int = 10) -> dict[str, float]:
    """TFLOP/s of an [n, n] x [n, n] bf16 matmul: {"xla", and "torch" where PyTorch sees a GPU};
    `max(...)` of it is the device's matmul ceiling."""
    rates = {}
    torch = _torch_cuda()
    if torch is not None:
        ta = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        tb = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        rates["torch"] = 2 * n**3 / _torch_seconds(torch, lambda: torch.mm(ta, tb), repeats) / 1e12
        del ta, tb
        torch.cuda.empty_cache()
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
    b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    rates["xla"] = 2 * n**3 / _median_seconds(lambda: dot(a, b), repeats) / 1e12
    return rates
