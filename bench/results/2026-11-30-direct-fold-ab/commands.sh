export XLA_PYTHON_CLIENT_PREALLOCATE=false
unset PYTHONPATH
for t in wt_old wt_new wt_old wt_new; do python3 abtest/ab.py $t 1 standard,direct 2>&1 | grep -v Warning; done
PYTHONPATH=$PWD timeout 400 python3 -m pytest -m gpu tests/test_kernels.py tests/test_inplace_hlo.py -q -n 14 -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
echo "tests rc $?"; tail -3 $OUT/gpu_tests.log
