#!/usr/bin/env bash
# Serving benchmark on one GPU: Nemotron-Nano-9B-v2 shapes, random bf16 weights (--load-format dummy), the
# router and workers as plain processes (no Ray). Disaggregated (1 prefill + 1 decode worker) vs a single
# worker (the decode worker prefills everything itself). Writes bench/serve.py JSON into $1.
#   bash bench/serve_gpu.sh bench/results/h200/serve
set -euo pipefail
OUT=${1:-bench/results/gpu/serve}
mkdir -p "$OUT"
MODEL=$(mktemp -d)
cp bench/configs/nemotron-nano-9b-v2.json "$MODEL/config.json"
COMMON=(--no-ray --model "$MODEL" --device cuda --dtype bfloat16 --load-format dummy --gpu-memory-gb 24
        --max-num-seqs 32 --max-model-len 2048 --http-port 8000 --port 50051)
BENCH=(--base-url http://127.0.0.1:8000 --workload random --input-len 512 --output-len 128 --num-prompts 32
       --request-rate 8,inf --token-range 3,1000 --warmup 4 --no-plots --result-dir "$OUT")

run() {
  local name=$1; shift
  hybridserve serve "${COMMON[@]}" "$@" > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 150); do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null; then
      break
    fi
    sleep 1
  done
  python3 bench/serve.py "${BENCH[@]}" --result-name "$name" || true
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 2
}

run disaggregated
run single-worker --local-prefill-max-tokens 100000
