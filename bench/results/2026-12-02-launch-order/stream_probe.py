"""Probe: in-place scale of a [programs, rows, 128] array, Pallas (through XLA) beside Triton (upstream, via torch).
The first form of bench/triton_ceiling.py, as it ran on 2026-12-02 (from bench/, PYTHONPATH at the repository root)."""
import glob, os, re, statistics, sys, time
import numpy as np
import torch, triton, triton.language as tl
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.dirname(__file__))
import roofline as rf
import kernels as kb

@triton.jit
def upd(x, ROWS: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    base = x + pid.to(tl.int64) * ROWS * 128
    for t in range(TILES):
        offs = (t * BV + tl.arange(0, BV))[:, None] * 128 + tl.arange(0, 128)[None, :]
        v = tl.load(base + offs)
        tl.store(base + offs, v * 1.0001)

def triton_gbps(dtype, bv, warps, tiles, stages, mib=512):
    rows = bv * tiles
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    programs = (mib << 20) // (rows * 128 * torch.finfo(tdt).bits // 8)
    x = torch.randn(programs, rows, 128, device="cuda").to(tdt)
    k = upd[(programs,)](x, ROWS=rows, BV=bv, TILES=tiles, num_warps=warps, num_stages=stages)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            upd[(programs,)](x, ROWS=rows, BV=bv, TILES=tiles, num_warps=warps, num_stages=stages)
        e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 10 / 1e3)
    s = statistics.median(ts)
    ptx = k.asm["ptx"]
    vec = {p: len(re.findall(p, ptx)) for p in ("ld.global.v4", "st.global.v4", "ld.global.v2", "st.global.v2", r"ld.global.b32|ld.global.f32", r"st.global.b32|st.global.f32")}
    return 2 * x.numel() * x.element_size() / s / 1e9, vec

for dtype in ("float32", "bfloat16"):
    for spec in ("32x4x1", "32x1x1", "32x1x4", "16x2x5"):
        bv, w, t = (int(a) for a in spec.split("x"))
        g, vec = triton_gbps(dtype, bv, w, t, 1)
        cfg = kb.parse_config(spec)
        p = rf.measure("update", cfg, jnp.dtype(dtype), 512, 5, False)
        print(f"{dtype:9s} {spec:8s} triton {g:7.0f} GB/s  pallas {p['gbps']:7.0f} GB/s  triton ptx {vec}", flush=True)
