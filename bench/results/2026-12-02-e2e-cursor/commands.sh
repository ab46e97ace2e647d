# 2026-12-02, one NVIDIA H200, the tree of ef89e9f (kernels of fb2f696). The e2e JSONs' `commit` field
# names an older HEAD (the checkout's git metadata was not the tree's); the tree is ef89e9f's.
# 1. The compiler path's probe (`triton_ceiling.json`; on the tree of e431779, the same kernels but the cursor's):
python3 bench/triton_ceiling.py --configs 32x4x1,32x1x1 --dtypes float32 --repeats 3 --out .
# 2. The GPU tests (gpu_tests.log: 212 passed):
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py \
  tests/test_quantized_state.py tests/test_pool.py tests/test_inplace_hlo.py tests/test_conv.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning
# 3. End to end, batch 256, f32 state, with the step's profile:
for m in qwen3_5_4b_like nemotron3_nano_4b_like; do
  python3 bench/e2e.py --models $m --batches 256 --modes standard,16 --prompt-len 128 --new-tokens 64 --profile \
    --out e2e_${m}_b256.json
done
# 4. End to end, batch 256 with a bf16 state, and batch 1 with an f32 state (no profile):
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype bfloat16 --prompt-len 128 --new-tokens 64 --out e2e_qwen3_5_4b_like_b256_bfloat16.json
python3 bench/e2e.py --models nemotron3_nano_4b_like --batches 256 --modes standard,16 --ssm-state-dtype bfloat16 --prompt-len 128 --new-tokens 64 --out e2e_nemotron3_nano_4b_like_b256_bfloat16.json
python3 bench/e2e.py --models qwen3_5_4b_like --batches 1 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 --new-tokens 64 --out e2e_qwen3_5_4b_like_b1_float32.json
python3 bench/e2e.py --models nemotron3_nano_4b_like --batches 1 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 --new-tokens 64 --out e2e_nemotron3_nano_4b_like_b1_float32.json
# 5. Against the original at batch 256, f32 state, after the cursor change (tree of 9dd5719, kernels of fb2f696),
#    in one GPU command:
python3 .anchors/harness_orig.py run --out original_and_vllm_b256.json --batches 256 --lengths 16 --deadline-s 45
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig original_and_vllm_b256.json --out . --tag ours_b256_f32
