# 2026-12-05, one H200, the tree of 8338172 (runs 1-2) and a99dbc3 (run 3); from the repository root,
# PYTHONPATH=$PWD PYTHONUNBUFFERED=1.
P=bench/results/2026-12-05-qwen-copies/probe_kernels.py

# run 1: every kernel of one decode step, XLA's command buffers off (each launch names its HLO instruction)
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 $P qwen3_5_4b_like 256 standard $OUT > run1_probe_qwen.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 $P nemotron3_nano_4b_like 256 standard $OUT > run1_probe_nemotron.log

# run 2: the GPU test marker (bench/gpu_checks.sh's pytest list)
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py \
  tests/test_quantized_state.py tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py \
  tests/test_conv.py tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning --durations=15 > run2_gpu_tests.log

# run 3: the decode step with command buffers on, then off (both stopped early: the first at its --out,
# a folder, which e2e.py took for a file until 2026-12-05; the second at the device time left, after
# its standard row)
A="--models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 --new-tokens 64 --profile"
python3 bench/e2e.py $A --out $OUT > run3_e2e_command_buffers_on.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 bench/e2e.py $A > run3_e2e_command_buffers_off.log
