export XLA_PYTHON_CLIENT_PREALLOCATE=false
D=/tmp/xd; rm -rf $D
MLIR_ENABLE_DUMP=1 XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_as_text" python3 abtest/dump.py > /tmp/dump_stdout.txt 2> /tmp/dump_stderr.txt
echo "dump rc $?"; ls $D | head -30; ls $D | wc -l; du -sh $D; wc -c /tmp/dump_stderr.txt
grep -l "\.entry" $D/* | head; grep -c "bar.sync\|barrier" $D/*.ptx 2>/dev/null | head
tar czf $OUT/xla_dump.tgz -C /tmp xd dump_stderr.txt dump_stdout.txt; ls -la $OUT
PYTHONPATH=$PWD timeout 420 python3 -m pytest -m gpu tests/test_kernels.py tests/test_inplace_hlo.py -q -n 14 -p no:benchmark -W ignore::DeprecationWarning > $OUT/gpu_tests.log 2>&1
echo "tests rc $?"; tail -5 $OUT/gpu_tests.log
