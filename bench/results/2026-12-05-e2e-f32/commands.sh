# 2026-12-05, one H200 (driver 580.159.04), jax 0.11.2, the tree of 7edfe6a (kernels as at af61adb). Three GPU commands
# from the repository root in the same hour; files here as runN_<name>. probe_standard.py and ptx_count.py ran from
# the repository root (here for the record).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# run 1
python3 .anchors/harness_orig.py run --out orig.json --layers gdn --batches 256 --lengths 16 \
  --dtypes float32,bfloat16 --deadline-s 10 > orig.log 2>&1
XLA_FLAGS="--xla_dump_to=/tmp/xladump" python3 ptx_count.py /tmp/xladump > ptx.txt 2>&1  # found no PTX in XLA's dump:
#   ptx.txt lists the Triton cache's kernels only (the harness's vLLM kernels)
PROBE_BATCHES=256 python3 probe_standard.py > probe.log 2>&1  # stopped at its '.cg load' variant: this JAX's
#   Triton lowering takes no '.cg' cache modifier (KeyError); the variants before it are in probe.log
timeout 330 python3 bench/e2e.py --batches 256,512 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 \
  --new-tokens 64 --profile --out e2e.json > e2e.log 2>&1  # stopped at 330 s, after Qwen's standard mode at 256;
#   the JSON has every configuration it finished

# run 2 (the same machine, warm)
PROBE_BATCHES=256 PROBE_TRITON="as built" python3 probe_standard.py > probe.log 2>&1
timeout 300 python3 bench/e2e.py --models qwen3_5_4b_like --batches 256,512 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out e2e_qwen.json > e2e_qwen.log 2>&1  # stopped after batch 256

# run 3
python3 bench/e2e.py --models qwen3_5_4b_like --batches 512 --modes standard,16 --ssm-state-dtype float32 --prompt-len 128 \
  --new-tokens 64 --profile --out e2e_qwen_b512.json > e2e_qwen_b512.log 2>&1

# run 4 (the tree of 715cf78: the profile names the HLO instructions behind copy launches)
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard --ssm-state-dtype float32 --prompt-len 128 \
  --new-tokens 64 --profile --out e2e_qwen_copies.json > e2e_qwen_copies.log 2>&1
