# 2026-12-05. Runs 1-2: one NVIDIA H200 (driver 580.159.04); runs 3-4: one H100 80GB HBM3 (the same driver). jax 0.11.2,
# PyTorch 2.11 and Triton 3.6 for the other projects' kernels. Four GPU commands from the repository root within
# 35 minutes, the tree of 7571b10 (kernels of 5ccc4fc) but where said; files here as runN_<name>. The scripts here ran
# from the repository root with PYTHONPATH=$PWD (the anchors harness extracted to .anchors/).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
S=bench/results/2026-12-05-standard-step-h200

# run 1 (H200): vLLM's GDN kernel at its best config, then our GDN standard step with its update plain and fused
# (probe_std_tiles.py holds the two probes of runs 1 and 2, which ran as two scripts of the same code, one variant
# list each)
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --repeats 3 --deadline-s 1 > vllm.log 2>&1
python3 $S/probe_std_tiles.py fma > probe.log 2>&1
# then the four GPU test files of run 2 under `timeout 150`: stopped at 150 s while compiling (run1_gpu_tests.log)

# run 2 (H200, the same machine a few minutes later): 8 x 1 tiles, then the GPU tests of the kernels of 5ccc4fc
python3 $S/probe_std_tiles.py tiles > probe.log 2>&1
python3 -m pytest -m gpu tests/test_kernels.py tests/test_pool.py tests/test_inplace_hlo.py tests/test_verify_kernels.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1   # 207 passed

# run 3 (H100): vLLM's GDN kernel, then the standard step in column pieces (pieces.py, probe_pieces.py; the run
# used earlier copies of both with the same code for P = 2 and 4)
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --repeats 3 --deadline-s 1 > vllm.log 2>&1
python3 $S/probe_pieces.py > probe.log 2>&1
# The static counts of cpu_compile_pieces.txt (no GPU): each variant's Triton IR written by pieces.py
#   for P in 0 2 4; do python3 $S/pieces.py ttir DIR $P; done; python3 $S/pieces.py ttir DIR 4 split
# and compiled for sm_90 by upstream Triton 3.6 (PyPI) with enable_fp_fusion off, as XLA builds its kernels:
#   python3 bench/results/2026-12-05-standard-step-fma/compile_ttir.py DIR nofusion

# run 4 (H100; the tree with heads_a_program.patch applied: the Mamba-2 launch after the readout over heads a
# program): the A/B (stopped by its 250 s limit during batch 512; f32 not reached), then that kernel's GPU tests
# at 2 and 4 heads a program (hb_plugin.py sets them in every pytest worker)
git apply $S/heads_a_program.patch
timeout 250 python3 $S/probe_heads.py > probe.log 2>&1
for hb in 2 4; do PYTHONPATH=$PWD:$S HB=$hb python3 -m pytest -p hb_plugin -m gpu tests/test_mamba2_tma.py -q -n 16 \
  -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests_hb$hb.log 2>&1; done   # 18 passed each
git apply -R $S/heads_a_program.patch
