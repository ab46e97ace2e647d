# 2026-12-04, one H200, jax 0.11.2. Five GPU commands from the repository root; files here as runN_<name>. Run 1, the tree:
# d94210a (7c0a9b5 plus TMAReadoutConfig.flush_keys_ahead).  Each run sets the export and d below.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
d=bench/results/2026-12-04-keys-at-flush
# the GDN readout's GPU tests, then the deferred route's in four more files
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_inplace_hlo.py tests/test_quantized_state.py tests/test_mamba2_tma.py \
  -k deferred -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests_deferred.log 2>&1
# GDN with a bf16 checkpoint beside the original (the anchors harness in the same command)
python3 .anchors/harness_orig.py run --out $OUT/orig_bf16.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes bfloat16 --deadline-s 60 > $OUT/orig_bf16.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 64,256,512 --lengths 16 \
  --orig $OUT/orig_bf16.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1
# the flush's k records a step ahead or at the flush, both checkpoint dtypes, twice in turn
python3 $d/probe.py > $OUT/probe.log 2>&1

# run 2 (d94210a, the tree of 56ad2ad): the pytest list of bench/gpu_checks.sh
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py \
  tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 3 (56ad2ad): the flush products' loop unrolled by 1, 2 or 4 (source-patched variants)
python3 $d/probe_unroll.py > $OUT/probe_unroll.log 2>&1

# run 4 (56ad2ad): the deferred readout's tilings, f32 and bf16 checkpoints
python3 $d/probe_tiles.py > $OUT/probe_tiles.log 2>&1

# run 5 (56ad2ad with 128-row tiles the default of a bf16 checkpoint's GDN readout on both routes; the commit after it keeps
# that default for the deferred route only): the readout's GPU tests, then GDN
# with a bf16 checkpoint beside the original (the anchors harness in the same command)
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig_bf16.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes bfloat16 --deadline-s 60 > $OUT/orig_bf16.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 64,256,512 --lengths 16 \
  --orig $OUT/orig_bf16.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1
