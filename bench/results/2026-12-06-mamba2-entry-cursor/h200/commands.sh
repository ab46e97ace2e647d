# 2026-12-06, one NVIDIA H200 (driver 580.159.04), the tree of c48ed1a (kernels of 2908a70), jax 0.11.2;
# PyTorch 2.11 and Triton 3.6 for the original's kernels. One GPU command from the repository root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=bench/results/2026-12-06-fma-level-and-cursor
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee gpu.txt
# the original's Mamba-2 kernels and vLLM's standard kernel (harness of ../shared/anchors)
python3 .anchors/harness_orig.py run --out orig_m2.json --layers mamba2 --batches 64,256,512 \
  --dtypes float32,bfloat16 --lengths 16 --repeats 3 --deadline-s 1 > orig_m2.log 2>&1
# the A/B of the tree against the cursor moved with atomics, each variant checked against the f32 reference first
python3 $R/m2_entry_probe.py > m2_entry.log 2>&1                       # m2_entry_probe.json
# the Mamba-2 Mosaic GPU tests, then every Mamba-2 test of the GPU test list
python3 -m pytest -m gpu tests/test_mamba2_tma.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_inplace_hlo.py \
  tests/test_mamba2_tma.py tests/test_mamba2_dt_offset.py tests/test_conv_step.py -k "mamba2 or Mamba2 or m2" \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests_m2.log 2>&1
# the kernel benchmark at batch 512
python3 bench/kernels.py --layers mamba2 --batches 512 --state-dtypes bfloat16,float32 --lengths 16 \
  --repeats 3 --profile --out . --tag m2_b512 > kernels_b512.log 2>&1   # m2_b512.json
# orig_m2.log did not come back from the machine; orig_m2.json holds its figures.
