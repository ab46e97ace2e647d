# 2026-12-06, a second H100 80GB HBM3 machine (driver 580.159.04), the tree of 3ab3402 (kernels of 2908a70): one GPU command from the repository root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 40 python3 .anchors/harness_orig.py run --out $OUT/orig_m2.json --layers mamba2 --batches 64 --dtypes bfloat16 --lengths 16 --repeats 3 --deadline-s 1 > $OUT/orig_m2.log 2>&1
timeout 100 python3 bench/results/2026-12-06-mamba2-entry-cursor/repeat/m2_entry_probe_b64.py > $OUT/m2_entry.log 2>&1; tail -6 $OUT/m2_entry.log | cut -c1-110
grep -E '^mamba|replay L16' $OUT/orig_m2.log | head
