#!/usr/bin/env bash
# GPU run 1: the fused conv step's benchmark (two launches against one), then its GPU tests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 360 python3 bench/conv_step.py --batches 1,8,64,256 --profile --repeats 5 --out $OUT > $OUT/conv_step.log 2>&1
echo "conv_step rc=$?"
timeout 200 python3 -m pytest -m gpu tests/test_conv_step.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_conv_step.log 2>&1
tail -3 $OUT/gpu_tests_conv_step.log
grep -E "^\|" $OUT/conv_step.log | tail -12
