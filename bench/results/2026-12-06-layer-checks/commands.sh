# 2026-12-06, one H100 80GB HBM3 (driver 580.159.04), jax 0.11.2; PyTorch 2.11 and Triton 3.6 for vLLM's kernel.
# Two GPU commands on one machine, from the repository root (the anchors harness extracted to .anchors/), on the
# tree of 3c517ae (kernels unchanged since 2908a70).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# run 1: vLLM's GDN standard kernel at its best config, then the A/B of split_output_probe.py
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --deadline-s 5 > vllm.log 2>&1
python3 split_output_probe.py > probe.log 2>&1

# run 2: the GPU tests of the files that exercise the layers and models on the kernels, and the command's
# --compare on two fixtures
python3 -m pytest -m gpu tests/test_inplace_hlo.py tests/test_attention_decode.py tests/test_pool.py \
  tests/test_quantized_state.py -q -n 12 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
for m in qwen3_5_tiny nemotron_h_tiny; do
  python3 -m replayssm_jax.generate --checkpoint tests/data/$m --backend pallas --compare --max-new-tokens 24 > compare_$m.log 2>&1
done

# run 3 (the tree of d44212e: pooled launches treat a slot outside the pool as padding), the same day on another
# H100 80GB HBM3: the GPU tests of the pooled launches and of the files above, then slot_oob.py (a jitted
# Mamba-2 replay step over a pool of 3 slots at slots [7, 0], on "xla" and on the compiled kernels)
python3 -m pytest -m gpu tests/test_pool.py tests/test_per_draft_verify.py tests/test_verify_kernels.py \
  tests/test_quantized_state.py tests/test_inplace_hlo.py tests/test_attention_decode.py -q -n 12 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > run3_gpu_tests.log 2>&1
python3 slot_oob.py > run3_slot_oob.log 2>&1
# 110 passed, 1 failed: test_compiled_kernel_matches_reference[float32-256-nemotron3-nano-4b], out of GPU memory
# with 12 workers on the 80 GB card (CUDA_ERROR_OUT_OF_MEMORY). Run 4, that test's cases alone: 12 passed.
python3 -m pytest -m gpu "tests/test_attention_decode.py::test_compiled_kernel_matches_reference" -q > run4_rerun.log

# run 5 (the tree of d44212e), a third H100 80GB HBM3 the same day: the pooled launches' slot test before and after
python3 pool_ab.py > run5_pool_ab.log 2>&1
