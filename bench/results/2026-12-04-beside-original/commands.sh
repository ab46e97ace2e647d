# 2026-12-04, one H200, jax 0.11.2, the tree of af61adb. Three GPU commands from the repository root, in the same hour;
# files here as runN_<name>.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

# run 1: the pytest list of bench/gpu_checks.sh
timeout 560 python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py \
  tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning -rfE > $OUT/gpu_tests.log 2>&1

# run 2: GDN beside the original (the anchors harness in the same command): f32 at batch 512, bf16 at 256 and 512
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 30 > $OUT/orig.log 2>&1
timeout 200 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_f32 > $OUT/ours_f32.log 2>&1
timeout 330 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1

# run 3: Mamba-2 at batch 64-512 and GDN at batch 64 beside the original
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 64,256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 60 > $OUT/orig.log 2>&1
timeout 300 python3 bench/kernels.py --profile --repeats 3 --layers mamba2 --state-dtypes float32,bfloat16 \
  --batches 64,256,512 --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_mamba2 > $OUT/ours_mamba2.log 2>&1
timeout 150 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32,bfloat16 --batches 64 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours_gdn64 > $OUT/ours_gdn64.log 2>&1
