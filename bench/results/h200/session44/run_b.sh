#!/usr/bin/env bash
# Session 44, call b (one H200): served cache off / on / on with the cache-off memory layout (8 checkpoint slots,
# the cache-off 8192 KV pages), ABBA over two rounds, 1024/64 at 8 req/s; the workers now report their
# decode-only steps apart (mean step and mean batch), so the served decode step is compared directly.
set -uo pipefail
R=$1; mkdir -p "$R"
git rev-parse --short HEAD > "$R/commit.txt"; git status --short >> "$R/commit.txt"
RAW_DIR="$R/raw" VARIANTS="colocated-1gpu-nocache colocated-1gpu colocated-1gpu-fewckpt" ABBA=1 ROUNDS=2 NUM_PROMPTS=120 \
  timeout 585 bash bench/serve_cache_ab.sh "$R/ab" > "$R/ab.log" 2>&1
echo "ab rc=$?"; tail -60 "$R/ab.log"
