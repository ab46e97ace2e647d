export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout 330 python3 -m pytest -m gpu tests/test_kernels.py tests/test_inplace_hlo.py -q -n 14 -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
timeout 150 python3 bench/kernels.py --layers gdn,mamba2 --state-dtypes float32,bfloat16 --batches 64 --lengths 16 --repeats 5 --out $OUT --tag kernels_b64 > $OUT/kernels_b64.log 2>&1
grep -A8 "^| layer" $OUT/kernels_b64.log
