set -x
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
python3 bench/kernels.py --sweep --layers gdn --state-dtypes float32,bfloat16 --batches 256 --lengths 16 --repeats 5 --profile \
  --replay-configs 64x4x2f:32,64x4x2f:64,128x4x1f,128x4x1f:32 --out $OUT --tag sweep_gdn_b256 > $OUT/sweep_gdn_b256.log 2>&1
tail -30 $OUT/sweep_gdn_b256.log
python3 bench/kernels.py --sweep --layers mamba2 --state-dtypes float32,bfloat16 --batches 256 --lengths 16 --repeats 5 --profile \
  --replay-configs 16x2x5f:8,32x4x3f,32x4x3f:32,16x4x5f --out $OUT --tag sweep_mamba_b256 > $OUT/sweep_mamba_b256.log 2>&1
tail -30 $OUT/sweep_mamba_b256.log
python3 bench/kernels.py --layers gdn,mamba2 --state-dtypes float32 --batches 1 --lengths 16 --repeats 5 --out $OUT --tag kernels_b1 > $OUT/kernels_b1.log 2>&1
tail -25 $OUT/kernels_b1.log
