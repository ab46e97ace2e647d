# 2026-12-03, one H200, jax 0.11.2. Four GPU commands of the same hour; each wrote under $OUT, its files
# here as runN_<name>. Each run's environment: PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the
# repository root. Every run's kernels are those of b64a426. Its other code, by run: runs 1 and 2 before
# bench/kernels.py's -deferred-triton variant, route "auto" taking the deferred route and the 8-bit
# deferred test cases; run 3 with the variant; run 4 all of b64a426 but one test change made after it (the
# 8-bit deferred cases' outputs compared from the kernels' flushed checkpoint, bench/RESULTS.md). In runs
# 3-4 route "auto" took the deferred route where the append route's default is the Mosaic GPU kernel; from
# cd7693b it takes it from batch 64 outside a state pool (the timed variants name their route).

# run 1: the deferred route's GPU tests, then both layers beside the original (b256, f32)
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py -k deferred \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 25 > $OUT/orig.log 2>&1        # ../shared/anchors harness
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 2: the pytest list of bench/gpu_checks.sh
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 3: batches 64, 256, 512 beside the original (f32), the Triton kernels' deferred route beside
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 64,256,512 --lengths 16 \
  --dtypes float32 --deadline-s 60 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 4: the pytest list of run 2 (timeout 370 s), then bf16 checkpoints at b256 (the harness under
# `timeout 30`, which stopped it before its Mamba-2 rows; our bench under `timeout 80`)
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes bfloat16 --deadline-s 20 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes bfloat16 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
