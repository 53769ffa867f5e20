#!/usr/bin/env bash
# Session 42, call C (one H200): decode graphs per batch size vs padded buckets; step phases cache on/off after
# eviction ahead and hashing off the loop; served cache on vs off (1024/64 at 8 req/s) with the offline steps.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
(cd bench && timeout 150 python3 decode_buckets.py --batches 1 2 3 4 5 6 7 8 --steps 30 --rounds 3 \
  --out "$R/decode_buckets.json" > "$R/decode_buckets.log" 2>&1)
echo "buckets rc=$?"; grep "^{'batch" "$R/decode_buckets.log"
(cd bench && timeout 170 python3 step_phases.py --modes graphs,cache --prompt-len 1024 --decode-rows 0 4 \
  --repeats 15 --gpu-memory-gb 8 --out "$R/step_phases.json" > "$R/step_phases.log" 2>&1)
echo "phases rc=$?"; grep "^{'mode" "$R/step_phases.log" | cut -c1-400
WORKLOADS=1024:64 RATES=8 NUM_PROMPTS=160 OFFLINE_BATCHES="4 5 8" PROBE=1 PASSES="p1 p2" \
  timeout 260 bash bench/serve_gpu.sh "$R/serve" colocated-1gpu colocated-1gpu-nocache > "$R/serve.log" 2>&1
echo "serve rc=$?"; cat "$R/serve/table.md" 2>/dev/null | cut -d'|' -f3,5,6,8,9,12-17
