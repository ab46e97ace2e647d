# 2026-12-02, one H200, PYTHONPATH at the repository root, XLA_PYTHON_CLIENT_PREALLOCATE=false.
# 1. The GPU tests of the replay tilings (prefetch tilings included), the HLO of the timing scan, the prefetch sweep.
python3 -m pytest -m gpu tests/test_kernels.py -k test_replay_tilings -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning   # gpu_tests_tilings.log
XLA_FLAGS="--xla_dump_to=hlo --xla_dump_hlo_module_re=.*cycle.*" python3 bench/kernels.py --layers gdn --state-dtypes float32 --batches 256 --lengths 16 --repeats 1 --profile --tag dump   # hlo/*after_optimizations.txt
cd bench
python3 kernels.py --sweep --profile --layers gdn --state-dtypes float32,bfloat16 --batches 256,64 --lengths 16 --repeats 3 --standard-configs 32x4 --replay-configs 64x4x2bp,64x4x2p,64x2x2p,64x2x2   # sweep_gdn.*
python3 kernels.py --sweep --profile --layers mamba2 --state-dtypes float32,bfloat16 --batches 256,64 --lengths 16 --repeats 3 --standard-configs 16x2 --replay-configs 16x2x5bp,16x2x5p   # sweep_mamba2.*
