# 2026-12-04, one H200, jax 0.11.2. Three GPU commands from the repository root; files here as runN_<name>.
# Run 1: the tree of 4f9f1f3 but for default_direct_tma and the test of it (the direct step taken with
# tma_step.STEP_CONFIG given; its kernel is 4f9f1f3's). Runs 2 and 3: the tree of 4f9f1f3.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

# run 1: the direct step's GPU tests (new cases at L = 16 and 32, the fold on the tensor cores), then the
# lockstep cycle with its direct step on the Triton kernel and on Mosaic GPU, in one process
timeout 200 python3 -m pytest -m gpu tests/test_tma_step.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning \
  -rfE > $OUT/gpu_tests_tma_step.log 2>&1
timeout 330 python3 bench/results/2026-12-04-direct-fold/probe_direct.py > $OUT/probe_direct.log 2>&1

# run 2: the pytest list of bench/gpu_checks.sh
timeout 520 python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py \
  tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning -rA > $OUT/gpu_tests.log 2>&1

# run 3: GDN beside the original (the anchors harness in the same command); ours under time limits, which stopped
# the f32 run after batch 256 and the bf16 run after batch 64
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 30 > $OUT/orig.log 2>&1
timeout 170 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_f32 > $OUT/ours_f32.log 2>&1
timeout 110 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 64,256 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1
