# 2026-12-06, one NVIDIA H100 80GB HBM3 (driver 580.159.04; the card that came for these runs), jax 0.11.2, PyTorch
# 2.11 and Triton 3.6 for the other projects' kernels. Two GPU commands from the repository root on one machine, the
# tree of 69ca17a; files here as runN_<name> (vLLM's harness log did not come back; its table is below).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# run 1: vLLM's GDN standard kernel at its best config and the original's Mamba-2 kernels (bf16, batch 64), then
# fma_probe.py twice, in two processes: without and with LLVM's NVPTX FMA contraction forced on for every kernel
# XLA compiles (the option reaches LLVM through XLA's backend extra options)
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --repeats 3 --deadline-s 1 > vllm.log 2>&1
python3 .anchors/harness_orig.py run --out orig_m2.json --layers mamba2 --batches 64 --dtypes bfloat16 --lengths 16 \
  --repeats 3 --deadline-s 1 > orig_m2.log 2>&1
python3 fma_probe.py base > base1.log 2>&1
XLA_FLAGS=--xla_backend_extra_options=-nvptx-fma-level=1 python3 fma_probe.py fma > fma1.log 2>&1
# vLLM's best config in vllm.log, kernel us a step:
#   gdn f32  b64 93.96 (8x1x3)   b256 363.35 (32x2x3)   b512 720.99 (32x2x3)
#   gdn bf16 b64 48.62 (16x1x3)  b256 184.44 (16x1x3)   b512 365.36 (16x1x3)

# run 2: the Mamba-2 launch after the readout with its cursor's atomic arrivals against a racy store from each row's
# first head program (timing only: an upper bound of what a cursor moved without atomics saves)
python3 m2_atomic_probe.py > m2_atomic.log 2>&1

# On the CPU (no GPU), the tree of 69ca17a with mamba2_entry_cursor.patch applied, from its root:
#   python3 -m pytest tests/test_mamba2_tma.py -n 2            # 36 passed
#   for a in "0 8" "1 12" "2 6" "3 8"; do python3 interpret_check.py $a; done   # append and deferred: passed
# m2_entry_probe.py (the A/B on a GPU) ran after the patch landed (2908a70): ../2026-12-06-mamba2-entry-cursor/
