# 2026-12-04, one H200, jax 0.11.2. Five GPU commands from the repository root; runs 1-3 the tree of e240442 (a bf16
# checkpoint's GDN readout on 128-row tiles on the append route too); files here as runN_<name>.
# Each run sets:
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
d=bench/results/2026-12-04-append-128

# run 1: the readout's GPU tests (with the append route's bf16-128 case), GDN with a bf16 checkpoint beside the
# original (the anchors harness in the same command), then the 128-row tilings' probe
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig_bf16.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes bfloat16 --deadline-s 60 > $OUT/orig_bf16.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 64,256,512 --lengths 16 \
  --orig $OUT/orig_bf16.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1
timeout 200 python3 $d/probe_tiles.py > $OUT/probe_tiles.log 2>&1
# (as run, probe_tiles.py's `kernel_us` summed every entry of the profile, "(all kernels)" and "(idle)" with the
# kernels, so run1_probe_tiles.* show about twice the kernel time there; the script here takes "(all kernels)".
# RESULTS reads the per-kernel entries.)

# run 2: the deferred prelude's probe, then the pytest list of bench/gpu_checks.sh
timeout 220 python3 $d/probe_prelude.py > $OUT/probe_prelude.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py \
  tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 3: end to end with a bf16 SSM state (343 s)
python3 bench/e2e.py --batches 256 --modes standard,16 --ssm-state-dtype bfloat16 --prompt-len 128 \
  --new-tokens 64 --profile --out $OUT/e2e_b256_bf16.json > $OUT/e2e_b256_bf16.log 2>&1

# runs 4 and 5: the tree of 9bba823 (the deferred readout's flush products on the tensor cores with bf16 k records)
# run 4: the readout's GPU tests, then the products on the tensor cores against f32 outer products (probe_wgmma.py)
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
timeout 200 python3 $d/probe_wgmma.py > $OUT/probe_wgmma.log 2>&1
# run 5: GDN beside the original (the anchors harness in the same command), then the deferred route's GPU tests
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,256 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 30 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32,bfloat16 --batches 64,256 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_inplace_hlo.py tests/test_quantized_state.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests_deferred.log 2>&1
