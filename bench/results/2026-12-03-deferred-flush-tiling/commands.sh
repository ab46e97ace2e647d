# 2026-12-03, one H200, jax 0.11.2. Four GPU commands of the same hour; each wrote under $OUT, its files
# here as runN_<name>. Each run's environment:
# PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the repository root. Runs 1-3: the code of
# 0cb0702 (runs 2-3 with bench/kernels.py's --sweep-routes taking "deferred", as committed in 5b04ffe);
# run 4: 5b04ffe.

# run 1: the pytest list of bench/gpu_checks.sh
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1

# run 2: the deferred route's flush tilings at batch 256, f32 (Triton kernel path; flush fields after ':')
g="64x4x2b"; m="16x2x5b"
python3 bench/kernels.py --sweep --sweep-routes deferred --profile --repeats 3 --layers gdn --state-dtypes float32 \
  --batches 256 --lengths 16 --out $OUT --tag sweep_gdn --replay-configs \
  "$g:64x4x8,$g:32x4x8,$g:32x2x8,$g:16x2x8,$g:128x8x8,$g:64x8x8,$g:64x4x4,$g:64x4x16,$g:64x4x2,$g:32x4x16,$g:128x4x8,$g:64x4x32"
python3 bench/kernels.py --sweep --sweep-routes deferred --profile --repeats 3 --layers mamba2 --state-dtypes float32 \
  --batches 256 --lengths 16 --out $OUT --tag sweep_m2 --replay-configs \
  "$m:16x2x8,$m:16x4x8,$m:32x2x8,$m:32x4x8,$m:64x4x8,$m:128x4x8,$m:128x8x8,$m:16x2x4,$m:16x2x16,$m:32x4x16,$m:64x4x4,$m:16x1x8"

# run 3: batches 64 and 512 at f32, batch 256 at bf16, and the output route beside the deferred one
sw() { tag=$1; shift; python3 bench/kernels.py --sweep --profile --repeats 3 --lengths 16 --out $OUT --tag $tag "$@" > $OUT/$tag.log 2>&1; }
gb="64x2x2"; mb="16x2x5"
sw gdn_f32 --sweep-routes deferred --layers gdn --state-dtypes float32 --batches 64,512 \
  --replay-configs "$g:32x4x8,$g:64x4x32,$g:32x4x32,$g:64x4x16,$g:32x4x4"
sw m2_f32 --sweep-routes deferred --layers mamba2 --state-dtypes float32 --batches 64,512 \
  --replay-configs "$m:32x4x8,$m:32x4x4,$m:32x8x8,$m:16x4x8,$m:32x4x16,$m:64x8x8"
sw gdn_bf16 --sweep-routes deferred --layers gdn --state-dtypes bfloat16 --batches 256 \
  --replay-configs "$gb:32x2x8,$gb:32x4x8,$gb:64x4x8,$gb:64x2x32,$gb:128x4x8,$gb:32x4x32"
sw m2_bf16 --sweep-routes deferred --layers mamba2 --state-dtypes bfloat16 --batches 256 \
  --replay-configs "$mb:32x4x8,$mb:32x2x8,$mb:16x4x8,$mb:64x4x8,$mb:32x4x4"
sw out_gdn --sweep-routes output,deferred --layers gdn --state-dtypes float32 --batches 256 \
  --replay-configs "$g:32x4x8,$g:64x4x32"
sw out_m2 --sweep-routes output,deferred --layers mamba2 --state-dtypes float32 --batches 256 \
  --replay-configs "$m:32x4x8,$m:32x4x4"

# run 4: the deferred route's GPU tests, then both layers beside the original (b256, b512, f32)
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256,512 --lengths 16 \
  --dtypes float32 --deadline-s 50 > $OUT/orig.log 2>&1        # ../shared/anchors harness
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
