# 2026-12-02, one H200, PYTHONPATH at the repository root, XLA_PYTHON_CLIENT_PREALLOCATE=false.
# 1. At e8a4079 + 5e0f1b5 (gpu_checks.sh): the GPU tests of every kernel file (gpu_tests.log), and
#    bench/conv_update.py before its steps were chained (conv_update_unchained.log; stopped at its 150 s limit).
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_inplace_hlo.py tests/test_conv.py -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning
python3 bench/conv_update.py --profile
# 2. The conv update (steps chained), the original's kernels and ours in one command, e2e at batch 256.
python3 bench/conv_update.py --profile --repeats 5 --out .   # conv_update.json / .log
python3 .anchors/harness_orig.py run --out original_and_vllm.json --batches 1,64,256 --lengths 16 --deadline-s 80
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32,bfloat16 --batches 1,64,256 --lengths 16 --orig original_and_vllm.json --out . --tag ours   # ours.json / .log
python3 .anchors/compare.py --orig original_and_vllm.json --ours ours.json --cursors in-step --json compare_L16_in-step.json
python3 .anchors/compare.py --orig original_and_vllm.json --ours ours.json --cursors staggered --json compare_L16_staggered.json
python3 bench/e2e.py --models qwen3_5_4b_like,nemotron3_nano_4b_like --batches 256 --modes standard,16 --prompt-len 128 --new-tokens 64 --profile --out e2e_b256.json
