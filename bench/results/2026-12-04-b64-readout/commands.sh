# 2026-12-04, one H200, jax 0.11.2, the tree of 261fb82. One GPU command from the repository root:
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 430 python3 bench/results/2026-12-04-b64-readout/probe_tiling.py > $OUT/probe_tiling.log 2>&1
