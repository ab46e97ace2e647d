# 2026-12-03, one H200, jax 0.11.2. Each run wrote under $OUT; its files are here as runN_<name>.
# Each run's environment: PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false, from the repository root.
# Runs 1 and 2 ran earlier states of the change committed as ff0e673 (on 03986c2):
# Run 1: the Mamba-2 append route on Mosaic GPU (its launch after the readout four heads a program), before
#   the benchmark's per-step inputs.
# Run 2: with the per-step inputs and the GDN direct route and standard step on Mosaic GPU, before ff0e673's
#   last fixes (the step kernel's items stepped once each; the launch after the Mamba-2 readout on one head a
#   program with live-only loads).

# run 1
python3 -m pytest -m gpu tests/test_mamba2_tma.py tests/test_tma_readout.py -q -n 16 -p no:cacheprovider \
  -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers mamba2 --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 40 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1

# run 2 (run 1's commands with tests/test_tma_step.py added to the tests and --layers gdn,mamba2 to both
# benchmarks, then the sweep of the Mamba-2 launches, which patched the module's HEADS_PER_PROGRAM and
# load_live of that tree)
python3 bench/results/2026-12-03-mosaic-steps/heads_sweep.py 256 > $OUT/heads_sweep.log 2>&1

# run 3 (ff0e673's code)
python3 -m pytest -m gpu tests/test_tma_step.py tests/test_mamba2_tma.py tests/test_tma_readout.py \
  tests/test_inplace_hlo.py -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes float32 --deadline-s 25 > $OUT/orig.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 256 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1   # (its log did not come back; ours.json did)
for m in nemotron3_nano_4b_like qwen3_5_4b_like; do   # each under a 115 s limit
  python3 bench/e2e.py --models $m --batches 256 --modes standard,16 --ssm-state-dtype float32 \
    --prompt-len 128 --new-tokens 64 --profile --out $OUT/e2e_${m}_b256.json > $OUT/e2e_${m}_b256.log 2>&1
done

# runs 4-6 (d2fe074's code): the Mamba-2 layer at other batches and with a bf16 checkpoint
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers mamba2 --batches 64,512 --lengths 16 \
  --dtypes float32 --deadline-s 25 > $OUT/orig.log 2>&1                                      # run 4
python3 bench/kernels.py --profile --repeats 3 --layers mamba2 --state-dtypes float32 --batches 64,512 --lengths 16 \
  --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
# run 5: the same two commands with --batches 256 --dtypes bfloat16 / --state-dtypes bfloat16
# run 6: the same two commands with --batches 64 --dtypes bfloat16 / --state-dtypes bfloat16
