# 2026-12-06, one NVIDIA H100 80GB HBM3, the tree of a635e66 (the verify ops and layers record the draft tree's
# parents; no kernel changed). One GPU command from the repository root.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pytest -m gpu tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_verify_kernels.py -q -n 8 \
  -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests_tree.log 2>&1   # 30 passed
