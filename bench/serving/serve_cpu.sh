#!/usr/bin/env bash
# Serving benchmark on the CPU with the embedded demo model (router + workers as processes, no Ray):
# disaggregated vs one worker, MTP speculation on vs off, prefix cache on vs off. JSON + PNGs into $1.
#   bash bench/serving/serve_cpu.sh OUT
set -euo pipefail
OUT=${1:-bench/results/cpu/serving}
mkdir -p "$OUT"
COMMON=(--no-ray --max-num-seqs 16 --max-model-len 2048 --port 8000 --grpc-port 50051)
MTP='{"method": "mtp", "num_speculative_tokens": 3, "rollback": "replay"}'
RANDOM_LOAD=(--workload random --input-len 256 --output-len 64 --num-prompts 24 --request-rate 2,inf
             --token-range 3,4000)
SHARED_LOAD=(--workload shared-prefix --num-groups 4 --prefix-len 512 --input-len 64 --output-len 32
             --num-prompts 32 --request-rate 4 --token-range 3,4000)

run() {  # name, bench args (up to --), server args
  local name=$1; shift
  local bench=()
  while [ "$1" != "--" ]; do bench+=("$1"); shift; done
  shift
  hybridserve serve "${COMMON[@]}" "$@" > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null && break
    sleep 1
  done
  python3 bench/serving/serve.py --base-url http://127.0.0.1:8000 "${bench[@]}" --result-dir "$OUT" --result-name "$name" || true
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 2
}

run disaggregated "${RANDOM_LOAD[@]}" --
run single-worker "${RANDOM_LOAD[@]}" -- --local-prefill-max-tokens 100000
run mtp-off "${RANDOM_LOAD[@]}" --request-rate 2 -- --local-prefill-max-tokens 100000
run mtp-on "${RANDOM_LOAD[@]}" --request-rate 2 -- --local-prefill-max-tokens 100000 --speculative-config "$MTP"
run prefix-cache-on "${SHARED_LOAD[@]}" -- --local-prefill-max-tokens 100000
run prefix-cache-off "${SHARED_LOAD[@]}" -- --local-prefill-max-tokens 100000 --no-prefix-caching

python3 bench/serving/serve.py --compare "$OUT/disaggregated-sweep.json" "$OUT/single-worker-sweep.json" \
  --labels "1 prefill + 1 decode,one worker" --result-dir "$OUT" --result-name disaggregation
python3 bench/serving/serve.py --compare "$OUT/mtp-off-rate2.json" "$OUT/mtp-on-rate2.json" \
  --labels "MTP off,MTP on (K=3)" --result-dir "$OUT" --result-name mtp
python3 bench/serving/serve.py --compare "$OUT/prefix-cache-off-rate4.json" "$OUT/prefix-cache-on-rate4.json" \
  --labels "prefix cache off,prefix cache on" --result-dir "$OUT" --result-name prefix-cache
