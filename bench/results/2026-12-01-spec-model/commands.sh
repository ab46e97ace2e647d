# 2026-12-01, H200, commit 277982b plus bench/spec.py's --drafters (first call) and repeats 1 (second call).
# First call (timeouts 340 s and 200 s; both reached):
python bench/spec.py --models qwen3_5_4b_like --batches 256 --new-tokens 32 --out $OUT/q256
python bench/spec.py --models qwen3_5_4b_like --batches 64 --drafters oracle --new-tokens 32 --out $OUT/q64
# Second call (timeouts 210, 130, 200 s; all reached):
S="python bench/spec.py --models qwen3_5_4b_like --new-tokens 32 --repeats 1"
$S --batches 256 --modes ar-replay,spec-replay --out $OUT/r256
$S --batches 64 --modes ar-replay,spec-replay --drafters oracle --out $OUT/r64
$S --batches 1,16 --alphas 0.8 --drafters oracle --out $OUT/b1
