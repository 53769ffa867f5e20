#!/usr/bin/env bash
# Session 45, call h (one H200, ~8 min): late hand-off is now the default (HYBRIDSERVE_LATE_HANDOFF=1). Served
# prefix cache off vs on under the new default, beside on with the outputs handed off at once (-early, the old
# default), ABBA over 2 rounds x 2 passes, 1024/64 at 8 req/s; then the offline engine's
# batch-4 decode step and phases (bench/one_batch.py) for "TPOT <= 1.5x the engine's step".
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu colocated-1gpu-early" ROUNDS=2 ABBA=1 \
  NUM_PROMPTS=120 timeout 420 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -75 "$R/ab.log"
(cd bench && timeout 70 python3 one_batch.py --batch 4 --input-len 1024 --output-len 64 --repeats 3 \
  --json "$R/one_batch_4x1024.json" > "$R/one_batch.log" 2>&1)
echo "one_batch rc=$?"; grep -A6 '"decode_phase_ms_p50"' "$R/one_batch_4x1024.json" | tail -7
