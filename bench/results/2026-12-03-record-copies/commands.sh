# 2026-12-03, one H200, jax 0.11.2. Five GPU commands of the same hour; each wrote under $OUT, its files
# here as runN_<name> (e2e_qwen_b256.* -> runN_e2e_qwen3_5_4b_like_b256.*, probe1.json -> run1_probe1.json,
# probe2.log and probe2_float32.json -> run3_probe2.*, gpu_tests_tma_readout.log -> run3_gpu_tests_tma_readout.log).
# Each run's environment: PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the repository root.
# The e2e JSONs' `commit` field is that of the device checkout; the runs' code is as below.

# run 1 (4a17922): the direct steps in column chunks, and advance_cursor without its atomic add (GDN: the
# prelude's and the direct step's cursor moves), patched in at run time. run1_probe1.json's `kernel_us` sums
# every profile entry, "(all kernels)" and "(idle)" among them: not a kernel time (RESULTS uses per_launch_us)
# (after a script dumping XLA's PTX of the direct step, whose dump came back empty: not kept)
python3 bench/results/2026-12-03-record-copies/probe1.py \
  gdn:base,gdn:chunk64,gdn:chunk32,gdn:chunk128,gdn:prelude-noatomic,mamba2:base,mamba2:chunk64,mamba2:chunk32,gdn:base

# run 2 (4a17922): Qwen3.5-4B-like end to end
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_qwen_b256.json > $OUT/e2e_qwen_b256.log 2>&1

# run 3 (a31f216's kernel before its default record_slots became 4: 0 then, one copy; the probe's variants
# give record_slots explicitly, "w2" the default): the readout's record copies, the prelude's warps
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_tma_readout.log 2>&1
python3 bench/results/2026-12-03-record-copies/probe2.py r0,r8,r4,r2,w2,r0,r4 > $OUT/probe2.log 2>&1

# run 4 (a31f216): the layers beside the original, then the GPU test list of bench/gpu_checks.sh
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 25 > $OUT/orig.log 2>&1        # ../shared/anchors harness
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 5 (a31f216): run 2's command
