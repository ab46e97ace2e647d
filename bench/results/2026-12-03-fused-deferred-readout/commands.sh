# 2026-12-03, one H200, jax 0.11.2. Two GPU commands (the same script), from the repository root with
# PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; files here as runN_<name>. The anchors harness
# (../shared/anchors/harness_orig.py, the original's kernels extracted into .anchors/peer) ran in the same
# command as our benchmark. Run 1: the GDN readout that flushes full rows itself, its flush as L unrolled
# outer products; run 2: the code as committed (one loop body, the flush's own record copies).
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn --batches 256,512 --lengths 16 \
  --dtypes float32 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes float32 --batches 256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
