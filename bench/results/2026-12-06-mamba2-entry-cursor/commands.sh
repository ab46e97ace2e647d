# 2026-12-06, one NVIDIA H100 80GB HBM3 (driver 580.159.04; the card that came for these runs), jax 0.11.2,
# PyTorch 2.11 and Triton 3.6 for the original's kernels. The kernels of 2908a70 (the tree of 34797c9 with
# ../2026-12-06-fma-level-and-cursor/mamba2_entry_cursor.patch applied). Two GPU commands from the repository
# root on one machine, one after the other.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=bench/results/2026-12-06-fma-level-and-cursor

# command 1: the Mamba-2 Mosaic GPU tests; the A/B of the patched tree against the cursor moved with atomics,
# each variant checked against the f32 reference first; the original's Mamba-2 kernels (harness of ../shared/anchors)
python3 -m pytest -m gpu tests/test_mamba2_tma.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
python3 $R/m2_entry_probe.py > m2_entry.log 2>&1
python3 .anchors/harness_orig.py run --out orig_m2.json --layers mamba2 --batches 64,256,512 \
  --dtypes float32,bfloat16 --lengths 16 --repeats 3 --deadline-s 1 > orig_m2.log 2>&1

# command 2: every Mamba-2 GPU test of the GPU test list; the kernel benchmark at batch 64 and 512
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_inplace_hlo.py \
  tests/test_mamba2_tma.py tests/test_mamba2_dt_offset.py tests/test_conv_step.py -k "mamba2 or Mamba2 or m2" \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests_m2.log 2>&1
python3 bench/kernels.py --layers mamba2 --batches 64,512 --state-dtypes bfloat16,float32 --lengths 16 \
  --repeats 3 --profile --out . --tag m2        # kernels_m2.json
