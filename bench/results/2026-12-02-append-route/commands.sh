#!/usr/bin/env bash
# 2026-12-02, one H200 (lent device), PYTHONPATH=$PWD, XLA_PYTHON_CLIENT_PREALLOCATE=false. Four GPU commands;
# "base" is tree 80391c0 (an export of it, run from its own folder), "ours" the working tree of the time.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
K="--profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16"

# 1. The checkpoint products of every tile first (working tree, later reverted) against 80391c0, and the
#    lockstep's buffered steps on a fused-flush tiling (default tiling and its fused flip):
#    call1_original.json, call1_base_80391c0.*, call1_fused_flush_lockstep_*.log (the "ours" files of this
#    command did not come back; its per-kernel times are the default rows of call1_fused_flush_lockstep_*.log)
python3 .anchors/harness_orig.py run --out orig.json --batches 256 --lengths 16 --dtypes float32 --deadline-s 45
(cd base && python3 bench/kernels.py $K --orig ../orig.json --tag base)
python3 bench/kernels.py $K --orig orig.json --tag ours
python3 bench/kernels.py --sweep --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256 --lengths 16 \
  --sweep-cursors lockstep --replay-configs 64x4x2b --tag fused_gdn
python3 bench/kernels.py --sweep --profile --repeats 3 --layers mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --sweep-cursors lockstep --replay-configs 16x2x5b --tag fused_mamba2

# 2. The first tile's products first, and the append route with its cursor advanced in place by an atomic
#    arrival count (working tree, both later changed), against 80391c0; the GPU tests of that tree:
#    call2_original.json, call2_base_80391c0.log, call2_first_tile_first_atomic_append.*, call2_gpu_tests.log
python3 .anchors/harness_orig.py run --out orig.json --batches 256 --lengths 16 --dtypes float32 --deadline-s 45
python3 bench/kernels.py $K --orig orig.json --tag ours
(cd base && python3 bench/kernels.py $K --orig ../orig.json --tag base)
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_pool.py tests/test_inplace_hlo.py tests/test_conv.py -q -n 16 -p no:cacheprovider -p no:benchmark

# 3. At 91f373d's kernels (the append route, its cursor moved by XLA): the original and ours, the direct step's
#    tilings in lockstep, the GPU tests: original_b256.*, ours_b256_f32.json, direct_configs_*.*, gpu_tests.log
python3 .anchors/harness_orig.py run --out orig.json --batches 256 --lengths 16 --dtypes float32 --deadline-s 45
python3 bench/kernels.py $K --orig orig.json --tag ours
python3 bench/kernels.py --sweep --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256 --lengths 16 \
  --sweep-cursors lockstep --replay-configs 64x4x2b --direct-configs 16x4,32x2,64x4,64x8 --tag direct_gdn
python3 bench/kernels.py --sweep --profile --repeats 3 --layers mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --sweep-cursors lockstep --replay-configs 16x2x5b --direct-configs 16x4,32x4,64x4 --tag direct_mamba2
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_pool.py tests/test_inplace_hlo.py tests/test_conv.py -q -n 16 -p no:cacheprovider -p no:benchmark

# 4. End to end at 91f373d, under a 200 s limit each (the Qwen-like run stopped after its standard mode):
#    e2e_nemotron_b256_f32.*, e2e_qwen_b256_f32_timed_out.log
for m in nemotron3_nano_4b_like qwen3_5_4b_like; do
  timeout 200 python3 bench/e2e.py --models $m --batches 256 --modes standard,16 --ssm-state-dtype float32 \
    --prompt-len 128 --new-tokens 64 --profile
done
