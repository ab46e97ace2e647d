#!/usr/bin/env bash
# fold_probe.py monkeypatches kernel internals, and readout_probe.py imports helpers, of the tree they ran on (fe68291 with the
# lockstep change on top, before the dot fold): they are records of those runs, not tools of later trees.
# 2026-12-02, one H200 (lent device), tree at the commits named in bench/RESULTS.md
# ("Lockstep flushes and the readout's structure (2026-12-02)"). PYTHONPATH=$PWD.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# Readout structure probe (readout_probe.py: a Pallas GDN readout, no flush, grid per row tile,
# loop over K chunks; batch 256, f32 checkpoint, L = 16): first run with the variants of
# readout_probe_1.log (state, output and read-only routes), given as PV=BV:NK:WARPS:STAGES:ROUTE:ORDER,...
PV=64:2:1:3:state:mem,64:2:1:3:state:b,64:2:1:1:state:mem,64:2:2:3:state:mem,32:2:1:3:state:mem,64:4:1:3:state:mem,64:1:4:1:state:mem,64:2:1:3:output:mem,64:2:2:1:output:mem,32:1:2:1:output:mem,64:1:4:1:output:mem,64:2:1:3:read:mem,64:1:4:1:read:mem,32:1:1:1:read:mem,128:1:4:1:read:mem \
  python3 bench/results/2026-12-02-lockstep/readout_probe.py   # -> readout_probe_1.*
python3 bench/results/2026-12-02-lockstep/readout_probe.py     # the script's VARIANTS -> readout_probe_2.*

# The layer kernels against the original with the lockstep variant, direct step folding by loop (5f42f1d's
# parent tree, before the dot fold was the default): kernels_loop_fold.*, original_loop_fold_run.json
python3 .anchors/harness_orig.py run --out orig.json --batches 256 --lengths 16 --dtypes float32 --deadline-s 45
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 --orig orig.json --tag ours

# The direct step's fold of a full buffer (fold_probe.py: loop, unrolled, one rank-L dot) -> fold_probe.json
python3 bench/results/2026-12-02-lockstep/fold_probe.py

# Flush launches of 1-2 batch rows a program, rows in step -> flush_rows_*.json|log
python3 bench/kernels.py --sweep --sweep-cursors in-step --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256 --lengths 16 --replay-configs 64x4x2:0x0x1,64x4x2:0x0x2,64x4x2:32x4x1,64x4x2:32x2x1,64x4x2:16x2x1
python3 bench/kernels.py --sweep --sweep-cursors in-step --profile --repeats 3 --layers mamba2 --state-dtypes float32 --batches 256 --lengths 16 --replay-configs 16x2x5:0x0x1,16x2x5:0x0x2,16x2x5:16x2x1

# At 07c8b46 (dot fold default at large grids, lockstep in Generator), in one GPU command:
# the GPU tests, then the original and ours -> gpu_tests.log, original_and_vllm_b256.*, ours_b256_f32.*
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_pool.py tests/test_inplace_hlo.py tests/test_conv.py -q -n 16 -p no:cacheprovider -p no:benchmark
python3 .anchors/harness_orig.py run --out orig.json --batches 256 --lengths 16 --dtypes float32 --deadline-s 45
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 --orig orig.json --tag ours

# e2e, Nemotron-3-Nano-4B-like, batch 256, f32 state: standard, 16f (the replay step's flush), 16 (lockstep)
# -> e2e_nemotron_b256_f32.* (its profile counts the direct kernel as "other": step_profile's pattern then
# matched mamba2_step/replay only; bench/RESULTS.md moves it)
python3 bench/e2e.py --models nemotron3_nano_4b_like --batches 256 --modes standard,16f,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile
