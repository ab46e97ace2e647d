# 2026-12-03, one H200, jax 0.11.2. Three GPU commands of the same hour on the tree of da6b215 (the readouts'
# one pipeline over a traced step count; the GDN readout's record copies of a full row on block 0), from the
# repository root with PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; files here as runN_<name>.
# The anchors harness (../shared/anchors/harness_orig.py, the original's kernels extracted into .anchors/peer)
# ran in the same command as our benchmark. The e2e JSON's `commit` field reads 862ffef, the last commit of
# the tree the runs copied; the code was da6b215's (not yet a commit there).

# run 1: the deferred tests, then both layers beside the original at batch 64-512, f32 checkpoints
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 64,256,512 --lengths 16 \
  --dtypes float32 --deadline-s 90 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 2: both models end to end at batch 256, f32 state
python3 bench/e2e.py --batches 256 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 --new-tokens 64 \
  --profile --out $OUT/e2e_b256.json > $OUT/e2e_b256.log 2>&1

# run 3: the pytest list of bench/gpu_checks.sh
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 4, on the tree of 4ffb020 (the reference's public functions jitted, reverted since): the kernel files' GPU tests; the
# 290-s limit stopped pytest after every test had reported (194 dots, no failure) and before its summary line.
timeout 290 python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_tma_readout.py \
  tests/test_mamba2_tma.py -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning \
  > $OUT/gpu_tests_head.log 2>&1
