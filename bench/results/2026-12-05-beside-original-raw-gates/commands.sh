# 2026-12-05, one H200, jax 0.11.2, the tree of 4582107 (the GDN kernels forming their gates from the raw
# projections; Mamba-2's dt read in place). Six GPU commands from the repository root on one machine, each started
# as the one before it ended; files here as runN_<name>.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# run 1: the GPU tests fixed in e0850ef, then the original's kernels and vLLM's
python3 -m pytest -m gpu tests/test_attention_decode.py tests/test_conv.py tests/test_gdn_gates.py tests/test_inplace_hlo.py \
  -k "compiled_kernel_matches_reference or compiled_packed_step or compiled_decode_step_cuts or compiled_gdn_decode_step or raw_gates_equal_given_gates" \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
python3 .anchors/harness_orig.py run --out orig.json --batches 64,256,512 --lengths 16 --deadline-s 300 > orig.log 2>&1

# run 2: ours (stopped by its 420 s limit after Mamba-2 bf16 at batch 256; run 5 times batch 512)
timeout 420 python3 bench/kernels.py --profile --repeats 7 --layers gdn,mamba2 --state-dtypes float32,bfloat16 \
  --batches 64,256,512 --lengths 16 --out . --tag ours > ours.log 2>&1
python3 -m pytest -m gpu tests/test_attention_decode.py -k "compiled_kernel_matches_reference and float32" -q -x  # one failure's numbers

# run 3: end to end, f32 state, batch 256, both attention backends
for m in qwen3_5_4b_like nemotron3_nano_4b_like; do
  python3 bench/e2e.py --models $m --batches 256 --modes standard,16 --prompt-len 128 --new-tokens 64 --profile \
    --attention-backend xla --out e2e_${m}_xla.json > e2e_${m}_xla.log 2>&1
done
for m in qwen3_5_4b_like nemotron3_nano_4b_like; do
  python3 bench/e2e.py --models $m --batches 256 --modes 16 --prompt-len 128 --new-tokens 64 --profile \
    --attention-backend pallas --out e2e_${m}_pallas.json > e2e_${m}_pallas.log 2>&1
done

# run 4: end to end, bf16 state, batch 1, 64 and 512 (Qwen stopped by its 230 s limit before its ReplaySSM run at 512)
for m in nemotron3_nano_4b_like qwen3_5_4b_like; do
  timeout 230 python3 bench/e2e.py --models $m --batches 1,64,512 --modes standard,16 --ssm-state-dtype bfloat16 \
    --prompt-len 128 --new-tokens 64 --out e2e_${m}_bf16.json > e2e_${m}_bf16.log 2>&1
done

# run 5: ours, Mamba-2 bf16 at batch 512
python3 bench/kernels.py --profile --repeats 7 --layers mamba2 --state-dtypes bfloat16 --batches 512 --lengths 16 \
  --out . --tag ours_m2bf16_512 > ours2.log 2>&1

# run 6: the CLI on the Qwen3-Next fixture (the first part of `bench/gpu_checks.sh bench`)
python3 -m replayssm_jax.generate --checkpoint tests/data/qwen3_next_tiny --prompt-ids "<the fixture's prompts>" \
  --max-new-tokens 40 --stop "" --backend pallas --compare --json > cli_fixture.json

# then, on the same machine: the six failing f32 attention cases with the reference's products at IEEE f32
JAX_DEFAULT_MATMUL_PRECISION=highest python3 -m pytest -m gpu tests/test_attention_decode.py \
  -k "compiled_kernel_matches_reference and float32" -q   # 6 passed
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 -m pytest -m gpu tests/test_attention_decode.py \
  -k "compiled_kernel_matches_reference and float32 and 64" -q   # 2 failed: 1.1e-3, 1.7e-3 (cuBLAS TF32)

# the ratios to the original (here): bench/kernels.py's `against_original` over run1_orig.json and the two
# JSONs of ours, and ../shared/anchors/compare.py --orig run1_orig.json --ours run2_ours.json,run5_... --cursors C
