"""The in-place streaming kernel of bench/roofline.py compiled two ways, side by side in one run: by
Pallas through XLA (`roofline.measure`, 'update') and by upstream Triton through PyTorch, the
compiler that the original ReplaySSM kernels and vLLM's standard kernels use.

Both kernels scale a [programs, block_v * tiles, 128] array in place, a program walking its
`tiles` tiles of [block_v, 128] one after the other on `num_warps` warps: the traffic of the
standard decode step. The Triton side is timed with CUDA events over 10 back-to-back launches
(median of 5), and its PTX is searched for vector loads and stores (`ld.global.v4` ...); the Pallas
side by the host clock around 10 dispatches (`roofline.measure`). The two clocks are not the same:
this script put the Pallas column 7-16% and 0-5% below the Triton one in two runs (2026-12-02),
where Nsight Compute timed one launch of each at 179.5 and 180.0 us, with the same 128-bit loads
and stores in their SASS (2026-12-05, bench/RESULTS.md). Read the gap as an upper bound on what the
compiler path costs; for the kernels alone, time them under ncu.

    python3 bench/triton_ceiling.py --configs 32x4x1,32x1x1,32x1x4,16x2x5 --dtypes float32,bfloat16

Needs a GPU, PyTorch with CUDA and Triton. Writes JSON to --out (default bench/results/DATE-triton-ceiling).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics

import jax.numpy as jnp

try:
    import torch
    import triton
    import triton.language as tl
except ImportError as e:  # the kernel below is defined at import: say what is missing, not a traceback
    raise SystemExit(f"bench/triton_ceiling.py needs PyTorch with CUDA and Triton: {e}") from None

import kernels as kb  # bench/kernels.py: parse_config, results_folder
import roofline

COLS = roofline.COLS
PTX_OPS = ("ld.global.v4", "st.global.v4", "ld.global.v2", "st.global.v2")


@triton.jit
def _update(x, ROWS: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr, COLS: tl.constexpr):
    base = x + tl.program_id(0).to(tl.int64) * ROWS * COLS
    for t in range(TILES):
        offsets = (t * BV + tl.arange(0, BV))[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tl.store(base + offsets, tl.load(base + offsets) * 1.0001)


def triton_update(dtype: str, config, mib: int, repeats: int) -> dict:
    """GB/s (read + write) of the Triton kernel on `mib` MiB of `dtype`, after a checked first launch."""
    rows = config.block_v * config.tiles
    torch_dtype = getattr(torch, dtype)
    programs = max(1, (mib << 20) // (rows * COLS * torch.empty((), dtype=torch_dtype).element_size()))
    x = torch.randn(programs, rows, COLS, device="cuda").to(torch_dtype)
    want = (x.float() * 1.0001).to(x.dtype).float()

    def launch():
        return _update[(x.shape[0],)](x, ROWS=rows, BV=config.block_v, TILES=config.tiles, COLS=COLS,
                                      num_warps=config.num_warps, num_stages=config.num_stages)

    compiled = launch()
    torch.testing.assert_close(x.float(), want, rtol=1e-2, atol=1e-2)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10 / 1e3)
    seconds = statistics.median(times)
    ptx = compiled.asm["ptx"]
    return dict(us=seconds * 1e6, gbps=2 * x.numel() * x.element_size() / seconds / 1e9,
                ptx={op: len(re.findall(re.escape(op), ptx)) for op in PTX_OPS})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--configs", default="32x4x1,32x1x1,32x1x4,16x2x5", help="BVxWARPSxTILES, as bench/roofline.py")
    p.add_argument("--mib", type=roofline.positive_int, default=512)
    p.add_argument("--repeats", type=roofline.positive_int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or kb.results_folder("triton-ceiling")
    os.makedirs(out, exist_ok=True)
    rows = []
    for dtype in args.dtypes.split(","):
        for spec in args.configs.split(","):
            config = kb.parse_config(spec)
            tri = triton_update(dtype, config, args.mib, args.repeats)
            pallas = roofline.measure("update", config, jnp.dtype(dtype), args.mib, args.repeats, False)
            rows.append(dict(dtype=dtype, config=config.tag(), triton_gbps=tri["gbps"], pallas_gbps=pallas["gbps"],
                             triton_ptx=tri["ptx"]))
            print(f"{dtype:9s} {config.tag():16s} triton {tri['gbps']:6.0f} GB/s  pallas {pallas['gbps']:6.0f} GB/s  "
                  f"triton ptx {tri['ptx']}", flush=True)
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), argv=vars(args),
                torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(out, "triton_ceiling.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("| dtype | tiling | Triton GB/s | Pallas (XLA) GB/s | Pallas / Triton |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['config']} | {r['triton_gbps']:.0f} | {r['pallas_gbps']:.0f} | "
              f"{r['pallas_gbps'] / r['triton_gbps']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
