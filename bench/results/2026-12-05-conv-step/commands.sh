# 2026-12-05, no GPU: the static SASS of cpu_compile.txt, on a CPU from the repository root (jax 0.11.2;
# upstream Triton 3.6 from PyPI in a separate environment for the compile to sm_90).
#   python3 bench/results/2026-12-05-conv-step/conv_step_ttir.py DIR      # the Triton IR of the step, the conv
#                                                                          # launch and the fused step (Qwen3.5-4B
#                                                                          # layer, batch 1, 64, 256; f32, bf16)
#   then each file compiled with enable_fp_fusion off (as XLA builds its kernels), 1 warp for the step and
#   fused kernels and 4 for the conv launch (their default tilings), and its SASS read with cuobjdump:
#   bench/results/2026-12-05-standard-step-fma/compile_ttir.py DIR nofusion (num_warps set per file)
#   python3 bench/results/2026-12-05-conv-step/same_ttir.py DIR           # the step's and the conv launch's IR,
#                                                                          # run at a94592c and at cf84120: identical
#
# On a GPU (2026-12-05, one H100 80GB HBM3; the tree of 8bb00c3, its kernels those of 3e71e84), from the
# repository root, files here as runN_<name>:
#   run1.sh: bench/conv_step.py --batches 1,8,64,256 --profile --repeats 5, then tests/test_conv_step.py -m gpu
#   run2.sh: bench/e2e.py --models qwen3_5_4b_like --batches 1,8 --modes standard --prompt-len 128
#            --new-tokens 64 --fuse-conv off|on, then tests/test_conv.py tests/test_inplace_hlo.py -m gpu
#   run3.sh: the same e2e at batch 1 with --profile
