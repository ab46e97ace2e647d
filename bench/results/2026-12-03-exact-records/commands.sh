# 2026-12-03, one H200, jax 0.11.2. Each run wrote under $OUT; its files are here as runN_<name>, the e2e
# files renamed: e2e_qwen_b256.* -> run1_e2e_qwen3_5_4b_like_b256.*, e2e_nemotron_b256.* ->
# run2_e2e_nemotron3_nano_4b_like_b256.*.
# Each run's environment: PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the repository root.
# The e2e JSONs' `commit` field is stale (83b4d72 in runs 1 and 2); the runs' code is as below.

# run 1 (83b4d72): the GPU test list of bench/gpu_checks.sh under a 300 s limit (cut at 257 tests, none
# failed: run 4 repeats it), then Qwen3.5-4B-like end to end
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_qwen_b256.json > $OUT/e2e_qwen_b256.log 2>&1

# run 2 (8f7bf98: buffer_dtype None by default; kernels as 83b4d72)
python3 bench/e2e.py --models nemotron3_nano_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_nemotron_b256.json > $OUT/e2e_nemotron_b256.log 2>&1
python3 bench/results/2026-12-03-exact-records/prelude_liveonly.py > $OUT/prelude_liveonly.log 2>&1
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
ncu --clock-control none -k 'regex:gdn_direct|gdn_step|gdn_append_terms' --launch-skip 3 --launch-count 3 $S \
  python3 bench/results/2026-12-03-exact-records/ncu_drive.py gdn > $OUT/ncu_gdn.txt 2>&1
ncu --clock-control none -k 'regex:mamba2_direct|mamba2_step|mamba2_append_heads' --launch-skip 3 --launch-count 3 $S \
  python3 bench/results/2026-12-03-exact-records/ncu_drive.py mamba2 > $OUT/ncu_mamba2.txt 2>&1

# run 3 (8f7bf98): the direct step's variants, patched in at run time ("acc" is the rank-L update
# that 105919e made the library's and the next commit undid)
python3 bench/results/2026-12-03-exact-records/direct_probe.py > $OUT/direct_probe.log 2>&1

# run 4 (105919e: the rank-L update onto the tile, since undone; the prelude's live-only loads)
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 25 > $OUT/orig.log 2>&1        # ../shared/anchors harness
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
# then run 1's test command, with its log as gpu_tests.log
