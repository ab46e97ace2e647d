# 2026-12-05, one H200, jax 0.11.2. Two GPU commands from the repository root on one machine, the second started
# as the first ended. Run 1 on the tree of fb84ba7 (the GDN prelude's loads before its first store) with, beside
# it, the package of 232617a (the loads in the value heads' loop) in .base/ and a variant in .alt/ (fb84ba7 with
# the buffered k and g loaded by static masks: `tiles.load_live`, the cursor's mask applied after the load).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
root=$PWD

# run 1: the GPU tests of the changed kernels, the original's GDN kernels and vLLM's, then ours three times
PYTHONPATH=$root python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_tma_step.py tests/test_gdn_gates.py \
  tests/test_attention_decode.py -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out orig.json --layers gdn --batches 64,256 --lengths 16 --repeats 7 --deadline-s 60
common="--profile --repeats 5 --layers gdn --batches 64,256 --lengths 16"
# each stopped by its limit (150, 150, 80 s) before the bf16 state's Mosaic GPU routes at batch 256 (alt: f32 batch 256)
(cd .base && PYTHONPATH=$root/.base timeout 150 python3 bench/kernels.py $common --state-dtypes float32,bfloat16 --out . --tag base)
PYTHONPATH=$root timeout 150 python3 bench/kernels.py $common --state-dtypes float32,bfloat16 --out . --tag new
PYTHONPATH=$root/.alt:$root timeout 80 python3 bench/kernels.py $common --state-dtypes float32 --out . --tag alt

# run 2: the rest of bench/gpu_checks.sh's pytest list
PYTHONPATH=$root python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_inplace_hlo.py \
  tests/test_mamba2_tma.py tests/test_mamba2_dt_offset.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > gpu_tests.log 2>&1

# the ratios: bench/kernels.py's `against_original` over run1_orig.json and run1_{base,new}.json
