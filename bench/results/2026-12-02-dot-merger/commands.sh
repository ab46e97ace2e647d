# 2026-12-02, one H200. e2e_qwen_b256_merged*: main at 5ecae6e (XLA's dot merger on, the default then);
# the rest at 3c7e1f8 (replayssm_jax.compilation: the dot merger off).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
A="--models qwen3_5_4b_like --batches 256 --modes standard,16 --prompt-len 128 --new-tokens 64 --profile"
python3 bench/e2e.py $A --out e2e_qwen_b256_merged.json
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 bench/e2e.py $A --out e2e_qwen_b256_merged_no_triton_gemm.json
# at 3c7e1f8:
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -m gpu tests/test_inplace_hlo.py tests/test_compilation.py -q -n 8 -p no:cacheprovider -W ignore::DeprecationWarning   # gpu_tests.log
python3 bench/e2e.py --models qwen3_5_4b_like,nemotron3_nano_4b_like --batches 256 --modes standard,16 --prompt-len 128 --new-tokens 64 --profile --out e2e_b256.json
