# 2026-12-01, H200, main at d9b6184 (the JSON files' "commit" fields say 277982b: the device's copy
# of .git is stale). Two GPU commands; each line under the timeout shown; "rc 124": ended by it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 130 python -m pytest -m gpu tests/test_per_draft_verify.py tests/test_pool.py -q -n 8 -p no:benchmark -p no:cacheprovider -W ignore::DeprecationWarning   # 14 passed
timeout 110 python bench/kernels.py --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 --verify 4 --repeats 3 --out $OUT --tag verify   # rc 124 before Mamba-2's verify rows
timeout 335 python bench/spec.py --models qwen3_5_4b_like --batches 256 --alphas 0.8 --drafters oracle --tree 3,2 --new-tokens 32 --out $OUT/spec   # rc 124 in spec-replay
# second command
timeout 262 python bench/spec.py --models qwen3_5_4b_like --batches 256 --alphas 0.8 --drafters oracle --modes ar-standard,ar-replay --tree 3,2 --new-tokens 16 --out $OUT/tree   # rc 124 in tree-standard
