#!/usr/bin/env bash
# Session 44, call c (one H200): served cache off / on, ABBA over two rounds, 1024/64 at 8 req/s, the workers now
# reporting where their decode-only steps' time goes (schedule, launch, while_running, wait, update).
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu" ABBA=1 ROUNDS=2 NUM_PROMPTS=120 \
  timeout 500 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -80 "$R/ab.log"
