# 2026-12-05, one H100 80GB HBM3 (driver 580.159.04), jax 0.11.2, PyTorch 2.11 and Triton 3.6 for the other
# projects' kernels. Six GPU commands from the repository root within 40 minutes; files here as runN_<name>. The
# scripts here ran from the repository root with PYTHONPATH=$PWD (the anchors harness extracted to .anchors/).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
m=launch__registers_per_thread,gpu__time_duration.sum,dram__bytes.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum

# run 1 (tree 28050a1): load and store widths (run1_widths.txt). Each report's SASS read with
#   ncu -i REPORT --csv --page source --print-source sass
ncu --clock-control none -k regex:gdn_step --launch-skip 2 --launch-count 1 --metrics $m --section SourceCounters -o ours \
  python3 std_probe.py ours.ttir   # also compiles the kernel's Triton IR with upstream Triton
ncu --clock-control none -k regex:packed_decode --launch-skip 3 --launch-count 1 --metrics $m --section SourceCounters -o vllm \
  python3 .anchors/harness_orig.py run --out o.json --layers gdn --batches 256 --dtypes float32 --lengths 16 --repeats 1
(cd bench && ncu --clock-control none -k regex:^_update --launch-skip 1 --launch-count 1 --metrics $m --section SourceCounters -o tri \
  python3 triton_ceiling.py --configs 32x1x1 --dtypes float32 --mib 256 --repeats 1)
(cd bench && ncu --clock-control none -k regex:^update_ --launch-skip 1 --launch-count 1 --metrics $m --section SourceCounters -o pallas \
  python3 triton_ceiling.py --configs 32x1x1 --dtypes float32 --mib 256 --repeats 1)

# run 2 (tree 28050a1): sections of ours on 16 x 1 and 32 x 1 and of vLLM's kernel (run2_ncu_*.txt, run2_sass_mix.txt)
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --section SourceCounters"
for c in 16x1 32x1; do ncu --clock-control none -k regex:gdn_step --launch-skip 2 --launch-count 1 $S -o ours_$c python3 std_probe2.py $c; done
ncu --clock-control none -k regex:packed_decode --launch-skip 3 --launch-count 1 $S -o vllm \
  python3 .anchors/harness_orig.py run --out o.json --layers gdn --batches 256 --dtypes float32 --lengths 16 --repeats 1

# run 3 (tree 28050a1): vLLM's GDN kernel, then variants of our GDN standard step (probe_fma.py)
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --deadline-s 10 > vllm.log 2>&1
python3 probe_fma.py > probe.log 2>&1

# run 4 (tree 28050a1 with tiles.fma, used in both layers' standard steps for both state dtypes; probe_fma2.py swaps
# each layer's `fma` for a * b + c in its "plain" rows): both layers' vLLM kernels, then the A/B
python3 .anchors/harness_orig.py run --out vllm.json --layers gdn,mamba2 --batches 64,256,512 --dtypes float32,bfloat16 \
  --lengths 16 --deadline-s 5 > vllm.log 2>&1
python3 probe_fma2.py > probe.log 2>&1

# run 5 (the committed tree: fma in the GDN step on f32 states only): GPU tests of the changed kernels
python3 -m pytest -m gpu tests/test_kernels.py tests/test_pool.py tests/test_inplace_hlo.py tests/test_verify_kernels.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning > gpu_tests.log 2>&1
# 206 passed, 1 failed: test_verify_gpu[bf16in-f32state-mamba2-b256-H96-P80-N128-G8], out of GPU memory with 16
# workers on the 80 GB card (RESOURCE_EXHAUSTED allocating 960 MiB). Run 6, that test alone: 1 passed in 44.6 s.
python3 -m pytest -m gpu "tests/test_verify_kernels.py::test_verify_gpu[bf16in-f32state-mamba2-b256-H96-P80-N128-G8]" -q
