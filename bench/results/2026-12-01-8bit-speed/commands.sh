# 2026-12-01, H200, main at fcf5768 (the JSON files' "commit" fields say 277982b: the device's
# copy of .git is stale). Two GPU commands, each line under the timeout shown.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
K="python bench/kernels.py --state-dtypes bfloat16,int8 --lengths 16 --repeats 3"
timeout 200 $K --layers mamba2 --batches 64,256,512 --out $OUT --tag k8m
timeout 130 $K --layers gdn --batches 64,512 --out $OUT --tag k8g
timeout 130 python bench/kernels.py --layers gdn --state-dtypes int8 --batches 256 --lengths 16 --repeats 3 --sweep --replay-configs 128x4x1,128x8x1,128x2x1,64x4x1,64x4x2,64x2x1,32x4x4,32x2x1 --out $OUT --tag sweep8g
timeout 110 python bench/kernels.py --layers mamba2 --state-dtypes int8 --batches 256 --lengths 16 --repeats 3 --sweep --replay-configs 16x2x5,16x4x5,16x1x5,32x4x3,16x2x1,16x4x1 --out $OUT --tag sweep8m
# second command
E="python bench/e2e.py --prompt-len 128 --new-tokens 32"
timeout 170 $E --models qwen3_5_4b_like --batches 256 --modes 16,16:bf16,16:int8 --out $OUT/e2e_q256.json
timeout 220 $E --models nemotron3_nano_4b_like --batches 512 --modes 16,16:bf16,16:int8 --out $OUT/e2e_n512.json
