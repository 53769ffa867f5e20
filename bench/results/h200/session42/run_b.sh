#!/usr/bin/env bash
# Session 42, call B (one H200): step phases per engine variant (prefix cache on/off, fold on/off) in one process,
# then served 1024/64 at 8 req/s: split mixed steps vs decode rows folded into the prefill graph.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
(cd bench && timeout 260 python3 step_phases.py --modes graphs,cache,fold,fold-cache --prompt-len 1024 \
  --decode-rows 0 4 --repeats 15 --gpu-memory-gb 8 --out "$R/step_phases.json" > "$R/step_phases.log" 2>&1)
echo "phases rc=$?"; grep "^{'mode" "$R/step_phases.log"
WORKLOADS=1024:64 RATES=8 NUM_PROMPTS=160 OFFLINE_BATCHES="4 8" PROBE=1 PASSES="p1 p2" \
  timeout 320 bash bench/serve_gpu.sh "$R/serve" colocated-1gpu colocated-1gpu-fold > "$R/serve.log" 2>&1
echo "serve rc=$?"; cat "$R/serve/table.md" 2>/dev/null | cut -d'|' -f2-4,8-11,17
