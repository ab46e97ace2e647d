# 2026-12-03, one H200, jax 0.11.2. Six GPU commands of the same two hours, from the repository root with
# PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; files here as runN_<name>. probe.py and ncu_prelude.py
# were kept outside the tree when they ran (probe.py as of run 3: run 2 ran it before its "deferred" and
# "stdsweep" modes were added; its "standard" mode stopped at its Mosaic GPU configs, block_v 32 being refused,
# after the Triton tilings). probe.py's source-patched variants leave parts of a kernel out; their outputs are
# wrong and only their times count.

# run 1 (141895d): ncu of the GDN preludes, deferred (staggered cursors) and append, batch 256, f32, L = 16
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
ncu --clock-control none -k 'regex:gdn_deferred_terms|gdn_append_terms' --launch-skip 2 --launch-count 4 $S \
  python3 bench/results/2026-12-03-flush-keys-ahead/ncu_prelude.py > $OUT/ncu_prelude.txt 2>&1

# run 2 (141895d): the deferred step's parts left out (prelude: the slot-0 stash, the flush weights; readout:
# the flush's products, its copies, its store wait), and the standard step's Triton tilings, batch 256
python3 bench/results/2026-12-03-flush-keys-ahead/probe.py prelude flush standard > $OUT/probe.log 2>&1

# run 3 (the readout and prelude changes of 0d0ecf3, the standard tiling not yet changed): the readout's GPU
# tests, the deferred step at batch 256, and the standard step's tilings at batch 64-512, both layers and
# state dtypes
python3 -m pytest -m gpu tests/test_tma_readout.py -q -n 8 -p no:cacheprovider -p no:benchmark \
  -W ignore::DeprecationWarning > $OUT/gpu_tests_tma_readout.log 2>&1
python3 bench/results/2026-12-03-flush-keys-ahead/probe.py deferred > $OUT/probe_deferred.log 2>&1
python3 bench/results/2026-12-03-flush-keys-ahead/probe.py stdsweep > $OUT/probe_stdsweep.log 2>&1

# run 4 (0d0ecf3 but for a missing default of `_fit_step_config`'s `layer`, which stopped the benchmark's
# correctness check): the deferred tests
python3 -m pytest -m gpu tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_kernels.py tests/test_pool.py \
  -k deferred -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_deferred.log 2>&1

# run 5 (the code of 0d0ecf3): both layers beside the original at batch 64-512, f32 checkpoints; the anchors
# harness (../shared/anchors/harness_orig.py, the original's kernels extracted into .anchors/peer) in the same
# command as our benchmark
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 64,256,512 --lengths 16 \
  --dtypes float32 --deadline-s 90 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 6 (the code of 0d0ecf3): the pytest list of bench/gpu_checks.sh
python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py tests/test_quantized_state.py \
  tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
