#!/usr/bin/env bash
# The GDN append route's Mosaic GPU kernel in the library: its GPU tests, the GDN layer against the
# original's kernels, a tiling sweep, and Qwen3.5-4B-like end to end, on one H200 (2026-12-02).
# Four commands, each run from the repository root with $OUT an empty folder; files renamed runN_*.
# ../shared/anchors' harness_orig.py (the original ReplaySSM kernels and vLLM's) sat at .anchors/.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# run 1 (library of 3c80630): the Mosaic GPU kernel's GPU tests. The layer benchmark of this command
# stopped at a bug of bench/kernels.py's tma_applies (a random key traced in jax.eval_shape), fixed for run 2.
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_tma.log 2>&1

# run 2 (library of 3c80630): the GDN layer, f32 at batch 64/256/512, beside the original's (the bf16 half
# of this command ran past the 300 s limit); then the tiling sweep, cut off after three tilings
# (each Mosaic GPU compile took 50-60 s).
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 64,256,512 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 60 > $OUT/orig.log 2>&1
timeout 300 python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32,bfloat16 \
  --batches 64,256,512 --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
timeout 200 python3 bench/results/2026-12-02-tma-readout/tma_sweep.py $OUT/sweep.json 170 > $OUT/sweep.log 2>&1

# run 3 (library of 3c80630): the whole GPU test list (bench/gpu_checks.sh's), then the GDN layer with a
# bf16 checkpoint at batch 256 beside the original's.
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py -q -n 16 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256 --lengths 16 \
  --dtypes bfloat16 --deadline-s 30 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 4 (the Mosaic GPU kernel the append route's default for an f32 checkpoint at batch >= 256): its GPU
# tests (test_default_append_route_at_batch_256 among them), then Qwen3.5-4B-like end to end.
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_tma.log 2>&1
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_qwen3_5_4b_like.json > $OUT/e2e_qwen3_5_4b_like.log 2>&1
