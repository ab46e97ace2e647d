"""The standard decode step of other projects, timed at our benchmark's shapes (GPU, PyTorch).

Baselines for the question "is our standard kernel a good one?":
  gdn     flash-linear-attention's `fused_recurrent_gated_delta_rule` (package fla-core), one
          token with an initial state and `output_final_state=True` (it writes a new f32 state:
          the same traffic as an in-place update), q/k L2-normalised in the kernel.
  mamba2  mamba_ssm's Triton `selective_state_update` (in place), with D, z, dt_bias, softplus
          and the head-tied dt/A of Mamba-2. mamba_ssm's package needs its CUDA extensions to
          import, so this script loads only that one module from the source archive.

Shapes, dtypes and the traffic model are those of bench/kernels.py (bf16 activations, state
f32 or bf16; fla keeps its state in f32 only). Timing: the state is spread over `n_sets` copies
(>= 240 MB together, as in kernels.py), one call per copy is captured in a CUDA graph, and
the graph's replays are timed with CUDA events (median of `--repeats`); per-step time is one
call's share. With `--ours kernels.json` (a bench/kernels.py result of the same machine) the
table adds our standard step's time and the ratio (theirs / ours: > 1 means ours is faster),
both for our wall-clock step and for our kernel alone (`--profile` runs).

Getting the two packages (on a machine where pip can reach PyPI; `.whl/` is git-ignored: copy it
to the GPU machine):
  pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl fla-core==0.6.0
  mamba_ssm-2.3.2.post1.tar.gz, the sdist from https://pypi.org/project/mamba-ssm/#files (a pip
  download of it builds the package to read its requirements, which needs CUDA)

Usage (on the GPU machine, where PyTorch and Triton are installed):
  python3 bench/external.py --fla-wheel .whl/fla_core-0.6.0-py3-none-any.whl \
      --mamba-sdist .whl/mamba_ssm-2.3.2.post1.tar.gz --batches 1,64,256 [--ours K.json] [--out F.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import tarfile
import types
import zipfile
from pathlib import Path

torch = None  # imported by main(), after the arguments: --help runs without PyTorch

L2_TARGET_BYTES = 240e6
MIN_SETS, MAX_SETS = 2, 64
GDN = dict(H=16, HV=32, K=128, V=128)
MAMBA2 = dict(nheads=96, head_dim=80, d_state=128, n_groups=8)


def load_fla(wheel: str, root: Path):
    """Unpack the fla-core wheel (pure Python) and return its fused recurrent GDN function."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root / "fla")
    sys.path.insert(0, str(root / "fla"))
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule


def load_mamba_ssm(sdist: str, root: Path):
    """Load mamba_ssm/ops/triton/selective_state_update.py alone from the source archive.

    The package's __init__ imports its compiled extensions; registering bare parent packages
    lets the Triton module (and the softplus function it imports) load without them."""
    with tarfile.open(sdist) as tf:
        tf.extractall(root / "mamba", filter="data")
    pkg = next((root / "mamba").glob("mamba_ssm-*")) / "mamba_ssm"
    for name, path in (("mamba_ssm", pkg), ("mamba_ssm.ops", pkg / "ops"),
                       ("mamba_ssm.ops.triton", pkg / "ops" / "triton")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    spec = importlib.util.spec_from_file_location(
        "mamba_ssm.ops.triton.selective_state_update", pkg / "ops/triton/selective_state_update.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.selective_state_update


def n_sets(state_bytes: int) -> int:
    return max(MIN_SETS, min(MAX_SETS, math.ceil(L2_TARGET_BYTES / state_bytes)))


def gdn_case(fn, batch: int, state_dtype):
    """One fla decode step per state copy; returns (calls, bytes per step)."""
    H, HV, K, V = GDN["H"], GDN["HV"], GDN["K"], GDN["V"]
    if state_dtype != torch.float32:
        raise ValueError(f"fla keeps its GDN state in float32; state_dtype={state_dtype} not timed")
    dev, act = "cuda", torch.bfloat16
    state = torch.randn(batch, HV, K, V, device=dev, dtype=torch.float32) * 0.1
    sets = [state.clone() for _ in range(n_sets(state.nbytes))]
    q = torch.randn(batch, 1, H, K, device=dev, dtype=act)
    k = torch.randn(batch, 1, H, K, device=dev, dtype=act)
    v = torch.randn(batch, 1, HV, V, device=dev, dtype=act)
    g = torch.nn.functional.logsigmoid(torch.randn(batch, 1, HV, device=dev))
    beta = torch.rand(batch, 1, HV, device=dev, dtype=act)
    io = 2 * (q.nbytes + k.nbytes) + 2 * v.nbytes + g.nbytes + beta.nbytes  # v read, o written

    def call(s):
        return fn(q, k, v, g=g, beta=beta, initial_state=s, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)

    return [lambda s=s: call(s) for s in sets], 2 * state.nbytes + io


def mamba2_case(fn, batch: int, state_dtype):
    """One in-place mamba_ssm step per state copy; returns (calls, bytes per step)."""
    nh, P, N, G = (MAMBA2[k] for k in ("nheads", "head_dim", "d_state", "n_groups"))
    dev, act = "cuda", torch.bfloat16
    state = (torch.randn(batch, nh, P, N, device=dev) * 0.1).to(state_dtype)
    sets = [state.clone() for _ in range(n_sets(state.nbytes))]
    x = torch.randn(batch, nh, P, device=dev, dtype=act)
    z = torch.randn(batch, nh, P, device=dev, dtype=act)
    dt = torch.randn(batch, nh, device=dev, dtype=act)[..., None].expand(batch, nh, P)
    dt_bias = torch.randn(nh, device=dev)[:, None].expand(nh, P)
    A = -torch.rand(nh, device=dev)[:, None, None].expand(nh, P, N)
    D = torch.randn(nh, device=dev)[:, None].expand(nh, P)
    B = torch.randn(batch, G, N, device=dev, dtype=act)
    C = torch.randn(batch, G, N, device=dev, dtype=act)
    io = 3 * x.nbytes + 2 * B.nbytes + batch * nh * 2  # x, z, out; B, C; dt

    def call(s):
        return fn(s, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    return [lambda s=s: call(s) for s in sets], 2 * state.nbytes + io


def time_calls(calls, repeats: int) -> float:
    """Seconds per call: a CUDA graph of one call per state copy, replays timed by events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (Triton compiles here), outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(times)


def ours_standard(path: str | None) -> dict:
    """(layer, batch, state dtype) -> our standard step's wall-clock and kernel-only seconds."""
    if not path:
        return {}
    found = {}
    for row in json.load(open(path))["rows"]:
        if row["variant"] != "standard":
            continue
        kernel = [v["us"] for name, v in row.get("kernels_us", {}).items() if "_step_" in name]
        found[row["layer"], row["batch"], row["state_dtype"]] = (
            row["seconds"], kernel[0] * 1e-6 if kernel else None)
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fla-wheel", required=True)
    p.add_argument("--mamba-sdist", required=True)
    p.add_argument("--layers", default="gdn,mamba2")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--state-dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ours", help="a bench/kernels.py JSON of the same machine")
    p.add_argument("--out", default=None, help="JSON path, or a folder to write external.json in; default: "
                                               "bench/results/DATE-external/external.json")
    p.add_argument("--workdir", default="/tmp/external_baselines")
    args = p.parse_args(argv)
    for dtype in args.state_dtypes.split(","):
        if dtype not in ("float32", "bfloat16"):
            p.error(f"--state-dtypes: each must be float32 or bfloat16; got {dtype!r}")
    global torch
    import torch

    root = Path(args.workdir)
    fns = {"gdn": (load_fla(args.fla_wheel, root), gdn_case),
           "mamba2": (load_mamba_ssm(args.mamba_sdist, root), mamba2_case)}
    ours, rows = ours_standard(args.ours), []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for layer in args.layers.split(","):
        fn, case = fns[layer]
        for dtype in args.state_dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                try:
                    calls, nbytes = case(fn, batch, getattr(torch, dtype))
                except ValueError as e:
                    print(f"{layer:7s} {dtype:9s} b{batch:<4d} skipped: {e}")
                    break
                seconds = time_calls(calls, args.repeats)
                wall, kernel = ours.get((layer, batch, dtype), (None, None))
                row = dict(layer=layer, batch=batch, state_dtype=dtype, seconds=seconds,
                           bytes=nbytes, gbps=nbytes / seconds / 1e9, n_sets=len(calls),
                           ours_seconds=wall, ours_kernel_seconds=kernel)
                rows.append(row)
                vs = "" if wall is None else f"  ours {wall * 1e6:8.2f} us (x{seconds / wall:.2f})"
                if kernel:
                    vs += f"  our kernel {kernel * 1e6:8.2f} us (x{seconds / kernel:.2f})"
                print(f"{layer:7s} {dtype:9s} b{batch:<4d} theirs {seconds * 1e6:8.2f} us "
                      f"{row['gbps']:6.0f} GB/s{vs}")
                del calls
                torch.cuda.empty_cache()
    args.out = args.out or f"bench/results/{datetime.date.today().isoformat()}-external/external.json"
    if Path(args.out).is_dir() or args.out.endswith(("/", os.sep)):  # a folder, new or not
        args.out = str(Path(args.out) / "external.json")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                fla_wheel=Path(args.fla_wheel).name, mamba_sdist=Path(args.mamba_sdist).name)
    json.dump(dict(meta=meta, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
