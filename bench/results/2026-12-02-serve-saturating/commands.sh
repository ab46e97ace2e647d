# 2026-12-02, one H200. serve_before: 3c7e1f8; serve_after: 20194c8 (the engine's programs looked up once,
# kept prefixes on the device). The JSON's `commit` field names the device checkout's stale .git.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T="--models qwen3_5_4b_like --requests 64 --rate 1000 --capacity 16 --prompt-len 256,512 --prompt-granule 256 --new-tokens 32,96 --system-len 256 --prefill-chunk 256"
python3 bench/serve.py $T            # serve_before.*
python3 bench/serve.py $T --states replay   # serve_after.*
