# 2026-12-01, H200, main at d5a9609 (the JSON files' "commit" fields say 277982b: the device's copy
# of .git is stale). One GPU command; the two runs one after the other.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
E="python bench/e2e.py --models qwen3_5_4b_like --batches 256 --prompt-len 128 --new-tokens 32 --modes 16"
(time timeout 150 $E --out $OUT/e2e_nomesh.json) > $OUT/e2e_nomesh.log 2>&1
(time timeout 330 $E --tp 1 --out $OUT/e2e_tp1.json) > $OUT/e2e_tp1.log 2>&1
