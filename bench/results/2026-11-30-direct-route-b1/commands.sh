export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
git log --oneline -1 2>/dev/null
python3 bench/kernels.py --layers gdn --state-dtypes float32,bfloat16 --batches 1,2,4 --lengths 16 --repeats 7 --out $OUT --tag kernels_gdn_b1_4 > $OUT/kernels_gdn_b1_4.log 2>&1
python3 bench/kernels.py --layers mamba2 --state-dtypes float32,bfloat16 --batches 1 --lengths 16 --repeats 7 --out $OUT --tag kernels_mamba_b1 > $OUT/kernels_mamba_b1.log 2>&1
grep -A20 "^| layer" $OUT/kernels_gdn_b1_4.log; grep -E "^(gdn|mamba2) " $OUT/kernels_gdn_b1_4.log $OUT/kernels_mamba_b1.log | sed 's/.*log://'
for m in nemotron3_nano_4b_like qwen3_5_4b_like; do
  python3 bench/e2e.py --models $m --batches 1 --modes standard,16d --out $OUT/e2e_b1_$m.json > $OUT/e2e_b1_$m.log 2>&1; tail -3 $OUT/e2e_b1_$m.log
done
