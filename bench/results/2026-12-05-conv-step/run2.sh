#!/usr/bin/env bash
# GPU run 2: end to end, Qwen3.5-4B-like, standard state, the GDN layers' conv fused or apart; then the GPU tests of the
# conv launch and of the compiled decode steps.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
for f in off on; do
  timeout 170 python3 bench/e2e.py --models qwen3_5_4b_like --batches 1,8 --modes standard --prompt-len 128 \
    --new-tokens 64 --fuse-conv $f --out $OUT/e2e_fuse_$f.json > $OUT/e2e_fuse_$f.log 2>&1; echo "e2e $f rc=$?"
done
timeout 200 python3 -m pytest -m gpu tests/test_conv.py tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests_conv_hlo.log 2>&1
tail -3 $OUT/gpu_tests_conv_hlo.log
for f in off on; do grep -E "^qwen3_5_4b_like +[0-9]+ +standard" $OUT/e2e_fuse_$f.log | sed "s/^/fuse=$f /"; done
