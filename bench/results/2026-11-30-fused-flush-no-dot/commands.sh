export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
python3 bench/kernels.py --sweep --layers gdn --state-dtypes float32,bfloat16 --batches 256 --lengths 16 --repeats 5 --profile \
  --standard-configs 32x4 --replay-configs 128x4x1f --out $OUT --tag sweep_gdn_b256 > $OUT/sweep_gdn_b256.log 2>&1
python3 bench/kernels.py --sweep --layers mamba2 --state-dtypes float32 --batches 256 --lengths 16 --repeats 5 --profile \
  --standard-configs 16x2 --replay-configs 32x4x3f --out $OUT --tag sweep_mamba_b256 > $OUT/sweep_mamba_b256.log 2>&1
grep -E "^sweep|replay_output|replay_flush" $OUT/sweep_gdn_b256.log $OUT/sweep_mamba_b256.log | sed 's/.*log://'
python3 bench/kernels.py --layers gdn,mamba2 --state-dtypes float32 --batches 1 --lengths 16 --repeats 5 --out $OUT --tag kernels_b1 > $OUT/kernels_b1.log 2>&1
grep -E "^(gdn|mamba2) " $OUT/kernels_b1.log
