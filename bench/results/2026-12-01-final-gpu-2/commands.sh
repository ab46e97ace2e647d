# 2026-12-01, H200, the working tree of 3b3901b (the device's copy of .git still named 277982b,
# which the JSON files' "commit" fields repeat). Each command under the timeout shown.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 215 python -m pytest -m gpu tests/test_tree_verify.py tests/test_verify_kernels.py tests/test_quantized_state.py -q -n 14 -p no:benchmark -p no:cacheprovider -W ignore::DeprecationWarning
E="python bench/e2e.py --models qwen3_5_4b_like --batches 256 --prompt-len 128 --new-tokens 32"
timeout 125 $E --modes 16,16:int8 --out $OUT/e2e.json
timeout 100 $E --modes 16 --tp 1 --out $OUT/e2e_tp1.json          # ended by its timeout, no row
timeout 85 python bench/kernels.py --layers gdn,mamba2 --state-dtypes bfloat16,int8,float8_e4m3fn --batches 256 --lengths 16 --repeats 3 --out $OUT --tag k8   # ended by its timeout after the GDN rows
