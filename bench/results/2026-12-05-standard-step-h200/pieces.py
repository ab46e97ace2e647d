"""The GDN standard step with its state tile in P column pieces: each piece its own load and store, the two
matvecs' products chained across the pieces as fmas (`tiles.fma`), then one sum over [BV, BK / P]. Patches
gdn._step_kernel (the standard step only; `patch(0)` restores the tree's kernel).
usage (repository root, PYTHONPATH=$PWD):
  pieces.py check              interpreted, against the f32 reference (CPU)
  pieces.py ttir DIR P [split]  write the Triton IR of the step (batch 256, f32 and bf16) to DIR; with
                               `split`, the tile loaded whole and cut by jnp.split instead (on a CPU)"""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from replayssm_jax.kernels import gdn
from replayssm_jax.kernels.tiles import f32, fma, load, row_mask, store

ORIG = gdn._step_kernel
SPLIT = False


def matvec_pieces(S, x):
    acc = S[0] * x[0][None, :]
    for s, v in zip(S[1:], x[1:]):
        acc = fma(s, v[None, :], acc)
    return jnp.sum(acc, axis=1)


def step_pieces(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, *, V, K, L, scale,
                use_qk_l2norm, dot_fold, programs, P=4):
    if records is not None or state_ref.shape[1] != K:
        return ORIG(state_ref, inputs, records, cursor_ref, o_ref, state_out_ref, cursor_out_ref, V=V, K=K, L=L,
                    scale=scale, use_qk_l2norm=use_qk_l2norm, dot_fold=dot_fold, programs=programs)
    BV, BK = state_ref.shape
    C = BK // P
    vmask = row_mask(BV, V)
    rows = lambda n: None if vmask is None else jnp.broadcast_to(vmask[:, None], (BV, n))  # noqa: E731
    cols = [pl.ds(j * C, C) for j in range(P)]
    if SPLIT:
        q, k = jnp.split(load(inputs.q, None), P), jnp.split(load(inputs.k, None), P)
        S = jnp.split(load(state_ref, rows(BK)), P, axis=1)
    else:
        q, k = ([load(ref.at[c], None) for c in cols] for ref in (inputs.q, inputs.k))
        S = [load(state_ref.at[:, c], rows(C)) for c in cols]
    if use_qk_l2norm:
        nq, nk = (jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs) + 1e-6) for xs in (q, k))
        q, k = [x * (nq * scale) for x in q], [x * nk for x in k]
    else:
        q = [x * scale for x in q]
    g, beta = gdn._gates(inputs)
    decay, v = jnp.exp(g), load(inputs.v, vmask)
    S = [s * decay for s in S]
    d = beta * (v - matvec_pieces(S, k))
    update = fma if state_ref.dtype == f32 else (lambda a, b, c: a * b + c)
    S = [update(d[:, None], kj[None, :], s) for s, kj in zip(S, k)]
    store(o_ref, matvec_pieces(S, q), vmask)
    for s, c in zip(S, cols):
        store(state_out_ref.at[:, c], s, rows(C))


def patch(P):
    gdn._step_kernel = functools.partial(step_pieces, P=P) if P else ORIG


def check():
    for P in (2, 4):
        patch(P)
        jax.clear_caches()
        for sd in ("float32", "bfloat16"):
            b = kb.make_bench("gdn", 3, sd, np.random.default_rng(1))
            with jax.default_matmul_precision("highest"):
                tol = kb.tolerance_dtype(b.dtype, b.sd)
                xs, s_k = b.inputs(2), b.state()
                s_r, ys, states = s_k.astype(jnp.float32), [], []
                for t in range(2):
                    x = kb._take(xs, t)
                    y_k, s_k = b.step(s_k, x, "interpret", None)
                    y_r, s_r = b.step(s_r, x, "xla")
                    ys.append((y_k, y_r)); states.append((s_k, s_r))
                print(P, sd, kb._compared(ys, tol)["ok"], kb._compared(states, tol)["ok"])


def write_ttir(folder, P):
    from jax._src.pallas.triton import pallas_call_registration as reg, lowering, gpu_info
    mods, real = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = real(*a, **k)
        mods.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture
    gpu_info.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
    patch(P)
    for sd in ("float32", "bfloat16"):
        mods.clear()
        b = kb.make_bench("gdn", 256, sd, np.random.default_rng(0))
        inp = b.random_inputs((b.b,))
        jax.jit(lambda s, i: b.kernel_step(s, i)).trace(b.state(), inp).lower(lowering_platforms=("cuda",))
        open(f"{folder}/p{P}{'s' if SPLIT else ''}_{sd}.ttir", "w").write(mods[0])


if __name__ == "__main__":
    sys.path.insert(0, "bench")
    import kernels as kb
    if sys.argv[1] == "check":
        check()
    else:
        SPLIT = sys.argv[4:] == ["split"]
        write_ttir(sys.argv[2], int(sys.argv[3]))
