# 2026-12-03, one H200, jax 0.11.2. Runs 1-2 on the library of df4013f (the XLA prelude), runs 3-6 on
# that of 9cb06fb (the Triton prelude launch; the prelude's warps were 2 in run 3, 1 from run 5).
# Each run wrote under $OUT; its files are here as runN_<name>.
# Each run's environment: PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the repository root.
# The `commit` field of run 5's JSON names the checkout's HEAD on that machine (df4013f); its code was 9cb06fb's.

# run 1 (df4013f): 07a4a01's TMA checks on the GPU, the GDN f32 rows with every kernel counted.
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_tma.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256,512 --lengths 16 \
  --dtypes float32 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256,512 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 2 (df4013f): the compiled HLO of one append step and of four unrolled steps (ENTRY kept, metadata cut).
python3 bench/results/2026-12-03-tma-prelude/hlo_dump.py 256

# run 3 (9cb06fb with TERMS_WARPS = 2): run 1's commands again.

# run 4: the prelude launch alone over num_warps.
python3 bench/results/2026-12-03-tma-prelude/terms_sweep.py

# run 5 (9cb06fb): Qwen3.5-4B-like end to end.
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256,512 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_qwen3_5_4b_like.json > $OUT/e2e_qwen3_5_4b_like.log 2>&1

# run 6 (9cb06fb): the GDN rows beside the original, f32 at batch 64-512 and bf16 at 256.
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 64,256,512 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours_f32 > $OUT/ours_f32.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1

# run 7 (faa67b2: the default from batch 64 in f32, 256 in bf16): the whole GPU test list
# (bench/gpu_checks.sh's), then the GDN bf16 rows at batch 64 and 512 beside the original.
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,512 --lengths 16 \
  --dtypes bfloat16 --deadline-s 30 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 64,512 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1

# run 8 (5000f0c): the GPU tests of the Mosaic GPU path and of the compiled steps' copies.
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests_final.log 2>&1

# run 9 (74cc0a4: the prelude moves the cursor in place): run 8's tests, then the GDN f32 rows at batch 256.
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests_final.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 20 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
