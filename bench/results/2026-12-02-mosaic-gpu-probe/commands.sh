#!/usr/bin/env bash
# 2026-12-02, one H200, from the repository root at fcf9233's tree plus these probe files,
# PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false. The probe (gdn_mgpu.py) is the GDN
# append route's readout on Mosaic GPU in three forms: one item per program (`gdn_append`), persistent
# programs pipelining their items (`gdn_append_pipelined`, mode full / noslots / read) and the same with the
# per-head terms formed by an XLA prelude (`gdn_append_pre`, the form replayssm_jax/kernels/tma_readout.py
# takes). It writes o and the d records (the k and g records are not written). time_probe.py times each form
# against our Triton append kernel in one process (a lockstep cycle of L - 1 = 15 append steps from cursor 0,
# batch 256, L = 16, bf16 activations and buffers) after comparing one step's outputs and d records with it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
P=bench/results/2026-12-02-mosaic-gpu-probe

# On a CPU (no GPU needed): the Mosaic GPU lowering, and the one-item form against our kernel in
# Mosaic GPU's interpreter (the pipelined forms use predicated copies, which the interpreter lacks).
JAX_PLATFORMS=cpu python3 $P/lower_test.py float32 pipe
JAX_PLATFORMS=cpu python3 $P/check.py

# 1. probe_1.*: the one-item form, 64 and 128 rows, f32 and bf16 checkpoints (then gdn_append_pipelined did
#    not exist; the variants were named mgpu-bv64 and mgpu-bv128); then the Qwen3.5-4B-like
#    model end to end: e2e_qwen_b256_f32.*
PV_float32=one:64:1:1,one:128:1:1 PV_bfloat16=one:64:1:1,one:128:1:1 python3 $P/time_probe.py
python3 bench/e2e.py --models qwen3_5_4b_like --batches 256 --modes standard,16 --ssm-state-dtype float32 \
  --prompt-len 128 --new-tokens 64 --profile --out e2e_qwen_b256_f32.json
# 2. probe_2.log: the pipelined form, every slot's scores reduced in the kernel (mode full), 64 rows, 1-2 stages
#    (the command's 280 s ran out during the third variant's compile); a first try of it failed with a
#    misaligned address: stage buffers under 128 bytes (g records of one head, beta of one row)
SDS=float32 PV_float32=full:64:1:264,full:64:2:264,full:64:3:132 python3 $P/time_probe.py
# 3. probe_3.*: the pipelined form's copies alone (read: the checkpoint tile's row sums only) and its full
#    math without the buffer terms (noslots)
SDS=float32 PV_float32=read:64:2:264,read:64:4:132,read:128:2:132,noslots:64:2:264 python3 $P/time_probe.py
# 4. probe_4.*: the terms from the XLA prelude (gdn_append_pre)
SDS=float32 PV_float32=pre:64:2:264,pre:128:2:132,pre:64:4:132 python3 $P/time_probe.py
