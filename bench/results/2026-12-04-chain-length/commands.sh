# 2026-12-04, one H200, jax 0.11.2. Three GPU commands of the same hour, from the repository root with
# PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false; files here as runN_<name>. The kernels are those of 694a3ff
# in every run; only bench/kernels.py's timing differs. probe.py was kept outside the tree when it ran.

# run 1 (694a3ff): a timed cycle's wall time against its kernel time: chains of 1, 4 and 16 calls of 32 and 128
# layer-steps a call, and a trace of a chain of 4 calls (GDN standard at batch 64 and 256, GDN deferred in step at
# 256 and staggered at 512, Mamba-2 standard at 256; f32, L = 16)
python3 bench/results/2026-12-04-chain-length/probe.py > $OUT/probe.log 2>&1

# run 2 (694a3ff + chained_calls 16, no min_chain_s yet): both layers beside the original, f32 at batch
# 64-512 and bf16 at 256; the anchors harness in the same command
python3 .anchors/harness_orig.py run --out $OUT/orig.json --layers gdn,mamba2 --batches 64,256,512 --lengths 16 \
  --dtypes float32 --deadline-s 90 > $OUT/orig.log 2>&1
python3 .anchors/harness_orig.py run --out $OUT/orig_bf16.json --layers gdn,mamba2 --batches 256 --lengths 16 \
  --dtypes bfloat16 --deadline-s 50 > $OUT/orig_bf16.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 64,256,512 \
  --lengths 16 --orig $OUT/orig.json --out $OUT --tag ours > $OUT/ours.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes bfloat16 --batches 256 \
  --lengths 16 --orig $OUT/orig_bf16.json --out $OUT --tag ours_bf16 > $OUT/ours_bf16.log 2>&1

# run 3 (the timing of the commit that adds this folder: chains of >= 16 calls and >= 0.1 s): batch 64 beside the
# original, then end to end at batch 256
python3 .anchors/harness_orig.py run --out $OUT/orig64.json --layers gdn,mamba2 --batches 64 --lengths 16 \
  --dtypes float32 --deadline-s 40 > $OUT/orig64.log 2>&1
python3 bench/kernels.py --profile --repeats 3 --layers gdn,mamba2 --state-dtypes float32 --batches 64 \
  --lengths 16 --orig $OUT/orig64.json --out $OUT --tag ours64 > $OUT/ours64.log 2>&1
python3 bench/e2e.py --batches 256 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 \
  --new-tokens 64 --profile --out $OUT/e2e_b256.json > $OUT/e2e.log 2>&1

# run 4: the GDN deferred step with a bf16 checkpoint at batch 256, the tree of 141895d (0d0ecf3's parent; its
# package and bench/*.py, unpacked into old/) against this one, twice in turn
for round in 1 2; do
  (cd old && PYTHONPATH=$PWD python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 \
    --batches 256 --lengths 16 --out $OUT --tag old$round > $OUT/old$round.log 2>&1)
  PYTHONPATH=$PWD python3 bench/kernels.py --profile --repeats 3 --layers gdn --state-dtypes bfloat16 \
    --batches 256 --lengths 16 --out $OUT --tag new$round > $OUT/new$round.log 2>&1
done

# run 5 (the tree of this folder's commit): the GDN deferred readout with a bf16 checkpoint at batch 256, staggered
# cursors, with parts left out at run time: the flush keys' fetch a step ahead and its waits, a full row's record
# copies of all its slots, both. The 2026-12-03 probe with a "bf16" mode added (probe_bf16.patch, from
# ../2026-12-03-flush-keys-ahead/probe.py):
cp bench/results/2026-12-03-flush-keys-ahead/probe.py /tmp/probe.py && patch /tmp/probe.py bench/results/2026-12-04-chain-length/probe_bf16.patch
python3 /tmp/probe.py bf16 > $OUT/probe_bf16.log 2>&1
