#!/usr/bin/env bash
# Session 44, call d (one H200, the session's last device time): served cache off / on / on with automatic
# garbage collection off after start-up (HYBRIDSERVE_GC_FREEZE=disable), one round, 1024/64 at 8 req/s, decode-only
# step phases reported: is the cache-on worker's longer launch / update the collector walking the cache's objects?
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu colocated-1gpu-nogc" ROUNDS=1 NUM_PROMPTS=120 \
  timeout 320 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -80 "$R/ab.log"
