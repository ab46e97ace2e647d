"""With mamba2_entry_cursor.patch applied (run from the patched tree's root): the Mamba-2 append and deferred
routes on their Mosaic GPU readout and Triton launch after it, both kernels interpreted on the CPU (JAX's Mosaic
GPU interpret mode, InterpretGPUParams; the Triton launches with interpret=True), against the reference: one
append step (tests/test_mamba2_tma.py's checks) and L + 2 deferred steps (kernel_checks.check_deferred_steps).
argv: seed, batch (a multiple of 4: the readout copies the cursor; else the atomics). Two stand-ins: the
interpreter's SMEM-to-GMEM copy takes no predicate (the pipeline's output copies have one), so a copy whose
predicate is false is skipped here; and it takes no reshaped ref, which the readout that flushes reads its
x records through, so the deferred route runs the flush launch before the readout instead."""
import functools, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental.pallas import mosaic_gpu as plgpu
from replayssm_jax import kernels
from replayssm_jax.kernels import mamba2 as m2, tma_readout
import test_mamba2_tma as t
from kernel_checks import Mamba2Shape
from replayssm_jax.testing import tolerance_dtype

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
real_copy = gpu_callbacks.copy_smem_to_gmem


def copy_smem_to_gmem(*, predicate=None, token=None, **kw):  # the pipeline's predicated copies: skip where false
    if predicate is not None and not bool(np.asarray(predicate)):
        return token
    return real_copy(predicate=None, token=token, **kw)


gpu_callbacks.copy_smem_to_gmem = copy_smem_to_gmem
real_kernel = plgpu.kernel
tma_readout.plgpu.kernel = functools.partial(real_kernel, interpret=InterpretGPUParams())


def after(*a, **k):
    k["interpret"] = True
    return real_after(*a, **k)


real_after, m2._after_readout = m2._after_readout, after
f32, bf16 = jnp.float32, jnp.bfloat16
rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
shape = Mamba2Shape(batch=int(sys.argv[2]) if len(sys.argv) > 2 else 8, H=8, P=64, N=64, G=2)
L = 8
layer = t._layer(rng, shape)
cursor = (np.arange(shape.batch) * 3 % L).astype(np.int32)
cursor[-1] = L
rs, inp = t._state(layer, f32, bf16, cursor, L), layer.draw()
y_ref, rs_ref = t._reference(layer, rs, inp, cursor, L)
kw = layer._kernel_args(inp)
inputs = m2.Inputs(*(kw[n] for n in m2.Inputs._fields))
config = kernels.TMAReadoutConfig()
y, new = m2._append_tma.__wrapped__(rs, inputs, dt_softplus=True, dt_limit=tuple(map(float, shape.dt_limit)),
                                    dt_offset=0, config=config, route="append")
t._check_step(y, new, y_ref, rs_ref, rs, cursor, tolerance_dtype(bf16, f32, bf16), L)
print("append route: passed", np.asarray(new.cursor))

# The deferred route: L + 2 steps from staggered cursors, full rows among them (kernel_checks.check_deferred_steps,
# the kernels' step replaced by the interpreted route; the readout flushes the full rows itself at batch % 4 == 0)
from kernel_checks import check_deferred_steps
real_step = layer.replay_step


def replay_step(s, i, route, backend, config=None):
    if backend != "pallas":
        return real_step(s, i, route, backend)
    kw = layer._kernel_args(i)
    ins = m2.Inputs(*(kw[n] for n in m2.Inputs._fields))
    return m2._append_tma.__wrapped__(s, ins, dt_softplus=True, dt_limit=tuple(map(float, shape.dt_limit)),
                                      dt_offset=0, config=config, route=route)


layer.replay_step = replay_step
# The readout that flushes reads its x records through a reshape, which the interpreter does not take: the
# flush launch (interpreted) runs first instead, and the readout copies the cursor as on the append route.
m2.mamba2_flushes_in_readout = lambda *a: False
real_flush = m2._flush_full


def flush_full(*a, **k):
    k["interpret"] = True
    return real_flush(*a, **k)


m2._flush_full = flush_full
cursor = (np.arange(shape.batch) * 3 % (L + 1)).astype(np.int32)
print("flushes in readout:", tma_readout.mamba2_flushes_in_readout(t._state(layer, f32, bf16, cursor), inp["C"], config))
check_deferred_steps(layer, t._state(layer, f32, bf16, cursor), config, L + 2, tolerance_dtype(bf16, f32, bf16))
print("deferred route: passed")
