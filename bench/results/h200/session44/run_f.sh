#!/usr/bin/env bash
# Plan for a device call after run_e.sh (one H200, ~9 min): served cache off / on / on without automatic GC (call d
# of session 44 was cut off before its third server) / on with late hand-off (outputs go to their streams while
# the next forward runs), one round, 1024/64 at 8 req/s: decode-only step phases and GC pauses per second from the
# workers' metrics; then the offline engine's own phases at batch 4 (bench/one_batch.py) beside them.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu colocated-1gpu-nogc colocated-1gpu-late" ROUNDS=1 \
  NUM_PROMPTS=120 timeout 420 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -60 "$R/ab.log"
(cd bench && timeout 100 python3 one_batch.py --batch 4 --input-len 1024 --output-len 64 --repeats 3 \
  --json "$R/one_batch_4x1024.json" > "$R/one_batch.log" 2>&1)
echo "one_batch rc=$?"; grep -A6 '"decode_phase_ms_p50"' "$R/one_batch_4x1024.json" | tail -7
