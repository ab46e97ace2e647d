# 2026-12-03, one H200, jax 0.11.2. Four GPU commands; runs 1-2 the same script, from the repository root with
# PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; files here as runN_<name>. The anchors harness
# (../shared/anchors/harness_orig.py, the original's kernels extracted into .anchors/peer) ran in the same
# command as our benchmark. Run 1: the GDN readout that flushes full rows itself, its flush as L unrolled
# outer products; run 2: at ca20146 (one loop body, the flush's own record copies).
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256,512 --lengths 16 \
  --dtypes float32 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 3, at 1efa393 (the Mamba-2 readout that flushes): the same three commands, both layers
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256,512 --lengths 16 \
  --dtypes float32 --deadline-s 80 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 4, on the tree of 1efa393: the pytest list of bench/gpu_checks.sh, then bf16 checkpoints at batch 256
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig_bf16.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes bfloat16 --deadline-s 50 > $OUT/orig_bf16.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes bfloat16 --batches 256 \
  --lengths 16 --orig $OUT/orig_bf16.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1
