"""Probe: a Mosaic GPU GDN append-route readout (TMA copies into SMEM, the matvecs from there)."""
import functools
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

f32 = jnp.float32
ROW = plgpu.Layout.WGMMA.reduce(1)   # [rows] of a [rows, cols] WGMMA-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)   # [cols]


def _swizzled(dtype):
    cols = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))


def gdn_append(checkpoint, d, krec, grec, cursor, q, k, v, g, beta, *, scale, block_v=64, use_qk_l2norm=True,
               interpret=False):
    """(o [B, HV, V], d with this step's records at the cursor) of the append route."""
    B, HV, V, K = checkpoint.shape
    H, L = krec.shape[1], grec.shape[-1]
    group, BV = HV // H, block_v
    NV = V // BV

    def body(ck_ref, kr_ref, gr_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, d_ref, o_ref,
             S_s, U_s, K_s, q_s, k_s, v_s, g_s, o_s, dn_s, bars):
        j, h, b = lax.axis_index("split"), lax.axis_index("head"), lax.axis_index("batch")
        hk = h // group
        rows = pl.ds(j * BV, BV)
        copies = [(kr_ref.at[b, hk], K_s), (gr_ref.at[b, h], g_s), (q_ref.at[b, hk], q_s), (k_ref.at[b, hk], k_s),
                  (v_ref.at[b, h, rows], v_s), (d_ref.at[b, h, :, rows], U_s), (ck_ref.at[b, h, rows], S_s)]
        for i, (src, dst) in enumerate(copies):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        count = cur_ref[b]
        decay = jnp.exp(g_ref[b, h])
        beta_ = beta_ref[b, h].astype(f32)
        for i in range(5):
            plgpu.barrier_wait(bars.at[i])
        qv = plgpu.load(q_s, layout=COL).astype(f32)
        kv = plgpu.load(k_s, layout=COL).astype(f32)
        if use_qk_l2norm:
            qv = qv * lax.rsqrt(jnp.sum(qv * qv) + 1e-6)
            kv = kv * lax.rsqrt(jnp.sum(kv * kv) + 1e-6)
        qv = qv * scale
        kq = jnp.sum(kv * qv)
        plgpu.barrier_wait(bars.at[5])
        zero = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)

        def slot(t, carry):  # live slots, last first: the suffix sum gives the decay weights
            s, acc_k, acc_q = carry
            i = count - 1 - t
            w = jnp.exp(s)
            Kb = plgpu.load(K_s.at[i], layout=COL).astype(f32)
            u = plgpu.load(U_s.at[i], layout=ROW).astype(f32)
            a_k = w * jnp.sum(Kb * kv)
            a_q = w * jnp.sum(Kb * qv)
            return s + g_s[i], acc_k + a_k * u, acc_q + a_q * u

        total, acc_k, acc_q = lax.fori_loop(0, count, slot, (jnp.zeros((), f32), zero, zero))
        carried = jnp.exp(total)
        plgpu.barrier_wait(bars.at[6])
        S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
        Sk = jnp.sum(S * kv[None, :], axis=1)
        Sq = jnp.sum(S * qv[None, :], axis=1)
        vv = plgpu.load(v_s, layout=ROW).astype(f32)
        dn = beta_ * (vv - decay * (carried * Sk + acc_k))
        o = decay * (carried * Sq + acc_q) + kq * dn
        o_s[...] = o.astype(o_s.dtype)
        dn_s[...] = dn.astype(dn_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, h, rows])

        @pl.when(count < L)
        def _():
            plgpu.copy_smem_to_gmem(dn_s, d_ref.at[b, h, count, rows])

        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((BV, K), checkpoint.dtype, transforms=_swizzled(checkpoint.dtype)),
               plgpu.SMEM((L, BV), d.dtype), plgpu.SMEM((L, K), krec.dtype), plgpu.SMEM((K,), q.dtype),
               plgpu.SMEM((K,), k.dtype), plgpu.SMEM((BV,), v.dtype), plgpu.SMEM((L,), f32),
               plgpu.SMEM((BV,), v.dtype), plgpu.SMEM((BV,), d.dtype), plgpu.Barrier(num_barriers=7)]
    kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(NV, HV, B),
                        grid_names=("split", "head", "batch"), scratch_types=scratch,
                        interpret=plgpu.InterpretGPUParams() if interpret else None)
    d_ref = jax.new_ref(d)
    o = kern(checkpoint, krec, grec, cursor, q, k, v, g.astype(f32), beta, d_ref)
    return o, d_ref[...]


def gdn_append_pipelined(checkpoint, d, krec, grec, cursor, q, k, v, g, beta, *, scale, block_v=64, stages=2,
                         blocks=264, use_qk_l2norm=True, interpret=False, mode="full"):
    """The same readout as `gdn_append`, persistent: `blocks` programs, each pipelining its share of the
    (batch, head, row tile) items through `stages` SMEM buffers (TMA copies issued ahead of the compute)."""
    B, HV, V, K = checkpoint.shape
    H, L = krec.shape[1], grec.shape[-1]
    group, BV = HV // H, block_v
    NV = V // BV
    items = B * HV * NV
    steps = -(-items // blocks)  # the last step's items past the end repeat the last item (same writes)

    def body(ck_ref, kr_ref, gr_ref, cur_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, d_ref, o_ref, cur_s, bar):
        blk = lax.axis_index("blk")
        plgpu.copy_gmem_to_smem(cur_ref, cur_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def where(s):
            item = jnp.minimum(s * blocks + blk, items - 1)  # strided: the tail spread over the blocks
            return item // (HV * NV), (item // NV) % HV, item % NV

        def spec(shape, f, transforms=()):
            return plgpu.BlockSpec(shape, lambda s: f(*where(s)), transforms=transforms)

        def slot_of(b):
            return jnp.minimum(cur_s[b], L - 1)

        in_specs = [
            spec((None, None, BV, K), lambda b, h, j: (b, h, j, 0), _swizzled(checkpoint.dtype)),
            spec((None, None, L, BV), lambda b, h, j: (b, h, 0, j)),
            spec((None, None, L, K), lambda b, h, j: (b, h // group, 0, 0)),
            spec((None, 2, L), lambda b, h, j: (b, h // 2, 0)),  # TMA: >= 128 bytes a stage
            spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
            spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
            spec((None, None, BV), lambda b, h, j: (b, h, j)),
            spec((None, HV), lambda b, h, j: (b, 0)),
            spec((2, HV), lambda b, h, j: (b // 2, 0)),
        ]
        out_specs = [spec((None, None, BV), lambda b, h, j: (b, h, j)),
                     spec((None, None, None, BV), lambda b, h, j: (b, h, slot_of(b), j))]

        def item_body(idx, S_s, U_s, K_s, g_s, q_s, k_s, v_s, gin_s, beta_s, o_s, dn_s):
            b, h, _ = where(idx[0])
            count = cur_s[b]
            decay = jnp.exp(gin_s[h])
            beta_ = beta_s[b % 2, h].astype(f32)
            g_s = g_s.at[h % 2]
            qv = plgpu.load(q_s, layout=COL).astype(f32)
            kv = plgpu.load(k_s, layout=COL).astype(f32)
            if use_qk_l2norm:
                qv = qv * lax.rsqrt(jnp.sum(qv * qv) + 1e-6)
                kv = kv * lax.rsqrt(jnp.sum(kv * kv) + 1e-6)
            qv = qv * scale
            kq = jnp.sum(kv * qv)
            if mode == "read":  # the copies and the checkpoint tile's row sums only
                S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
                r = jnp.sum(S, axis=1)
                o_s[...] = r.astype(o_s.dtype)
                dn_s[...] = r.astype(dn_s.dtype)
                return
            acc_k = acc_q = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)
            s = jnp.zeros((), f32)
            for i in reversed(range(L if mode == "full" else 0)):  # static: the slots' loads and sums are independent
                live = i < count
                w = jnp.exp(s)
                Kb = plgpu.load(K_s.at[i], layout=COL).astype(f32)
                u = plgpu.load(U_s.at[i], layout=ROW).astype(f32)
                a_k = jnp.where(live, w * jnp.sum(Kb * kv), 0.0)
                a_q = jnp.where(live, w * jnp.sum(Kb * qv), 0.0)
                u = jnp.where(jnp.broadcast_to(live, u.shape), u, jnp.zeros_like(u))
                acc_k = acc_k + a_k * u
                acc_q = acc_q + a_q * u
                s = s + jnp.where(live, g_s[i], 0.0)
            carried = jnp.exp(s)
            S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
            Sk = jnp.sum(S * kv[None, :], axis=1)
            Sq = jnp.sum(S * qv[None, :], axis=1)
            vv = plgpu.load(v_s, layout=ROW).astype(f32)
            dn = beta_ * (vv - decay * (carried * Sk + acc_k))
            o = decay * (carried * Sq + acc_q) + kq * dn
            o_s[...] = o.astype(o_s.dtype)
            dn_s[...] = dn.astype(dn_s.dtype)

        plgpu.emit_pipeline(item_body, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
                            max_concurrent_steps=stages)(
            ck_ref, d_ref, kr_ref, gr_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, d_ref)

    kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(blocks,), grid_names=("blk",),
                        scratch_types=[plgpu.SMEM((B,), jnp.int32), plgpu.Barrier(num_barriers=1)],
                        interpret=plgpu.InterpretGPUParams() if interpret else None)
    d_ref = jax.new_ref(d)
    o = kern(checkpoint, krec, grec, cursor, q, k, v, g.astype(f32), beta, d_ref)
    return o, d_ref[...]


def _head_terms(krec, grec, cursor, q, k, g, beta, scale, group, use_qk_l2norm=True):
    """XLA prelude of `gdn_append_pre`: (qn f32[B, H, K] normalized and scaled, kn f32[B, H, K] normalized,
    C f32[B, HV, 4, L]: rows a_k, a_q (the live slots' decay-weighted key scores, 0 in dead slots) and
    (carried decay, k.q, exp(g), beta) in the first lanes of row 2)."""
    L = grec.shape[-1]
    qf, kf = q.astype(f32), k.astype(f32)
    if use_qk_l2norm:
        qf = qf * lax.rsqrt(jnp.sum(qf * qf, -1, keepdims=True) + 1e-6)
        kf = kf * lax.rsqrt(jnp.sum(kf * kf, -1, keepdims=True) + 1e-6)
    qf = qf * scale
    live = jnp.arange(L) < cursor[:, None, None]
    lg = jnp.where(live, grec, 0.0)
    total = jnp.sum(lg, -1, keepdims=True)
    w = jnp.where(live, jnp.exp(total - jnp.cumsum(lg, -1)), 0.0)
    Kb = krec.astype(f32)
    rep = lambda x: jnp.repeat(x, group, axis=1)
    a_k = jnp.where(live, w * rep(jnp.einsum("bhlk,bhk->bhl", Kb, kf)), 0.0)
    a_q = jnp.where(live, w * rep(jnp.einsum("bhlk,bhk->bhl", Kb, qf)), 0.0)
    scal = jnp.stack([jnp.exp(total[..., 0]), rep(jnp.sum(kf * qf, -1)), jnp.exp(g.astype(f32)), beta.astype(f32)], -1)
    scal = jnp.pad(scal, ((0, 0), (0, 0), (0, L - 4)))
    return qf, kf, jnp.stack([a_k, a_q, scal, jnp.zeros_like(a_k)], 2)


def gdn_append_pre(checkpoint, d, krec, grec, cursor, q, k, v, g, beta, *, scale, block_v=64, stages=2, blocks=264,
                   use_qk_l2norm=True):
    """The append readout with the per-head terms (normalized q and k, the buffered keys' weighted scores, the
    decays) formed by an XLA prelude, and the kernel pipelining the checkpoint and d tiles through SMEM."""
    B, HV, V, K = checkpoint.shape
    H, L = krec.shape[1], grec.shape[-1]
    group, BV = HV // H, block_v
    NV = V // BV
    items = B * HV * NV
    steps = -(-items // blocks)
    qn, kn, C = _head_terms(krec, grec, cursor, q, k, g, beta, scale, group, use_qk_l2norm)

    def body(ck_ref, C_ref, cur_ref, q_ref, k_ref, v_ref, d_ref, o_ref, cur_s, bar):
        blk = lax.axis_index("blk")
        plgpu.copy_gmem_to_smem(cur_ref, cur_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def where(s):
            item = jnp.minimum(s * blocks + blk, items - 1)
            return item // (HV * NV), (item // NV) % HV, item % NV

        def spec(shape, f, transforms=()):
            return plgpu.BlockSpec(shape, lambda s: f(*where(s)), transforms=transforms)

        in_specs = [
            spec((None, None, BV, K), lambda b, h, j: (b, h, j, 0), _swizzled(checkpoint.dtype)),
            spec((None, None, L, BV), lambda b, h, j: (b, h, 0, j)),
            spec((None, None, 4, L), lambda b, h, j: (b, h, 0, 0)),
            spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
            spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
            spec((None, None, BV), lambda b, h, j: (b, h, j)),
        ]
        out_specs = [spec((None, None, BV), lambda b, h, j: (b, h, j)),
                     spec((None, None, None, BV), lambda b, h, j: (b, h, jnp.minimum(cur_s[b], L - 1), j))]

        def item_body(idx, S_s, U_s, C_s, q_s, k_s, v_s, o_s, dn_s):
            b, h, _ = where(idx[0])
            count = cur_s[b]
            carried, kq, decay, beta_ = C_s[2, 0], C_s[2, 1], C_s[2, 2], C_s[2, 3]
            acc_k = acc_q = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)
            for i in range(L):  # static: independent loads; scalar weights from SMEM
                u = plgpu.load(U_s.at[i], layout=ROW).astype(f32)
                u = jnp.where(jnp.broadcast_to(i < count, u.shape), u, jnp.zeros_like(u))
                acc_k = acc_k + C_s[0, i] * u
                acc_q = acc_q + C_s[1, i] * u
            qv = plgpu.load(q_s, layout=COL)
            kv = plgpu.load(k_s, layout=COL)
            S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
            Sk = jnp.sum(S * kv[None, :], axis=1)
            Sq = jnp.sum(S * qv[None, :], axis=1)
            vv = plgpu.load(v_s, layout=ROW).astype(f32)
            dn = beta_ * (vv - decay * (carried * Sk + acc_k))
            o = decay * (carried * Sq + acc_q) + kq * dn
            o_s[...] = o.astype(o_s.dtype)
            dn_s[...] = dn.astype(dn_s.dtype)

        plgpu.emit_pipeline(item_body, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
                            max_concurrent_steps=stages)(ck_ref, d_ref, C_ref, q_ref, k_ref, v_ref, o_ref, d_ref)

    kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(blocks,), grid_names=("blk",),
                        scratch_types=[plgpu.SMEM((B,), jnp.int32), plgpu.Barrier(num_barriers=1)])
    d_ref = jax.new_ref(d)
    o = kern(checkpoint, C, cursor, qn, kn, v, d_ref)
    return o, d_ref[...]
