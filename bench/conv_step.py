"""The GDN decode layer's conv and standard step: two launches against one fused launch, on a GPU.

One Gated DeltaNet layer at Qwen3.5-4B's shape (H = 16 key heads, HV = 32 value heads, K = V = 128, the conv's
C = 2 H K + HV V = 8192 channels, W = 4), bf16 activations and ring, the state in f32 or bf16, the raw gates
(a, b, A_log, dt_bias), as `GatedDeltaNet.decode` runs them:

  "two launches"  `ops.conv_update` (its kernel, y cut into q, k and v in place) then `ops.gdn_step`,
  "fused"         `ops.gdn_conv_step` (one launch: q, k and v formed in the step's programs),

each followed by the ring start's advance (one XLA op in both). Both are first checked against the XLA
references (`backend="xla"`) in the same run, within the tests' tolerance of the state's dtype; a form is
timed only if it passed. Timing: bench/kernels.py's `time_cycle` (an unrolled, donated cycle of 16 steps over
enough copies of the layer's state and ring to exceed the L2; every step on the same inputs: the two forms'
launches are custom calls, which XLA does not fuse across copies), with --profile the traced kernels per
step; bytes per step of each form at the device's copy bandwidth measured in the same run.

Usage (GPU): python3 bench/conv_step.py [--batches 1,8,64,256,512] [--state-dtypes float32,bfloat16] [--profile]
             python3 bench/conv_step.py --dry-run   (CPU: interpret mode, numbers meaningless)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_args  # noqa: E402
import device_rates  # noqa: E402
import kernels as kb  # noqa: E402

from replayssm_jax import ops  # noqa: E402
from replayssm_jax.testing import closeness, tolerance_dtype  # noqa: E402

H, HV, K, V, W = 16, 32, 128, 128, 4
C = 2 * H * K + HV * V
S = W  # the ring's slots: W - 1 live inputs and the new one (a decode layer's window, max_window 1)
STEPS = 16
FORMS = ("two launches", "fused")


def make_inputs(batch: int, rng, dims=(H, HV, K, V)):
    """A step's inputs (x [batch, C], a, b) in bf16 and the layer's parameters (weight [C, W], A_log,
    dt_bias), random."""
    h, hv, k, v = dims
    c = 2 * h * k + hv * v
    x = jnp.asarray(rng.standard_normal((batch, c)), jnp.bfloat16)
    a, b = (jnp.asarray(rng.standard_normal((batch, hv)), jnp.bfloat16) for _ in range(2))
    params = dict(weight=jnp.asarray(rng.standard_normal((c, W)) * 0.5, jnp.float32),
                  A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, hv)), jnp.float32),
                  dt_bias=jnp.asarray(rng.standard_normal(hv), jnp.float32))
    return (x, a, b), params


def make_carry(batch: int, state_dtype, rng, dims=(H, HV, K, V)):
    """(state, ring columns, start): a random state [batch, HV, V, K], a bf16 ring of random live inputs and
    random starts."""
    h, hv, k, v = dims
    state = jnp.asarray(rng.standard_normal((batch, hv, v, k)) * 0.1, state_dtype)
    columns = jnp.asarray(rng.standard_normal((batch, S, 2 * h * k + hv * v)), jnp.bfloat16)
    return state, columns, jnp.asarray(rng.integers(0, S, batch), jnp.int32)


def step_fn(form: str, params, backend: str, dims=(H, HV, K, V)):
    """step(carry, inputs) -> (o, carry) of one form: the layer's conv and step, then the start's advance."""
    h, hv, k, v = dims
    gates = dict(A_log=params["A_log"], dt_bias=params["dt_bias"])

    def step(carry, inputs):
        (state, columns, start), (x, a, b) = carry, inputs
        batch = x.shape[0]
        if form == "fused":
            o, state, columns = ops.gdn_conv_step(state, x, columns, start, params["weight"], num_k_heads=h, a=a,
                                                  b=b, **gates, backend=backend)
        else:
            (q, kk, vv), columns = ops.conv_update(x, columns, start, params["weight"], splits=(h * k, 2 * h * k),
                                                   backend=backend)
            o, state = ops.gdn_step(state, q.reshape(batch, h, k), kk.reshape(batch, h, k),
                                    vv.reshape(batch, hv, v), a=a, b=b, **gates, backend=backend)
        return o, (state, columns, (start + 1) % S)

    return step


def check(batch: int, state_dtype, backend: str, rng, dims=(H, HV, K, V)) -> dict:
    """Two steps of each form against the XLA references: the outputs' and states' closeness within the
    tolerance of the state's dtype (`testing.closeness`, bf16 activations), the rings equal."""
    inputs, params = make_inputs(batch, rng, dims)
    carry0 = make_carry(batch, state_dtype, rng, dims)
    ref_step = step_fn("fused", params, "xla", dims)
    tol = tolerance_dtype(jnp.bfloat16, state_dtype)
    out = {}
    for form in FORMS:
        step = jax.jit(step_fn(form, params, backend, dims))
        carry, ref = jax.tree.map(jnp.copy, carry0), carry0
        result = dict(ring_equal=True, ok=True)
        for t in range(2):
            o, carry = step(carry, inputs)
            o_ref, ref = ref_step(ref, inputs)
            for what, actual, expected in (("o", o, o_ref), ("state", carry[0], ref[0])):
                c = closeness(actual, expected, tol)
                result[f"{what}_{t}"] = c.as_dict()
                result["ok"] = result["ok"] and c.ok
            result["ring_equal"] = result["ring_equal"] and bool(jnp.array_equal(carry[1], ref[1]))
        result["ok"] = result["ok"] and result["ring_equal"]
        out[form] = result
    return out


def bytes_per_step(batch: int, state_dtype, form: str, dims=(H, HV, K, V)) -> int:
    """Traffic model: the state read and written; x, a, b read; the W - 1 live ring columns read and one
    written; o written; the two launches also write and read q, k and v (bf16)."""
    h, hv, k, v = dims
    state = batch * hv * v * k * jnp.dtype(state_dtype).itemsize
    column = 2 * batch * (2 * h * k + hv * v)
    common = 2 * state + column * (1 + (W - 1) + 1) + 2 * batch * hv * v + 4 * batch * hv
    return common + (2 * column if form == "two launches" else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=bench_args.positive_ints, default="1,8,64,256,512")
    p.add_argument("--state-dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=bench_args.positive_int, default=7)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU: interpret mode, small heads, batch 2, 2 steps")
    args = p.parse_args(argv)
    dims, steps = (H, HV, K, V), STEPS
    if args.dry_run:
        options, batches, backend, steps = kb.TimingOptions.dry_run(profile=args.profile), [2], "interpret", 2
        dims = (2, 4, 32, 32)
    else:
        if jax.default_backend() != "gpu":
            sys.exit("bench/conv_step.py needs a GPU (or --dry-run)")
        # At most 32 copies of the layer: a cycle of 16 steps over 64 copies at batch 1 compiles 2048 launches.
        options = kb.TimingOptions(repeats=args.repeats, profile=args.profile, max_sets=32)
        batches, backend = args.batches, "pallas"
    out = args.out or (tempfile.mkdtemp(prefix="conv_step_dry_run_") if args.dry_run
                       else kb.results_folder("conv_step"))
    os.makedirs(out, exist_ok=True)
    copy_bw = max(device_rates.copy_bandwidth(nbytes=(1 << 20) if args.dry_run else (2 << 30)).values())
    rng = np.random.default_rng(0)
    rows = []
    for dtype_name in args.state_dtypes.split(","):
        state_dtype = jnp.dtype(dtype_name)
        for batch in batches:
            chk = check(batch, state_dtype, backend, rng, dims)
            row = dict(state_dtype=dtype_name, batch=batch, check=chk)
            inputs, params = make_inputs(batch, rng, dims)
            probe = make_carry(batch, state_dtype, rng, dims)
            per = sum(a.nbytes for a in probe)
            sets = int(min(options.max_sets, max(options.min_sets, -(-options.l2_target_bytes // per))))
            for form in FORMS:
                if not chk[form]["ok"]:
                    print(f"FAILED check {dtype_name} b{batch} {form}: {chk[form]}", flush=True)
                    continue
                carries = tuple(make_carry(batch, state_dtype, rng, dims) for _ in range(sets))
                timing = kb.time_cycle(step_fn(form, params, backend, dims), carries, inputs, steps, options)
                row[form] = kb.timed_form(f"{dtype_name:8s} b{batch:<4d} {form:12s}", timing,
                                          bytes_per_step(batch, state_dtype, form, dims), sets, copy_bw)
            rows.append(row)
    return report(out, rows, options, copy_bw, argv)


def report(out: str, rows: list, options, copy_bw: float, argv) -> int:
    """Write `out`/conv_step.json and print the table; 0 where every check passed."""
    path = kb.write_json(out, "conv_step", rows, options, copy_bw, argv)
    print("\n| state | batch | two launches us | fused us | two / fused | kernels us (two, fused) | fused bytes at "
          "copy rate us |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if all(f in r for f in FORMS):
            two, fused = r["two launches"], r["fused"]
            kernels = [(f["kernels_us"] or {}).get(kb.ALL_KERNELS, {}).get("us") for f in (two, fused)]
            kt = "-" if None in kernels else f"{kernels[0]:.2f}, {kernels[1]:.2f}"
            print(f"| {r['state_dtype']} | {r['batch']} | {two['us']:.2f} | {fused['us']:.2f} | "
                  f"{two['us'] / fused['us']:.3f} | {kt} | {fused['at_copy_us']:.2f} |")
    print("JSON:", path)
    return 0 if all(f["ok"] for r in rows for f in r["check"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
