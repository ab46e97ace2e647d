# 2026-12-02, one H200, PYTHONPATH at the repository root, XLA_PYTHON_CLIENT_PREALLOCATE=false.
# 1. At a494156 (batch rows launched first, the order of then): 1-2 warps (sweep_warps_*.json), the streaming ceilings.
cd bench
python3 roofline.py --dtypes float32,bfloat16 --configs 32x4x1,32x1x1,16x1x1,32x2x1,64x2x1,16x2x5,16x1x5,32x1x4 --repeats 3   # roofline.json/.log
python3 kernels.py --sweep --profile --layers gdn --state-dtypes float32,bfloat16 --batches 256 --lengths 16 --repeats 3 --standard-configs 32x1,16x1,32x2,64x2 --replay-configs 32x1x4,32x2x4,64x2x2,16x1x8,32x1x1,32x1x4x3,64x4x2:32x1x0,64x4x2:16x1x0
python3 kernels.py --sweep --profile --layers mamba2 --state-dtypes float32,bfloat16 --batches 256 --lengths 16 --repeats 3 --standard-configs 16x1,8x1,16x4 --replay-configs 16x1x5,16x1x1,16x1x5:16x1x0,16x2x5:16x1x0,16x1x5x3
# 2. The compiler path: stream_probe.py (this folder), its output in stream_probe.log.
python3 stream_probe.py
# 3. The launch order (the tree of d802c73 before its replay heuristic change: every default in memory order).
python3 kernels.py --sweep --profile --layers gdn --state-dtypes float32,bfloat16 --batches 256,64 --lengths 16 --repeats 3 --standard-configs 32x4b --replay-configs 64x4x2b,128x4x1b,64x2x2   # order_gdn.*
python3 kernels.py --sweep --profile --layers mamba2 --state-dtypes float32,bfloat16 --batches 256,64 --lengths 16 --repeats 3 --standard-configs 16x2b --replay-configs 16x2x5b   # order_mamba2.*
cd ..
# 4. At d802c73: the original's kernels and ours in one command (ours stopped at its 320 s limit before Mamba-2 bf16 batch 512).
python3 .anchors/harness_orig.py run --out original_and_vllm.json --batches 64,256,512 --lengths 16 --deadline-s 200
timeout 320 python3 bench/kernels.py --profile --repeats 5 --layers gdn,mamba2 --state-dtypes float32,bfloat16 --batches 64,256,512 --lengths 16 --orig original_and_vllm.json --tag ours   # ours_b64_b512.*
python3 .anchors/compare.py --orig original_and_vllm.json --ours ours_b64_b512.json --cursors in-step --json compare_L16_in-step.json
python3 .anchors/compare.py --orig original_and_vllm.json --ours ours_b64_b512.json --cursors staggered --json compare_L16_staggered.json
# 5. At d802c73: the GPU tests.
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning   # gpu_tests.log
