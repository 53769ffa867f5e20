#!/usr/bin/env bash
# Issue 20's side-by-side on one GPU: the offline engine (bench/one_batch.py, bench/engine_trace.py) and the
# server around it (bench/serve_gpu.sh, cold then warm pass, prefix caching on and off), one run, one GPU.
#
#   bash bench/serve_speed_gpu.sh OUT
#
# OUT/one_batch-*.json      prefill time and decode step of the offline engine
# OUT/engine_trace/         the served workload replayed in-process: per-step time split, compiles, profiles
# OUT/serve/                the same workload through the router and one worker (+ table.md)
set -uo pipefail
OUT=${1:-bench/results/gpu/serve_speed}
mkdir -p "$OUT/serve" "$OUT/engine_trace"
OUT=$(cd "$OUT" && pwd)
IN=${IN:-1024} OUTLEN=${OUTLEN:-64} RATE=${RATE:-8} NUM_PROMPTS=${NUM_PROMPTS:-64} SERVE_PROMPTS=${SERVE_PROMPTS:-160}
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
(cd bench && python3 one_batch.py --batch 32 --input-len 256 --output-len 32 --json "$OUT/one_batch-32x256.json") \
  > "$OUT/one_batch.log" 2>&1
(cd bench && python3 one_batch.py --batch 8 --input-len "$IN" --output-len "$OUTLEN" \
  --json "$OUT/one_batch-8x$IN.json") >> "$OUT/one_batch.log" 2>&1
(cd bench && python3 engine_trace.py --rate "$RATE" --num-prompts "$NUM_PROMPTS" --input-len "$IN" \
  --output-len "$OUTLEN" --out "$OUT/engine_trace") > "$OUT/engine_trace.log" 2>&1
PROBE=1 PASSES="cold warm" WORKLOADS="$IN:$OUTLEN" RATES="$RATE" NUM_PROMPTS="$SERVE_PROMPTS" \
  bash bench/serve_gpu.sh "$OUT/serve" ${DEPLOYMENTS:-colocated-1gpu colocated-1gpu-nocache} > "$OUT/serve.log" 2>&1
