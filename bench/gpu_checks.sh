#!/usr/bin/env bash
# The GPU checks, in one command (results in bench/RESULTS.md):
#   1. the kernel tests at realistic shapes (pytest -m gpu),
#   2. replayssm-generate --backend pallas --compare on a fixture (tokens vs transformers)
#      and on a random-weight Nemotron-3-Nano-4B-shaped model,
#   3. the kernel benchmark at the batches given in $KERNEL_BATCHES (default 256),
#   4. the decode attention kernel against XLA's products at batch 1 and 256 (bench/attention.py).
# Logs and JSON go to $OUT (or bench/results/DATE-gpu-checks when unset).
# `bash bench/gpu_checks.sh tests` runs part 1 only, `bash bench/gpu_checks.sh bench` parts 2-4 (each part
# within a 10-minute command; all parts: no argument).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
part=${1:-all}
case $part in all | tests | bench) ;; *) echo "usage: $0 [tests | bench]; got $part" >&2; exit 2 ;; esac
out=${OUT:-bench/results/$(date -u +%F)-gpu-checks}
mkdir -p "$out"

# 16 pytest workers share the GPU (no preallocation): compiling the kernels is the slow part
# (16 cores on the H200 machine; the 207 tests took 288 s on 2026-12-02).
if [[ $part != bench ]]; then
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -m gpu tests/test_kernels.py tests/test_verify_kernels.py \
  tests/test_quantized_state.py tests/test_tree_verify.py tests/test_per_draft_verify.py tests/test_pool.py tests/test_conv.py tests/test_attention_decode.py \
  tests/test_inplace_hlo.py tests/test_tma_readout.py tests/test_mamba2_tma.py tests/test_tma_step.py \
  tests/test_gdn_gates.py tests/test_mamba2_dt_offset.py tests/test_conv_step.py \
  -q -n 16 -p no:cacheprovider -p no:benchmark -W ignore::DeprecationWarning 2>&1 \
  | tee "$out/gpu_tests.log" | tail -3
fi
[[ $part == tests ]] && exit 0

ids() { python3 -c "import numpy as n; r = n.load('$1')['prompt_ids']; print(';'.join(','.join(map(str, x)) for x in r))"; }
fixture=tests/data/qwen3_next_tiny
timeout 120 python3 -m replayssm_jax.generate --checkpoint $fixture --prompt-ids "$(ids $fixture/reference.npz)" \
  --max-new-tokens 40 --stop "" --backend pallas --compare --json > "$out/cli_fixture.json"
python3 - "$out/cli_fixture.json" $fixture/reference.npz <<'PY'
import json, sys, numpy as np
d = json.load(open(sys.argv[1])); ref = np.load(sys.argv[2])["generated_ids"].tolist()
print("fixture: standard == replay:", d["identical"], "| replay == transformers:", d["runs"]["replay"]["generated_ids"] == ref)
PY

rows=$(python3 -c "print(';'.join(','.join(str(3 + (31 * i + 7 * j) % 5000) for j in range(64)) for i in range(64)))")
timeout 200 python3 -m replayssm_jax.generate --checkpoint bench/configs/nemotron3_nano_4b_like --random-weights \
  --dtype bfloat16 --backend pallas --compare --json --prompt-ids "$rows" --max-new-tokens 32 --stop "" \
  > "$out/cli_nemotron.json"
python3 -c "import json; d = json.load(open('$out/cli_nemotron.json')); r = d['runs']
print('nemotron-4b-like b64 bf16: identical', d['identical'], '| speedup %.2fx' % d['speedup'],
      '| tok/s std %.0f replay %.0f | compile s %.0f / %.0f' % (r['standard']['tokens_per_s'], r['replay']['tokens_per_s'],
      r['standard']['compile_s'], r['replay']['compile_s']))"

timeout 170 python3 bench/kernels.py --batches "${KERNEL_BATCHES:-256}" --lengths 8,16 --repeats 5 \
  --out "$out" --tag kernels 2>&1 | tail -14

timeout 150 python3 bench/attention.py --batches 1,256 --tilings 32:4:2,64:4:2 --repeats 5 --out "$out" 2>&1 | tail -12
