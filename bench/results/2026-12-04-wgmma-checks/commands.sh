# 2026-12-04, one H200, jax 0.11.2. Five GPU commands from the repository root; runs 1-2 the tree of b6f4c9d,
# runs 3-4 that of 69c2e41 (the GDN readout moves the cursor where the batch is a multiple of 4). Files here
# as runN_<name>. Each run sets:
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
list="tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py tests/test_tree_verify.py
  tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py tests/test_mamba2_tma.py
  tests/test_tma_step.py"  # the pytest list of bench/gpu_checks.sh less tests/test_tma_readout.py

# run 1: the readout's GPU tests (the tensor-core flush's cases among them), then the rest of the list
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -W ignore::DeprecationWarning \
  > $OUT/gpu_tests_readout.log 2>&1
python3 -m pytest -m gpu $list -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning \
  > $OUT/gpu_tests.log 2>&1

# runs 2 and 3: GDN beside the original (the anchors harness in the same command); run 3 after the readout's
# GPU tests (its gpu_tests_readout.log)
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32,bfloat16 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 4: the cursor moved by the readout against the prelude's move in one process, then the rest of the list
# under a 330 s limit (it stopped there: 255 passed, none failed)
timeout 200 python3 bench/results/2026-12-04-wgmma-checks/probe_cursor.py > $OUT/probe_cursor.log 2>&1
timeout 330 python3 -m pytest -m gpu $list -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 5 (the tree of 261fb82, later the same day): the whole pytest list of bench/gpu_checks.sh
timeout 540 python3 -m pytest -m gpu $list tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning -rA > $OUT/gpu_tests.log 2>&1
