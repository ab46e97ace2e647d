#!/usr/bin/env bash
# GPU run 3: end to end at batch 1, Qwen3.5-4B-like, standard state, the GDN layers' conv fused or apart, profiled.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
for f in off on; do
  timeout 200 python3 bench/e2e.py --models qwen3_5_4b_like --batches 1 --modes standard --prompt-len 128 \
    --new-tokens 64 --fuse-conv $f --profile --out $OUT/e2e_fuse_$f.json > $OUT/e2e_fuse_$f.log 2>&1; echo "e2e $f rc=$?"
done
for f in off on; do python3 - $OUT/e2e_fuse_$f.json $f <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]
p = r.get("profile") or {}
print("fuse", sys.argv[2], "step ms", round(r["step_ms"], 3), {k: round(v, 3) for k, v in (p.get("ms") or {}).items()},
      "launches", p.get("launches"))
PY
done
